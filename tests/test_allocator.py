"""The strategy bounds what glibc's malloc keeps of freed host memory (store/allocator.py): an 8 MiB buffer freed
after a larger one is given back to the kernel, where glibc's dynamic threshold would keep it resident."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatrain_lightning.store.allocator import glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc only")

_PROBE = textwrap.dedent("""
    import ctypes, sys
    from megatrain_lightning.store.allocator import bound_retention

    def rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "fit":
        import lightning.pytorch as pl
        from megatrain_lightning import MegaTrainStrategy
        from megatrain_lightning.testing import LM, learnable_data, make_model
        pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
            LM(make_model("llama")), learnable_data(n=2, seq=16, batch_size=2))
    from megatrain_lightning.store import allocator
    print("applied", allocator._applied if sys.argv[1] == "fit" else bound_retention())  # fit: what the strategy set
    big = libc.malloc(24 << 20)          # mmap'd; its free raises glibc's dynamic threshold to 24 MiB
    ctypes.memset(big, 1, 24 << 20)
    libc.free(big)
    base = rss()
    held = [libc.malloc(10 << 20) for _ in range(3)]   # below 24 MiB: from the heap unless the threshold is fixed
    for p in held:
        ctypes.memset(p, 1, 10 << 20)
    for p in reversed(held):
        libc.free(p)
    print("kept", rss() - base)
""")


def _probe(mode: str, **env: str) -> tuple[str, int]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e.update(env, PYTHONPATH=os.pathsep.join([os.getcwd(), e.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    applied = next(l for l in lines if l.startswith("applied"))
    return applied, int(next(l for l in lines if l.startswith("kept")).split()[1])


def test_freed_buffers_go_back_to_the_kernel():
    applied, kept = _probe("alone")
    assert "'M_MMAP_THRESHOLD': 8388608" in applied and "'M_ARENA_MAX': 2" in applied
    assert kept < 4 << 20, kept
    # glibc's defaults (turned off): the same frees stay resident
    applied, kept = _probe("alone", MEGATRAIN_MALLOC_TUNING="0")
    assert applied == "applied {}" and kept >= 20 << 20, kept
    # glibc's own variables win: nothing is set over them
    applied, _ = _probe("alone", MALLOC_ARENA_MAX="4")
    assert "M_ARENA_MAX" not in applied and "M_MMAP_THRESHOLD" in applied


def test_the_strategy_sets_it_up():
    """A fit sets the thresholds in its process (``MegaTrainStrategy.setup_environment``)."""
    applied, kept = _probe("fit")
    assert "'M_MMAP_THRESHOLD': 8388608" in applied and kept < 4 << 20, (applied, kept)


_SETUP = textwrap.dedent("""
    import lightning.pytorch as pl
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.store.allocator import bound_retention
    from megatrain_lightning.testing import LM, learnable_data, make_model

    def rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

    bound_retention()  # as after an earlier fit in this process: parameters under 8 MiB come from the heap
    model = make_model("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8)
    n = sum(p.numel() for p in model.parameters())
    data = learnable_data(n=2, seq=16, batch_size=2)
    base = rss()

    class Stop(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            print("grown", rss() - base, "params", n)
            raise SystemExit(0)

    pl.Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[Stop()],
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(LM(model), data)
""")


def test_the_modules_own_parameter_memory_leaves_the_process_when_the_store_takes_the_weights():
    """The RAM tier copies the module's parameters into its slabs and frees them; those under glibc's mmap threshold
    were heap memory, which stays resident unless given back (``engine/streaming.py`` trims the heap once the store is
    built). At the start of training the process holds the fp32 weights once, in the store: RSS grew by much less than
    the 4 B/param a second copy would add."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e["PYTHONPATH"] = os.pathsep.join([os.getcwd(), e.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _SETUP], env=e, capture_output=True, text=True, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("grown")), None)
    assert line is not None, out.stderr[-3000:]
    grown, n = int(line.split()[1]), int(line.split()[3])
    assert grown < 4 * n // 4, (grown, 4 * n)


_STEPS = textwrap.dedent("""
    import lightning.pytorch as pl
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM, learnable_data, make_model

    def rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

    model = make_model("llama", attn="sdpa", hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8192)
    at = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            at.append(rss())

    pl.Trainer(strategy=MegaTrainStrategy(recompute="none"), accelerator="cpu", devices=1, max_steps=5, logger=False,
               callbacks=[Record()], enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(LM(model), learnable_data(n=5, seq=6930, batch_size=1))
    print("rss", *at)
""")


def test_every_step_starts_from_the_same_resident_memory_on_a_cpu_device():
    """On a CPU device a step's activations under glibc's mmap threshold are heap memory, which glibc keeps resident
    once freed, fragmented: without giving it back each step started from more resident memory than the last and
    peaked higher (a 2-layer Llama at 6,930 tokens, ``recompute="none"``: +168 to +177 MiB over 5 steps). The engine
    trims the heap at the end of every step (``StreamingEngine.end_step``): each step starts within 60 MiB (15% of
    one step's activations here, the optimizer state included) of the first."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    e["PYTHONPATH"] = os.pathsep.join([os.getcwd(), e.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _STEPS], env=e, capture_output=True, text=True, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("rss")), None)
    assert line is not None, out.stderr[-3000:]
    at = [int(x) for x in line.split()[1:]]
    assert len(at) == 5
    assert max(at[1:]) - at[0] < 60 * 2**20, [round(x / 2**20) for x in at]
