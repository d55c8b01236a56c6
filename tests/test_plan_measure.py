"""The rates ``python -m megatrain_lightning.planning.measure`` prints for a CPU preset: the host AdamW rate is
params / seconds of ``torch.optim.AdamW.step`` on the given thread count, leaves the caller's thread count as it
was, and refuses sizes it cannot time."""

from __future__ import annotations

import time

import pytest
import torch

from megatrain_lightning.planning.measure import host_adamw_gparams_per_s, page_fill_gbps


def test_host_adamw_rate_is_params_over_the_step_time_and_restores_threads():
    before = torch.get_num_threads()
    numel, tensors = 1 << 20, 4
    rate = host_adamw_gparams_per_s(numel, tensors, threads=1, repeats=3)
    assert torch.get_num_threads() == before
    # an independent timing of the same step, on one thread: the same order of magnitude
    params = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = torch.optim.AdamW(params)
    torch.set_num_threads(1)
    try:
        opt.step()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    reference = numel / sorted(times)[1] / 1e9
    assert reference / 4 < rate < reference * 4


@pytest.mark.parametrize("kw", [dict(numel=3, tensors=4), dict(tensors=0), dict(threads=0)])
def test_host_adamw_rate_refuses_what_it_cannot_time(kw):
    with pytest.raises(ValueError, match="host_adamw_gparams_per_s needs"):
        host_adamw_gparams_per_s(**kw)


def test_page_fill_rate_is_that_of_memory_faulted_in_again():
    """``page_fill_gbps``: heap memory given back to the kernel and written again runs at the rate of fresh pages
    (an independent timing: a fresh 64 MiB mapping written once), far below rewriting memory the process kept."""
    rate = page_fill_gbps(64, repeats=3)
    fresh, kept = [], torch.empty(16 << 20)
    kept.fill_(1.0)
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty(16 << 20).fill_(1.0)  # 64 MiB: above the mmap threshold, mapped fresh each time
        fresh.append(time.perf_counter() - t0)
    reference = (64 << 20) / sorted(fresh)[1] / 1e9
    assert reference / 4 < rate < reference * 4
    t0 = time.perf_counter()
    kept.fill_(2.0)
    assert (64 << 20) / (time.perf_counter() - t0) / 1e9 > 1.5 * rate
    with pytest.raises(ValueError, match="page_fill_gbps needs"):
        page_fill_gbps(2)
