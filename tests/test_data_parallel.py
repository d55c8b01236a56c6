"""Data parallel: several processes launched by Lightning's own launcher, gloo on this CPU.

Reference (as DDP promises): W processes with micro-batch b train like one process with micro-batch W*b.
The runs are real ``python tests/dp_worker.py`` processes. Tests of the entry points start rank 0 only and
Lightning's subprocess script launcher starts the other ranks, exactly as for a user's ``python train.py``
(``launch(..., spawn=True)``); the others start every rank at once with the variables ``torchrun`` sets
(``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``; Lightning then spawns nothing), which runs
the same training and halves the time the ranks spend importing one after the other. The reference is plain
PyTorch (:func:`megatrain_lightning.testing.reference_train`) on the global batch.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain_lightning import testing as T
from megatrain_lightning.parallel.lifetime import dies_with_this_process, parent_env

WORKER = Path(__file__).with_name("dp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _arg(args: tuple, name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def launch(out: Path, *args: str, env: dict | None = None, timeout: float = 300,
           spawn: bool = False, worker: Path = WORKER) -> subprocess.CompletedProcess:
    """Run ``worker`` on one node and return the finished run: with ``spawn`` (or one process) rank 0 only, and
    Lightning's launcher starts the others; else every rank at once, as ``torchrun`` starts them. The result has
    the first failing rank's return code (0 when all succeed) and every rank's output, rank by rank."""
    e = {**os.environ, "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1", **(env or {})}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):  # a clean launch, whatever runs the tests
        if env is None or k not in env:
            e.pop(k, None)
    cmd = [sys.executable, str(worker), str(out), *args]
    devices = _arg(args, "--devices", 2)
    if spawn or devices == 1 or _arg(args, "--num-nodes", 1) != 1 or (env and "LOCAL_RANK" in env):
        return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=dies_with_this_process())
    procs = [subprocess.Popen(cmd, env={**e, "LOCAL_RANK": str(r), "RANK": str(r), "NODE_RANK": "0",
                                        "WORLD_SIZE": str(devices)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=dies_with_this_process()) for r in range(devices)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    return subprocess.CompletedProcess(cmd, next((c for c in codes if c), 0),
                                       "".join(f"[rank {r}]\n{o}" for r, (o, _) in enumerate(outs)),
                                       "".join(f"[rank {r}]\n{x}" for r, (_, x) in enumerate(outs)))


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def per_step_losses(out: Path, world: int) -> list[float]:
    """Per micro-batch loss, mean over the ranks (each rank's loss is the mean over its micro-batch)."""
    ranks = [torch.load(out / f"losses_{r}.pt") for r in range(world)]
    return [sum(v) / world for v in zip(*ranks)]


class ShuffledEpochs:
    """The global batches of a data-parallel run over :func:`megatrain_lightning.testing.make_data`'s samples:
    Lightning injects ``DistributedSampler(shuffle=True, seed=0)`` into training loaders and calls
    ``set_epoch(e)`` every epoch, so epoch ``e`` visits ``randperm(n)`` seeded ``0 + e``; rank ``r`` of ``W`` takes
    positions ``r, r + W, ...`` of it, so the union of the ranks' k-th micro-batches of size ``b`` is positions
    ``[k*W*b, (k+1)*W*b)``: one process's k-th batch of size ``W*b``. Each ``iter()`` is the next epoch."""

    def __init__(self, n: int, global_batch: int):
        self.ids = next(iter(T.make_data(n=n, batch_size=n)))[0]
        self.b, self.epoch = global_batch, 0

    def __iter__(self):
        perm = torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(self.epoch))
        self.epoch += 1
        for i in range(0, len(perm), self.b):
            yield (self.ids[perm[i : i + self.b]],)


def reference(arch: str, batch: int, steps: int, accumulate: int, clip: float | None, sched: str | None,
              n: int = 64) -> tuple[torch.nn.Module, list[float]]:
    """Plain PyTorch on the global batch ``batch`` (the ranks' micro-batches together)."""
    model = T.make_model(arch)
    T.freeze_key_biases(model)
    losses = T.reference_train(model, ShuffledEpochs(n, batch), steps, accumulate=accumulate, clip=clip, sched=sched)
    return model, losses


def assert_matches(out: Path, world: int, ref_model: torch.nn.Module, ref_losses: list[float], tol: float) -> None:
    losses = per_step_losses(out, world)
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) / abs(b) <= tol, f"micro-batch {i}: loss {a} vs reference {b}"
    weights = torch.load(out / "weights.pt")
    for k, p in ref_model.named_parameters():
        r = T.rel(weights[k], p.detach())
        assert r <= tol, f"{k}: relative weight error {r:.3e}"


@pytest.mark.parametrize("arch", ["llama", "mixtral", "gpt2", "llama_tied"])
def test_two_processes_match_one_with_the_global_batch(tmp_path, arch):
    """2 ranks x micro-batch 2 = plain PyTorch with micro-batch 4: accumulation 2, norm clipping, cosine LR,
    12 steps; every loss (mean over ranks) and every final weight within 1e-5 relative (GPT-2: 3e-5). Mixtral:
    experts no token of a rank was routed to; GPT-2: frozen key biases; llama_tied: the embedding read by two blocks.

    GPT-2's LayerNorm biases start at zero and stay small, so float32 summation order (two ranks' gradients summed
    by all-reduce vs one batch of 4) moves them by more relative to their size: 1.39e-5 on this machine's CPU with
    the pre-grad-mode engine too (7c581e9), while the other weights and every loss stay within 1e-5."""
    check(launch(tmp_path, "--arch", arch, "--devices", "2", "--batch", "2", "--steps", "12", "--accumulate", "2",
                 "--clip", "0.5", "--sched", "cosine", spawn=True))
    model, losses = reference(arch, 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 2, model, losses, 3e-5 if arch == "gpt2" else 1e-5)
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["world_size"] == 2 and env["sampler"] == "DistributedSampler" and env["shared_store"]
    assert env["cluster_environment"] == "LightningEnvironment"  # python train.py: Lightning's launcher spawned rank 1


def test_backbone_finetuning_two_processes_match_plain_lightning_on_the_global_batch(tmp_path):
    """``BackboneFinetuning`` unfreezes the embedding and layer 0 into a new param group at epoch 1 (accumulation 2,
    norm clipping): 2 processes against plain Lightning in one process on the global batch. (Lightning's ``ddp``
    is no reference here: PyTorch's DDP reducer registers only the parameters trainable when it is built, so the
    unfrozen layers' gradients are never averaged; measured 22% off.)"""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning

    check(launch(tmp_path, "--backbone-finetuning", "--n", "16", "--steps", "6", "--clip", "0.5"))
    model = T.make_model("llama")
    T.freeze_key_biases(model)
    lm = T.BackboneLM(model)
    epochs = ShuffledEpochs(16, 4)
    pl.Trainer(strategy="auto", accelerator="cpu", devices=1, max_steps=6, accumulate_grad_batches=2, gradient_clip_val=0.5,
               logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               use_distributed_sampler=False,
               callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0)]
               ).fit(lm, _Epochs(epochs, 4))
    assert T.rel(model.model.embed_tokens.weight, T.make_model("llama").model.embed_tokens.weight) > 1e-4
    assert_matches(tmp_path, 2, model, lm.losses, 1e-5)


class _Epochs:
    """A loader of ``batches`` global batches per epoch (``iter()``: the next of ``epochs``' epochs)."""

    def __init__(self, epochs: ShuffledEpochs, batches: int):
        self.epochs, self.batches = epochs, batches

    def __iter__(self):
        return iter(self.epochs)

    def __len__(self) -> int:
        return self.batches


def test_offload_activations_two_processes(tmp_path):
    """As above with the saved block inputs in host memory (llama)."""
    check(launch(tmp_path, "--arch", "llama", "--devices", "2", "--batch", "2", "--steps", "12", "--accumulate", "2",
                 "--clip", "0.5", "--sched", "cosine", "--offload-activations"))
    model, losses = reference("llama", 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 2, model, losses, 1e-5)


@pytest.mark.parametrize("recompute", ["selective", "none", "auto"])
def test_recompute_policies_two_processes(tmp_path, recompute):
    """As above with each recompute policy that keeps more than the block inputs (llama_tied: the tied
    embedding, whose backward under "none" fetches no weight). ``"auto"`` logs its choice once, from global rank 0
    (each rank logged its own identical line)."""
    proc = launch(tmp_path, "--arch", "llama_tied", "--devices", "2", "--batch", "2", "--steps", "12", "--accumulate",
                  "2", "--clip", "0.5", "--sched", "cosine", "--recompute", recompute)
    check(proc)
    if recompute == "auto":
        ranks = (proc.stdout + proc.stderr).split("[rank ")
        said = [r[0] for r in ranks if "recompute='auto' with activation_memory_limit" in r]
        assert said == ["0"], said
    model, losses = reference("llama_tied", 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 2, model, losses, 1e-5)


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_an_edit_inside_summon_full_params_two_processes(tmp_path, tier):
    """Every rank halves the LM head inside ``summon_full_params`` in ``on_fit_start``: each rank edits a copy of its
    own and the node's shared weights get the result once (straight into the shared RAM-tier masters the
    read-modify-write ran once per rank, racing: lm_head norm 1.139 after a step against 0.787); the same numbers as
    plain PyTorch on the global batch with the edit made once."""
    extra = ("--nvme", str(tmp_path / "nv")) if tier == "nvme" else ()
    if extra:
        (tmp_path / "nv").mkdir()
    check(launch(tmp_path, "--arch", "llama", "--devices", "2", "--batch", "2", "--steps", "6", "--accumulate", "1",
                 "--summon-edit", *extra))
    from dp_worker import summon_edit
    model = T.make_model("llama")
    T.freeze_key_biases(model)
    summon_edit(model)
    losses = T.reference_train(model, ShuffledEpochs(64, 4), 6, accumulate=1, clip=None, sched=None)
    assert_matches(tmp_path, 2, model, losses, 1e-5)


def test_optimizer_in_backward_two_processes(tmp_path):
    """``optimizer_in_backward=True``: each owner applies its slabs' updates on its D2H worker as their last
    gradients arrive, the other rank waits for them; the same numbers as plain PyTorch (no clipping: the
    in-backward schedule needs every gradient first for it)."""
    check(launch(tmp_path, "--arch", "llama", "--devices", "2", "--batch", "2", "--steps", "12", "--accumulate", "2",
                 "--sched", "cosine", "--optimizer-in-backward"))
    assert json.loads((tmp_path / "updates_in_backward.json").read_text()) > 0
    model, losses = reference("llama", 4, 12, 2, None, "cosine")
    assert_matches(tmp_path, 2, model, losses, 1e-5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_two_processes_match_one(tmp_path, precision):
    """bf16-mixed and 16-mixed (loss scaling: the inf check and skip decision combined over the ranks): 2 ranks x
    micro-batch 2 against one megatrain process with micro-batch 4 in the same sample order (the wire rule makes
    plain autocast a different computation: tests/test_precision.py). The
    batch split changes bf16 roundings of activations (and Adam's normalisation amplifies them on small
    gradients), so the match is close, not bitwise: measured losses within 2e-3 and the worst weight tensor
    3.4e-3 relative after 12 steps (the fp32 runs of this split match plain PyTorch to 1e-5, above); asserted
    at 2e-3 (losses) and 1e-2 (weights)."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--arch", "llama", "--steps", "12", "--accumulate", "2", "--clip", "0.5", "--sched", "cosine",
              "--precision", precision]
    check(launch(one, *common, "--devices", "1", "--batch", "4"))
    check(launch(two, *common, "--devices", "2", "--batch", "2"))
    env = json.loads((two / "env.json").read_text())
    assert env["shared_store"] and env["shared_wire_images"]  # one copy per node, bf16 images included
    ref_losses = torch.load(one / "losses_0.pt")
    for i, (a, b) in enumerate(zip(per_step_losses(two, 2), ref_losses)):
        assert abs(a - b) / abs(b) <= 2e-3, f"micro-batch {i}: loss {a} vs one process {b}"
    wa, wb = torch.load(two / "weights.pt"), torch.load(one / "weights.pt")
    worst = max(T.rel(wa[k], wb[k]) for k in wb)
    assert worst <= 1e-2, worst


def test_two_nodes_on_loopback(tmp_path):
    """Two "nodes" on this machine (two launches with num_nodes=2, NODE_RANK=0/1, MASTER_ADDR=127.0.0.1), each
    with 2 local ranks and its own shared store: 4 ranks x micro-batch 1 = plain PyTorch with micro-batch 4."""
    port = str(free_port())
    args = ["--arch", "llama", "--devices", "2", "--num-nodes", "2", "--batch", "1", "--steps", "12", "--accumulate",
            "2", "--clip", "0.5", "--sched", "cosine"]
    procs = []
    for node in (0, 1):
        env = {**os.environ, "MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1", "NODE_RANK": str(node)}
        for k in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=dies_with_this_process()))
    for p in procs:
        out, err = p.communicate(timeout=400)
        assert p.returncode == 0, out[-2000:] + err[-5000:]
    model, losses = reference("llama", 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 4, model, losses, 1e-5)
    first, second = torch.load(tmp_path / "node_weights_0.pt"), torch.load(tmp_path / "node_weights_2.pt")
    for k in first:  # the owners on both nodes applied the same updates to their own copies
        assert torch.equal(first[k], second[k]), k


@pytest.mark.parametrize("first,then,tier", [(2, 1, "ram"), (1, 2, "ram"), (2, 2, "nvme")])
def test_exact_resume_across_world_sizes(tmp_path, first, then, tier):
    """A checkpoint written mid-epoch (step 5 of 8 per epoch) by ``first`` processes resumes in ``then`` processes
    (same global batch 4) and ends where an uninterrupted run ends: the same samples at every later step
    (ResumableDataLoader counts global samples), every later loss (mean over ranks) and every final weight
    within 1e-5 relative (a different batch split rounds differently, so not bitwise). ``nvme``: the interrupted
    run and the resumed one keep everything on NVMe (each rank writes and loads only its own slabs' masters and
    AdamW states; the others read the loaded masters from the owners' files), the uninterrupted one in RAM."""
    common = ["--arch", "llama", "--accumulate", "2", "--clip", "0.5", "--sched", "cosine", "--total-steps", "12",
              "--resumable"]
    def per_rank(world: int) -> list[str]:
        return ["--devices", str(world), "--batch", str(4 // world)]
    full, part, rest = tmp_path / "full", tmp_path / "part", tmp_path / "rest"
    ckpt = tmp_path / "ckpt"
    disk = tmp_path / "nvme"
    disk.mkdir()
    tiered = ["--nvme", str(disk), "--host-memory-limit", "64MiB"] if tier == "nvme" else []
    check(launch(full, *common, *per_rank(first), "--steps", "12"))
    check(launch(part, *common, *per_rank(first), "--steps", "5", "--save", str(ckpt), *tiered))
    assert (ckpt / "model").is_dir()
    if first == 2:  # written together: each rank its own slabs' shards, rank 0 the index, checksums, metadata
        import transformers
        from megatrain_lightning.checkpoint.hf_io import verify_checksums

        for part in ("model", "optimizer"):
            shards = sorted(p.name for p in (ckpt / part).glob("*.safetensors"))
            assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
            verify_checksums(ckpt / part)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "model")
        saved = torch.load(tmp_path / "part" / "weights.pt")
        for k, v in hf.named_parameters():
            assert torch.equal(v.detach(), saved[k]), k
    check(launch(rest, *common, *per_rank(then), "--steps", "12", "--resume", str(ckpt), *tiered))
    assert_resumed_like(rest, then, full, first, skip=5 * 2, n=14)
    if tiered:  # each rank's store held its own slabs, and is gone
        stores = [json.loads((rest / f"nvme_{r}.json").read_text()) for r in range(then)]
        assert all(s["owned"] and s["written_bytes"] > 0 for s in stores), stores
        assert not list(disk.iterdir())


def test_persistent_buffer_outside_the_model_resumes_in_two_processes(tmp_path):
    """A persistent buffer of the LightningModule (outside the HF model; it scales the loss) is written to
    ``extra/`` by the processes writing together, ``model/`` stays a Hugging Face directory, and the resumed run
    (both ranks) continues from the saved value: buffer, losses and weights as the uninterrupted run."""
    common = ["--arch", "llama", "--accumulate", "2", "--resumable", "--counter-buffer", "--devices", "2",
              "--batch", "2"]
    full, part, rest, ckpt = tmp_path / "full", tmp_path / "part", tmp_path / "rest", tmp_path / "ckpt"
    check(launch(full, *common, "--steps", "6"))
    check(launch(part, *common, "--steps", "3", "--save", str(ckpt)))
    assert (ckpt / "model" / "config.json").is_file() and (ckpt / "extra").is_dir()
    check(launch(rest, *common, "--steps", "6", "--resume", str(ckpt)))
    for r in range(2):
        assert torch.load(rest / f"buffer_{r}.pt").item() == torch.load(full / f"buffer_{r}.pt").item() == 12.0
    assert_resumed_like(rest, 2, full, 2, skip=3 * 2, n=6)


def assert_resumed_like(rest: Path, world: int, full: Path, full_world: int, skip: int, n: int) -> None:
    """The resumed run (``rest``, ``world`` ranks) continued the uninterrupted one (``full``) after its first ``skip``
    micro-batches: ``n`` later losses (mean over ranks) and every final weight within 1e-5 relative."""
    want = per_step_losses(full, full_world)[skip:]
    got = per_step_losses(rest, world)
    assert len(got) == len(want) == n
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) / abs(b) <= 1e-5, f"micro-batch {skip + i}: {a} vs uninterrupted {b}"
    wa, wb = torch.load(rest / "weights.pt"), torch.load(full / "weights.pt")
    for k in wb:
        assert T.rel(wa[k], wb[k]) <= 1e-5, (k, T.rel(wa[k], wb[k]))


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_recipe_runs_on_two_processes(tmp_path, gpt2_dir, tier):
    """``python recipes/finetune.py trainer.devices=2 ...``: Lightning's launcher re-runs the Hydra command for
    rank 1; the run trains, evaluates (val_loss synced over ranks), saves one checkpoint and rank 0 writes the
    results. ``nvme``: ``strategy=megatrain_nvme`` (masters and AdamW states on NVMe)."""
    from test_recipe import tiny

    out = tmp_path / "run"
    tiered = ["strategy=megatrain_nvme", f"strategy.nvme_path={tmp_path}", "strategy.host_memory_limit=1GiB"] \
        if tier == "nvme" else []
    cmd = [sys.executable, str(WORKER.parent.parent / "recipes" / "finetune.py"), *tiny(gpt2_dir),
           "trainer.devices=2", "trainer.accelerator=cpu", f"output_dir={out}", "data=legal", *tiered]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(k, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          preexec_fn=dies_with_this_process())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["steps"] == 2
    if tier == "nvme":
        assert (summary["config"]["strategy"]["offload_params"], summary["config"]["strategy"]["offload_optimizer"]) \
            == ("nvme", "nvme")
        assert not list(tmp_path.glob("megatrain_store*"))  # each rank's store is removed at the end
    assert (out / "checkpoint" / "model" / "config.json").is_file()
    assert proc.stdout.count("HF checkpoint:") == 1  # rank 0 reports, once


def test_model_checkpoint_and_resume_from_last(tmp_path):
    """``ModelCheckpoint(every_n_train_steps=1, save_last=True, save_top_k=2)`` on two processes: rank 0 writes each
    directory checkpoint, older ones are pruned, ``last`` points at the newest; ``fit(ckpt_path="last")`` on two
    processes ends where the uninterrupted run ends (bitwise: the same split)."""
    common = ["--arch", "llama", "--accumulate", "2", "--sched", "cosine", "--total-steps", "8", "--resumable",
              "--devices", "2", "--batch", "2"]
    full, part, rest, ckpts = tmp_path / "full", tmp_path / "part", tmp_path / "rest", tmp_path / "ckpts"
    check(launch(full, *common, "--steps", "8"))
    check(launch(part, *common, "--steps", "5", "--model-checkpoint", str(ckpts)))
    kept = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("."))
    assert len([k for k in kept if k.startswith("epoch")]) == 2 and "last.ckpt" in kept, kept
    check(launch(rest, *common, "--steps", "8", "--model-checkpoint", str(ckpts), "--resume", "last"))
    assert per_step_losses(rest, 2) == per_step_losses(full, 2)[10:]
    wa, wb = torch.load(rest / "weights.pt"), torch.load(full / "weights.pt")
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k


def test_nvme_tier_with_two_processes_trains_bitwise_like_the_ram_tier(tmp_path):
    """The NVMe tier with 2 processes, against the RAM tier with 2 processes (accumulation 2, norm clipping, cosine
    LR; bitwise, as one process's NVMe tier is its RAM tier) and plain PyTorch on the global batch (1e-5):

    * ``offload_optimizer="nvme"``: the masters once in the node-shared RAM store, each rank's accumulators and
      AdamW states of the slabs it owns in its own store directory;
    * ``offload_params="nvme"`` too (``strategy="megatrain_nvme"``): every master in its owner's files; the other
      rank reads it from there after the owner's update is on disk, and drops the copy its window held.

    Each rank's window stays within its half of the node's ``host_memory_limit``; the files go at the end."""
    ram = tmp_path / "ram"
    common = ["--devices", "2", "--batch", "2", "--steps", "8", "--accumulate", "2", "--clip", "0.5", "--sched", "cosine"]
    check(launch(ram, *common))
    model, losses = reference("llama", 4, 8, 2, 0.5, "cosine")
    for flag in ("--nvme-optimizer", "--nvme"):
        run, disk = tmp_path / flag.strip("-"), tmp_path / f"{flag.strip('-')}_disk"
        disk.mkdir()
        check(launch(run, *common, flag, str(disk), "--host-memory-limit", "8MiB"))
        for r in range(2):
            assert torch.load(ram / f"losses_{r}.pt") == torch.load(run / f"losses_{r}.pt"), flag
        a, b = torch.load(ram / "weights.pt"), torch.load(run / "weights.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), flag
        assert_matches(run, 2, model, losses, 1e-5)
        stores = [json.loads((run / f"nvme_{r}.json").read_text()) for r in range(2)]
        assert [Path(s["dir"]).name for s in stores] == ["megatrain_store_rank0", "megatrain_store_rank1"]
        for s in stores:  # within its share of the budget; it wrote its own slabs
            assert s["host_memory_limit"] == 4 * 2**20 and 0 < s["peak_host_bytes"] <= s["host_memory_limit"], stores
            assert s["written_bytes"] > 0 and s["owned"], stores
            if flag == "--nvme-optimizer":  # only its own slabs on its disk
                assert s["slabs"] == s["owned"], stores
            # optimizer.state_dict() needs every rank's part: refused before any read, naming the directory checkpoint
            assert "not available with several processes and offload_optimizer='nvme'" in s["state_dict_error"]
            assert "optimizer/" in s["state_dict_error"]
        assert not set(stores[0]["owned"]) & set(stores[1]["owned"])
        assert not list(disk.iterdir()), flag  # the files go at the end of the run


def test_masters_on_nvme_without_the_optimizer_on_nvme_are_refused_clearly(tmp_path):
    """``offload_params="nvme"`` with the optimizer in RAM is not built for several processes: refused at setup,
    before any weight is stored, saying what runs instead."""
    proc = launch(tmp_path, "--devices", "2", "--steps", "1", "--nvme-params", str(tmp_path), spawn=True)
    assert proc.returncode != 0
    assert "NotImplementedError: megatrain: offload_params='nvme' (fp32 masters on disk) with several processes " \
           "runs on one node with offload_optimizer='nvme' for now" in proc.stderr
    assert not list(tmp_path.glob("megatrain_store*/*"))  # nothing written to the NVMe path


def test_save_checkpoint_on_rank_zero_only_says_to_call_it_on_every_rank(tmp_path):
    """``if trainer.is_global_zero: trainer.save_checkpoint(path)`` (plain DDP fails too, in Lightning's barrier,
    with gloo's "Connection closed by peer"): rank 0 stops with an error that names the mistake and the fix."""
    proc = launch(tmp_path, "--devices", "2", "--steps", "1", "--save", str(tmp_path / "final"), "--save-on-rank0-only",
                  spawn=True)
    assert proc.returncode != 0
    assert "PeerFailure: megatrain: rank 1 stopped responding" in proc.stderr
    assert "trainer.save_checkpoint writes from every rank: call it on all ranks, not only under `if " \
           "trainer.is_global_zero`" in proc.stderr


@pytest.mark.parametrize("mode", ["inplace", "replace", "after_backward"])
def test_gradient_edits_in_hooks_land_once(tmp_path, mode):
    """A hook that scales every gradient by 0.5 (in place, through ``.data``, or by assigning a new tensor; in
    ``on_before_optimizer_step`` or in every ``on_after_backward``) trains as DDP does: as plain PyTorch with the
    same edit on the global batch. Before, the ranks shared the node's accumulator: an in-place edit landed once
    per local rank (x0.25, 7.6e-3 weight error after 12 steps) and a new tensor was refused."""
    check(launch(tmp_path, "--devices", "2", "--batch", "2", "--steps", "6", "--accumulate", "2", "--clip", "0.5",
                 "--grad-edit", mode))

    def half(m):
        for p in m.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)

    model = T.make_model("llama")
    T.freeze_key_biases(model)
    hooks = {"after_backward": half} if mode == "after_backward" else {"on_grads": half}
    losses = T.reference_train(model, ShuffledEpochs(64, 4), 6, accumulate=2, clip=0.5, **hooks)
    assert_matches(tmp_path, 2, model, losses, 1e-5)


def test_torchrun_launch(tmp_path):
    """``torchrun --nproc_per_node=2 train.py`` (TorchElastic: Lightning's TorchElasticEnvironment reports the
    ranks, nothing is spawned by the strategy): the same numbers as plain PyTorch on the global batch."""
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK",
                                                               "MASTER_PORT", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                           str(WORKER), str(tmp_path), "--devices", "2", "--batch", "2", "--steps", "12",
                           "--accumulate", "2", "--clip", "0.5", "--sched", "cosine"],
                          env={**env, **parent_env(5.0)},  # torchrun's workers follow torchrun
                          capture_output=True, text=True, timeout=300, preexec_fn=dies_with_this_process())
    check(proc)
    assert json.loads((tmp_path / "env.json").read_text())["cluster_environment"] == "TorchElasticEnvironment"
    model, losses = reference("llama", 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 2, model, losses, 1e-5)


def test_slurm_environment(tmp_path):
    """Under SLURM (``srun --ntasks-per-node=2 python train.py``; here the two tasks are started with the variables
    srun sets), Lightning's SLURMEnvironment reports the ranks and nothing is spawned: the same numbers as plain
    PyTorch on the global batch."""
    job = str(random.randint(1, 10**6))  # Lightning derives the rendezvous port from the job id
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK",
                                                                "MASTER_PORT", "MASTER_ADDR")}
    procs = []
    for r in (0, 1):
        env = {**base, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
               "SLURM_NODEID": "0", "SLURM_JOB_ID": job, "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "--devices", "2", "--batch", "2",
                                       "--steps", "12", "--accumulate", "2", "--clip", "0.5", "--sched", "cosine"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=dies_with_this_process()))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    assert json.loads((tmp_path / "env.json").read_text())["cluster_environment"] == "SLURMEnvironment"
    model, losses = reference("llama", 4, 12, 2, 0.5, "cosine")
    assert_matches(tmp_path, 2, model, losses, 1e-5)


def test_adafactor_two_processes_match_plain_pytorch_and_resume_exactly(tmp_path):
    """``torch.optim.Adafactor`` on the host with 2 processes (each keeps the state of the slabs it owns):

    * 2 ranks x micro-batch 2, accumulation 2, norm clipping, cosine LR, 8 steps = plain PyTorch with Adafactor on
      the global batch (what DDP computes): every loss and weight within 1e-5 relative;
    * ``ModelCheckpoint`` after step 5 (each rank writes its slabs' Adafactor state) and ``fit(ckpt_path="last")``
      end bitwise where the uninterrupted run ends."""
    common = ["--arch", "llama", "--accumulate", "2", "--sched", "cosine", "--total-steps", "8", "--devices", "2",
              "--batch", "2", "--clip", "0.5", "--optimizer", "Adafactor"]
    plain, full, part, rest, ckpts = (tmp_path / n for n in ("plain", "full", "part", "rest", "ckpts"))
    check(launch(plain, *common, "--steps", "8"))
    model = T.make_model("llama")
    T.freeze_key_biases(model)
    losses = T.reference_train(model, ShuffledEpochs(64, 4), 8, accumulate=2, clip=0.5, sched="cosine",
                               optimizer=torch.optim.Adafactor)
    assert_matches(plain, 2, model, losses, 1e-5)
    common.append("--resumable")  # a resume continues mid-epoch
    check(launch(full, *common, "--steps", "8"))
    check(launch(part, *common, "--steps", "5", "--model-checkpoint", str(ckpts)))
    assert any(p.name.startswith("optimizer") for p in (ckpts / "last.ckpt").resolve().iterdir())
    check(launch(rest, *common, "--steps", "8", "--model-checkpoint", str(ckpts), "--resume", "last"))
    assert per_step_losses(rest, 2) == per_step_losses(full, 2)[10:]
    wa, wb = torch.load(rest / "weights.pt"), torch.load(full / "weights.pt")
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k
