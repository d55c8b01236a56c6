"""Measure this machine's compute rates for a CPU hardware preset (``conf/hardware/this_machine.yaml``).

``python -m megatrain_lightning.planning.measure`` prints, as YAML lines for the preset, the TFLOP/s (1e12 FLOP/s)
of a whole model step (:func:`model_step_tflops`: the FLOP the planner's compute term counts), in fp32
(``32-true``) and under CPU bf16 autocast (``bf16-mixed``: what the engine runs), with a two-linear-layer step
(:func:`train_step_tflops`) and a square matmul (:func:`matmul_tflops`) for comparison; each the median of
``repeats`` timed runs after one warm-up. On CPUs without native bf16 matmul instructions (no AVX512-BF16 or AMX)
the bf16 rate is far below the fp32 one: assuming "bf16 is faster" would make the planner's step-time bound wrong
by that factor.

It also times the host update the engine runs on a CPU device (:func:`host_adamw_gparams_per_s`: the preset's
``host_adam_gparams_per_s``) and the refill of the trimmed heap (:func:`page_fill_gbps`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def _median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up (allocations, kernel selection)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """TFLOP/s of ``a @ b`` for square ``[n, n]`` tensors of ``dtype`` (2 n^3 FLOP)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, repeats) / 1e12


def train_step_tflops(tokens: int, hidden: int, intermediate: int, autocast_bf16: bool, repeats: int = 3) -> float:
    """TFLOP/s of forward + backward of ``Linear(hidden, intermediate) -> Linear(intermediate, hidden)``
    (fp32 parameters) on ``[tokens, hidden]`` fp32 inputs; ``autocast_bf16``: under CPU bf16 autocast.

    FLOP = 6 x (2 x hidden x intermediate) x tokens (forward 2N per token, backward 4N)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(hidden, intermediate, bias=False),
                              torch.nn.Linear(intermediate, hidden, bias=False))
    x = torch.randn(tokens, hidden, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            y = net(x)
        y.float().sum().backward()

    flop = 6 * 2 * hidden * intermediate * tokens
    return flop / _median_seconds(step, repeats) / 1e12


def model_step_tflops(tokens: int, layers: int, autocast_bf16: bool, repeats: int = 3,
                      config: dict | None = None, batch_size: int = 1) -> float:
    """TFLOP/s of one plain PyTorch training step (forward + backward with the loss) of a Hugging Face causal LM on
    ``batch_size`` sequences of ``tokens`` tokens, in fp32 or under CPU bf16 autocast, counted as the planner counts
    a plain step: 6 x N_matmul x batch x tokens + 6 x layers x batch x tokens x q_dim x tokens (Kaplan et al. 2020,
    forward 2N + 2 n_layer n_ctx d_attn per token, backward twice the forward).

    Args:
        config: ``transformers.AutoConfig.for_model`` keywords (``model_type``...); ``None``: a SmolLM2-135M-shaped
            Llama (``conf/model/smollm2_135m.yaml``'s shapes) with ``layers`` decoder layers (``layers`` is ignored
            when ``config`` is given).
    """
    import transformers

    from .counts import count_module

    if config is None:
        config = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    cfg = transformers.AutoConfig.for_model(**{**config, "use_cache": False})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, tokens))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    c = count_module(model)
    n_tok = batch_size * tokens
    flop = 6 * c.matmul_params * n_tok + 6 * c.num_layers * n_tok * c.num_heads * c.head_dim * tokens
    return flop / _median_seconds(step, repeats) / 1e12


def host_adamw_gparams_per_s(numel: int = 1 << 23, tensors: int = 16, threads: int = 1, repeats: int = 3,
                             **adamw: object) -> float:
    """G parameters per second of ``torch.optim.AdamW(**adamw).step()`` (its default for-loop kernel on CPU
    tensors, what the host AdamW kernel reproduces) on ``tensors`` fp32 parameters of ``numel`` elements in all,
    with ``threads`` intra-op threads (1: the update worker's on a CPU device, ``engine/threads.py``) under a
    training run's malloc settings (:func:`~megatrain_lightning.store.allocator.bound_retention`).

    Raises:
        ValueError: ``numel`` < ``tensors`` or ``threads`` < 1.
    """
    if numel < tensors or tensors < 1 or threads < 1:
        raise ValueError(f"host_adamw_gparams_per_s needs numel >= tensors >= 1 and threads >= 1, got numel={numel}, "
                         f"tensors={tensors}, threads={threads}")
    from ..store.allocator import bound_retention

    bound_retention()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // tensors, generator=g)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = torch.optim.AdamW(params, **adamw)  # type: ignore[arg-type]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _median_seconds(opt.step, repeats)
    finally:
        torch.set_num_threads(before)
    return numel // tensors * tensors / seconds / 1e9


def page_fill_gbps(mib: int = 256, repeats: int = 3) -> float:
    """GB/s (1e9 B/s) at which freed heap memory comes back into use after the engine gives it to the kernel at a
    CPU device's step end (``StreamingEngine.end_step``: ``malloc_trim``): ``mib`` MiB of 4 MiB tensors (under the
    training run's mmap threshold, ``store/allocator.py``) freed, ``malloc_trim(0)``, then allocated and written
    again, the trim and the page faults timed together; the preset's ``page_fill_gbps``. Without glibc the heap is
    not trimmed and the rate is reported as the plain refill's.

    Raises:
        ValueError: ``mib`` < 4 or ``repeats`` < 1.
    """
    if mib < 4 or repeats < 1:
        raise ValueError(f"page_fill_gbps needs mib >= 4 and repeats >= 1, got mib={mib}, repeats={repeats}")
    from ..store import heap
    from ..store.allocator import bound_retention

    bound_retention()
    n = mib // 4

    def fill() -> list[torch.Tensor]:
        return [torch.empty(1 << 20).fill_(1.0) for _ in range(n)]

    def once() -> None:
        del kept[:]
        heap.trim()
        kept.extend(fill())

    kept = fill()
    seconds = _median_seconds(once, repeats)
    return n * 4 * 2**20 / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--matmul", type=int, default=2048, help="square matmul size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-tokens", type=int, default=512)
    ap.add_argument("--model-layers", type=int, default=4)
    a = ap.parse_args(argv)
    m32 = model_step_tflops(a.model_tokens, a.model_layers, False, a.repeats)
    m16 = model_step_tflops(a.model_tokens, a.model_layers, True, a.repeats)
    fp32 = train_step_tflops(a.tokens, a.hidden, a.intermediate, False, a.repeats)
    bf16 = train_step_tflops(a.tokens, a.hidden, a.intermediate, True, a.repeats)
    mm32 = matmul_tflops(a.matmul, torch.float32, a.repeats)
    mm16 = matmul_tflops(a.matmul, torch.bfloat16, a.repeats)
    adam = host_adamw_gparams_per_s(repeats=a.repeats)
    fill = page_fill_gbps(repeats=a.repeats)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; train step = Linear({a.hidden},"
          f"{a.intermediate}) -> Linear({a.intermediate},{a.hidden}) fwd+bwd on {a.tokens} tokens")
    print(f"# model step = SmolLM2-135M shape, {a.model_layers} layers, 1 x {a.model_tokens} tokens, loss + backward")
    print(f"fp32_tflops: {m32:.3g}    # model step fp32; two-linear step {fp32:.3g}; square {a.matmul} matmul {mm32:.3g}")
    print(f"bf16_tflops: {m16:.3g}    # model step bf16 autocast; two-linear step {bf16:.3g}; square {a.matmul} "
          f"matmul {mm16:.3g}; model-step bf16/fp32 = {m16 / m32:.3g}")
    print(f"host_adam_gparams_per_s: {adam:.3g}    # torch.optim.AdamW (for-loop), 1 thread, 8.4M params in 2 MiB tensors")
    print(f"page_fill_gbps: {fill:.3g}    # freed heap trimmed and faulted in again, 4 MiB tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
