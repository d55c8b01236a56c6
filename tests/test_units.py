"""Unit tests of the parts that stand alone: HostAdamW against torch.optim.AdamW on raw tensors, the
host budget, the store's hold() on both tiers, the CPU transport and the recompute boundary on two small
blocks. No Trainer and no language model: each test
takes well under a second.

The store is built the way the engine builds it (``discover_blocks`` of a module of three
``nn.Linear`` blocks, then ``build_store``), and gradients are written into the accumulators the way
the engine's D2H worker does (``_accumulate``: ``store.hold(slab, ["grad_accum"], write=True, fresh=...)``,
copy into an empty accumulator, add into a filled one, ``has_grad`` per entry).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

from megatrain_lightning.optim.host_adamw import HostAdamW
from megatrain_lightning.store.budget import HostBudget, HostMemoryBudgetError
from megatrain_lightning.store.host import HostStore, build_store
from megatrain_lightning.store.nvme import NVMeStore

from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.engine.transport import CPUTransport, make_transport

ALL_KINDS = ("master", "exp_avg", "exp_avg_sq", "grad_accum")


class Net(nn.Module):
    """Three blocks (one per Linear); ``c.bias`` is frozen (the frozen tail of slab 2)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 5)
        self.c = nn.Linear(5, 2)
        self.c.bias.requires_grad_(False)


def make_store(net: nn.Module, tier: str, tmp_path, limit: int = 2**20) -> HostStore:
    """``build_store`` over the Linear blocks of ``net``: ``ram``, or ``nvme`` (every region on disk under a
    ``limit``-byte host budget)."""
    blocks = discover_blocks(net, block_classes=[nn.Linear])
    if tier == "ram":
        return build_store(blocks)
    budget = HostBudget(limit)
    return build_store(blocks, nvme_factory=lambda layout: NVMeStore(tmp_path, layout, budget, io_threads=2, read_ahead=2),
                       nvme_kinds=ALL_KINDS)


def accumulate(store: HostStore, si: int, grads: dict[int, torch.Tensor]) -> None:
    """Add one batch of gradients (slab entry -> tensor of the parameter's shape) into slab ``si``'s
    accumulator, as the engine's D2H worker does."""
    slab = store.slabs[si]
    with slab.lock:
        if slab.grad_accum_empty:
            slab.has_grad = [False] * len(slab.entries)
        fresh = ["grad_accum"] if slab.grad_accum_empty else []  # an empty accumulator is overwritten, not read
        with store.hold(si, ["grad_accum"], write=True, fresh=fresh) as t:
            for i, g in grads.items():
                acc = slab.view(t["grad_accum"], i)
                if slab.has_grad[i]:
                    acc.add_(g)
                else:
                    acc.copy_(g)
                    slab.has_grad[i] = True
        slab.grad_accum_empty = False


def where(store: HostStore) -> dict[str, tuple[int, int]]:
    """Parameter name -> (slab, entry)."""
    return {e.ref.fqn: (s.index, i) for s in store.slabs for i, e in enumerate(s.entries)}


def master(store: HostStore, si: int, ei: int) -> torch.Tensor:
    """A copy of one parameter's master weights, read through ``hold`` (either tier)."""
    with store.hold(si, ["master"]) as t:
        return store.slabs[si].view(t["master"], ei).clone()


# ---------------------------------------------------------------------------------------------- HostAdamW
def groups(net: nn.Module) -> list[dict]:
    """Two param groups with different lr, betas, eps and weight decay; the frozen ``c.bias`` is in one."""
    return [
        {"params": [net.a.weight, net.a.bias, net.c.bias], "lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)},
        {"params": [net.b.weight, net.b.bias, net.c.weight], "lr": 3e-3, "weight_decay": 0.0, "eps": 1e-6},
    ]


# per step: the parameters that get a gradient (b.bias gets none in steps 0 and 2: ``grad is None``,
# no update and, in step 0, no state), the number of micro-batches, whether norm clipping runs
SCHEDULE = [
    ({"a.weight", "a.bias", "b.weight", "c.weight"}, 1, False),
    ({"a.weight", "a.bias", "b.weight", "b.bias", "c.weight"}, 2, False),
    ({"a.weight", "a.bias", "b.weight", "c.weight"}, 1, True),
    ({"a.weight", "a.bias", "b.weight", "b.bias", "c.weight"}, 3, True),
]
LR_AFTER = [0.5, 2.0, 0.25, 1.0]  # scheduler-like lr factor set after each step


def run_host_and_reference(tmp_path, tier: str, overlap: bool, fused: bool | None):
    net = Net()
    ref = copy.deepcopy(net)
    store = make_store(net, tier, tmp_path)
    user_opt = torch.optim.AdamW(groups(net), fused=fused)  # the host runs the kernel the user's flags select
    host = HostAdamW(store, user_opt, overlap=overlap)
    ref_opt = torch.optim.AdamW(groups(ref), fused=fused)
    ref_params = dict(ref.named_parameters())
    loc = where(store)
    g = torch.Generator().manual_seed(3)
    norms = []
    for step, (names, micro, clip) in enumerate(SCHEDULE):
        for p in ref.parameters():
            p.grad = None
        for _ in range(micro):
            batch: dict[int, dict[int, torch.Tensor]] = {}
            for name in sorted(names):
                grad = torch.randn(ref_params[name].shape, generator=g)
                rp = ref_params[name]
                rp.grad = grad.clone() if rp.grad is None else rp.grad.add_(grad)
                si, ei = loc[name]
                batch.setdefault(si, {})[ei] = grad
            for si, grads in batch.items():
                accumulate(store, si, grads)
        if clip:
            ordered = [p for grp in ref_opt.param_groups for p in grp["params"] if p.grad is not None]
            ref_norm = torch.nn.utils.clip_grad_norm_(ordered, 0.5)
            host_norm = host.clip_grad_norm(0.5)
            norms.append((host_norm, ref_norm))
        before = master(store, *loc["a.weight"])
        assert host.step() == 3
        if overlap:  # recorded, not applied: the weights are those before the step until the engine applies it
            assert host.has_pending() and torch.equal(master(store, *loc["a.weight"]), before)
        ref_opt.step()
        for opt, base in ((user_opt, groups(net)), (ref_opt, groups(ref))):  # lr changes after the step
            for grp, b in zip(opt.param_groups, base):
                grp["lr"] = b["lr"] * LR_AFTER[step]
        host.flush()  # the update uses the hyper-parameters of its step, not the new lr
        assert not host.has_pending()
    return net, ref, store, host, ref_opt, norms


@pytest.mark.parametrize("tier", ["ram", "nvme"])
@pytest.mark.parametrize("overlap", [True, False])
def test_host_adamw_is_bitwise_torch_fused_adamw(tmp_path, tier, overlap):
    """Masters, exp_avg, exp_avg_sq, step and clipping norms bitwise equal to torch.optim.AdamW(fused=True):
    two param groups (different lr, betas, eps, weight decay), a parameter without gradient in some steps,
    a frozen parameter in a group, gradient accumulation, norm clipping and an lr changed after each step."""
    net, ref, store, host, ref_opt, norms = run_host_and_reference(tmp_path, tier, overlap, fused=True)
    loc = where(store)
    for name, rp in ref.named_parameters():
        assert torch.equal(master(store, *loc[name]), rp.detach()), name
        st, rst = host.param_state(dict(net.named_parameters())[name]), ref_opt.state.get(rp)
        if rst is None or not rst:  # c.bias (frozen): no state on either side
            assert st is None, name
            continue
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[k].reshape(rst[k].shape), rst[k]), (name, k)
    assert float(host.param_state(net.b.bias)["step"]) == 2.0  # updated only in the steps it had a gradient
    assert torch.equal(master(store, *loc["c.bias"]), Net().c.bias.detach())  # frozen: untouched
    for host_norm, ref_norm in norms:
        assert torch.equal(host_norm, ref_norm)
    store.close()


def test_host_adamw_is_bitwise_torch_default_adamw():
    """Without flags the host runs torch's default for CPU parameters (the single-tensor for-loop), as
    the user's optimizer would: masters, ``exp_avg`` and ``exp_avg_sq`` bitwise equal."""
    net, ref, store, host, ref_opt, _ = run_host_and_reference(None, "ram", True, fused=None)
    assert host.implementation() == "for-loop"
    for name, rp in ref.named_parameters():
        p = dict(net.named_parameters())[name]
        assert torch.equal(p.detach(), rp.detach()), name
        st, rst = host.param_state(p), ref_opt.state.get(rp)
        if rst:
            assert torch.equal(st["exp_avg"], rst["exp_avg"]), name
            assert torch.equal(st["exp_avg_sq"], rst["exp_avg_sq"]), name
    store.close()


def test_host_adamw_discard_grads_forgets_an_unstepped_window():
    """``optimizer.zero_grad()`` semantics: gradients no step consumed are dropped, the next window starts empty."""
    net = Net()
    store = make_store(net, "ram", None)
    host = HostAdamW(store, torch.optim.AdamW(net.parameters()))
    accumulate(store, 0, {0: torch.ones(3, 4)})
    host.discard_grads()
    assert store.slabs[0].grad_accum_empty and not any(store.slabs[0].has_grad)
    assert host.step() == 0 and not host.has_pending()


# ---------------------------------------------------------------------------------------------- HostBudget
def test_budget_reserve_release_and_peak():
    b = HostBudget(1000)
    b.reserve(300)
    assert (b.used, b.free) == (300, 700)
    assert b.try_reserve(700) and b.free == 0
    assert not b.try_reserve(1) and b.used == 1000  # never overshoots
    b.release(700)
    b.release(300)
    assert (b.used, b.peak) == (0, 1000)


def test_budget_reservation_larger_than_the_limit_fails_at_once():
    b = HostBudget(1000)
    t0 = time.monotonic()
    with pytest.raises(HostMemoryBudgetError, match="needs 1001 B.*host_memory_limit is 1000 B"):
        b.reserve(1001, what="a test buffer")
    assert time.monotonic() - t0 < 0.1 and b.used == 0


def test_budget_times_out_when_nothing_is_released():
    b = HostBudget(100)
    b.reserve(80)
    with pytest.raises(HostMemoryBudgetError, match="waited"):
        b.reserve(40, timeout_s=0.05)
    assert b.used == 80


def test_budget_waiting_reservation_is_unblocked_by_a_release_from_another_thread():
    b = HostBudget(100)
    b.reserve(80)
    got = threading.Event()

    def waiter():
        b.reserve(50)
        got.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not got.wait(0.1)  # 80 + 50 > 100: it waits
    b.release(80)
    assert got.wait(2.0)
    t.join()
    assert b.used == 50 and b.peak == 80


def test_budget_make_room_is_asked_for_the_missing_bytes():
    b = HostBudget(100)
    b.reserve(90)
    asked = []

    def make_room(missing):  # evicts a cached 60-byte buffer
        asked.append(missing)
        b.release(60)
        return True

    b.reserve(40, make_room=make_room)
    assert asked == [30] and b.used == 70


def test_budget_limit_holds_under_concurrent_threads():
    b = HostBudget(1000)
    seen = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            n = int(torch.randint(1, 400, (1,), generator=g))
            b.reserve(n)
            seen.append(b.used)
            b.release(n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.used == 0 and max(seen) <= 1000 and b.peak <= 1000


# ---------------------------------------------------------------------------------------------- store.hold
def fill(store: HostStore, seed: int) -> dict[tuple[int, str], torch.Tensor]:
    """Write random content into every region of every slab through ``hold(write=True, fresh=...)``."""
    g = torch.Generator().manual_seed(seed)
    written = {}
    for s in store.slabs:
        for k in ALL_KINDS:
            with store.hold(s.index, [k], write=True, fresh=[k]) as t:
                v = torch.randn(t[k].shape, generator=g)
                t[k].copy_(v)
                written[(s.index, k)] = v
    return written


def read_all(store: HostStore) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for s in store.slabs:
        with store.hold(s.index, ALL_KINDS) as t:
            out.update({(s.index, k): v.clone() for k, v in t.items()})
    return out


@pytest.mark.parametrize("tier", ["ram", "nvme"])
def test_hold_starts_from_the_weights_and_zero_states_and_round_trips(tmp_path, tier):
    net = Net()
    ref = copy.deepcopy(net)
    store = make_store(net, tier, tmp_path)
    loc = where(store)
    assert [(s.numel, s.trainable_numel) for s in store.slabs] == [(15, 15), (20, 20), (12, 10)]
    for name, p in ref.named_parameters():  # masters hold the weights; states and accumulators start at zero
        assert torch.equal(master(store, *loc[name]), p.detach())
    for s in store.slabs:
        with store.hold(s.index, ["exp_avg", "exp_avg_sq", "grad_accum"]) as t:
            assert all(v.shape == (s.trainable_numel,) and not v.any() for v in t.values())
    written = fill(store, 0)
    got = read_all(store)
    assert got.keys() == written.keys() and all(torch.equal(got[k], written[k]) for k in written)
    if tier == "ram":  # the live tensors: param.data views the master
        assert torch.equal(net.b.weight.detach().reshape(-1), written[(1, "master")][:15])
    else:  # masters on disk: the parameter is a 4-byte placeholder of the right shape
        assert net.b.weight.shape == (5, 3) and net.b.weight.stride() == (0, 0)
    store.close()


def test_hold_writes_back_before_eviction_and_fresh_skips_the_read(tmp_path):
    """NVMe tier with a window smaller than the store: what was written under ``write=True`` survives
    eviction (written back, read again from disk); a ``fresh`` region is not read."""
    net = Net()
    store = make_store(net, "nvme", tmp_path, limit=4 * 4096)  # four 4 KiB buffers for the 12 regions
    nv = store.nvme
    written = fill(store, 1)
    nv.wait_io()
    assert nv.budget.peak <= nv.budget.limit and nv.resident_bytes() <= 4 * 4096
    nv.drop_clean()
    assert nv.resident_bytes() == 0
    read0 = nv.meter.read_bytes
    got = read_all(store)
    assert all(torch.equal(got[k], written[k]) for k in written)
    assert nv.meter.read_bytes - read0 == 12 * 4096  # everything came back from disk
    nv.drop_clean()
    read0 = nv.meter.read_bytes
    with store.hold(0, ["master"], write=True, fresh=["master"]) as t:
        t["master"].fill_(7.0)
    assert nv.meter.read_bytes == read0  # fresh: not read
    nv.drop_clean()
    assert torch.equal(master(store, 0, 0), torch.full((3, 4), 7.0))
    store.close()


def test_discarded_accumulator_is_not_written(tmp_path):
    """A consumed accumulator (held without ``write``) leaves the window unwritten: the disk keeps its old content."""
    store = make_store(Net(), "nvme", tmp_path)
    nv = store.nvme
    with store.hold(1, ["grad_accum"], write=True, fresh=["grad_accum"]) as t:
        t["grad_accum"].fill_(1.0)
    nv.wait_io()
    written0 = nv.meter.write_bytes
    with store.hold(1, ["grad_accum"]) as t:  # as the last gradient batch of an update in backward
        t["grad_accum"].fill_(2.0)
    store.discard_grad_accum(1)
    nv.wait_io()
    assert nv.meter.write_bytes == written0 and (1, "grad_accum") not in nv.entries
    with store.hold(1, ["grad_accum"]) as t:
        assert torch.equal(t["grad_accum"], torch.ones(20))
    store.close()


def test_both_tiers_hold_bitwise_the_same_content(tmp_path):
    stores = [make_store(Net(), "ram", None), make_store(Net(), "nvme", tmp_path, limit=4 * 4096)]
    for st in stores:
        fill(st, 2)
        with st.hold(2, ["grad_accum", "master"], write=True) as t:  # read-modify-write of existing content
            t["grad_accum"].mul_(3.0)
            t["master"][:5].add_(1.0)
    stores[1].nvme.drop_clean()
    ram, nvme = read_all(stores[0]), read_all(stores[1])
    assert ram.keys() == nvme.keys()
    for k in ram:
        assert torch.equal(ram[k], nvme[k]), k
    for st in stores:
        st.close()


# ---------------------------------------------------------------------------------------------- CPU transport
def test_cpu_transport_to_device_copies_or_binds():
    host = torch.randn(10)
    tr = CPUTransport(torch.device("cpu"))
    buf, ev = tr.to_device(host)
    assert ev is None and torch.equal(buf, host) and buf.data_ptr() != host.data_ptr()
    host.add_(1.0)
    assert not torch.equal(buf, host)  # a copy
    bf, _ = tr.to_device(host, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, host.to(torch.bfloat16))
    tr.ready(buf, ev)  # nothing to wait for
    zc = CPUTransport(torch.device("cpu"), zero_copy=True)
    same, _ = zc.to_device(host)
    assert same is host  # zero copy: the master itself
    conv, _ = zc.to_device(host, torch.float16)  # another dtype still converts
    assert conv.dtype == torch.float16 and torch.equal(conv, host.half())


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_cpu_transport_stage_grads_gives_the_gradients_on_the_host(wire):
    grads = [torch.randn(3, 4), torch.randn(5)]
    copy = CPUTransport(torch.device("cpu")).stage_grads(grads, wire)
    got = copy.wait()
    assert [g.shape for g in got] == [g.shape for g in grads]
    assert all(h.dtype == wire and torch.equal(h, g.to(wire)) for h, g in zip(got, grads))
    assert copy.busy_s >= 0.0
    copy.release()
    copy.release()  # once: a second release is a no-op


def test_cpu_transport_offload_restore_round_trip():
    tr = CPUTransport(torch.device("cpu"))
    x = torch.randn(2, 3, requires_grad=True)
    y = x * 2
    host, ev = tr.offload(y)
    assert ev is None and not host.requires_grad and host.data_ptr() != y.data_ptr()
    back = tr.restore(host, ev)
    assert torch.equal(back, y.detach())
    tr.last_read_done(None)
    tr.released()
    assert tr.peak_bytes() is None


def test_make_transport_picks_by_device_type():
    tr = make_transport(torch.device("cpu"), 16, zero_copy_cpu=True)
    assert isinstance(tr, CPUTransport) and tr.zero_copy
    with pytest.raises(ValueError, match="supports accelerator 'cpu' and 'gpu'"):
        make_transport(torch.device("meta"), 16)


# ---------------------------------------------------------------------------------------------- recompute boundary


class Block(nn.Module):
    """One block with dropout (its RNG is replayed in the recompute)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(torch.tanh(self.lin(x))) + x


@pytest.mark.parametrize("recompute_every", [1, 2])
def test_recompute_boundary_gives_plain_autograd_gradients(recompute_every):
    """Two blocks through the engine's autograd boundary (forward without a graph, backward by
    recompute under the replayed RNG): input and parameter gradients bitwise those of plain autograd."""
    from megatrain_lightning.engine.streaming import StreamingEngine

    torch.manual_seed(0)
    net = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(net)
    x = torch.randn(3, 6)
    xr = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    ref(xr).square().sum().backward()
    eng = StreamingEngine(net, torch.device("cpu"), block_classes=[Block], recompute_every=recompute_every)
    eng.install()
    try:
        xs = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        net(xs).square().sum().backward()
        eng.attach_grads()
        assert torch.equal(xs.grad, xr.grad)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
    finally:
        eng.close()


def test_a_per_rank_nvme_path_is_told_to_use_one_shared_path():
    """DeepSpeed-style per-rank folders (``nvme_path=DIR/r{LOCAL_RANK}``) differ across ranks: the refusal says that
    one shared path gets a folder per rank by itself; other differences do not get the hint."""
    from megatrain_lightning.parallel.preflight import differences, mismatch_message

    diff = differences([{"strategy.nvme": "/d/r0", "torch": "2"}, {"strategy.nvme": "/d/r1", "torch": "2"}])
    msg = mismatch_message(diff)
    assert "strategy.nvme: /d/r0 on rank 0; /d/r1 on rank 1" in msg
    assert "give every rank the same nvme_path" in msg and "megatrain_store_rank<r>" in msg
    assert "nvme_path" not in mismatch_message(differences([{"torch": "1"}, {"torch": "2"}]))


def test_a_timeout_that_is_not_positive_is_refused_at_construction():
    """A ``timeout`` that is not positive (every collective would fail at once) is refused."""
    from datetime import timedelta

    from megatrain_lightning import MegaTrainStrategy

    for bad in (-5, 0, "30", timedelta(seconds=-1)):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            MegaTrainStrategy(timeout=bad)
    from megatrain_lightning.config import check_timeout

    assert check_timeout(2.5) == timedelta(seconds=2.5) and check_timeout(None) is None
    MegaTrainStrategy(timeout=2.5)


def test_workers_intra_op_threads_leave_later_threads_alone():
    """The engine's workers run with ``host_threads``; the compute thread and threads started after them keep the
    process's setting (torch.set_num_threads in a thread also sets the count later threads start with)."""
    import threading

    from megatrain_lightning.engine.streaming import StreamingEngine
    from megatrain_lightning.testing import make_model

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = StreamingEngine(make_model("llama", num_hidden_layers=1), torch.device("cpu"), host_threads=1)
        try:
            assert eng.grads._pool.submit(torch.get_num_threads).result() == 1
            assert eng.prefetcher._pool.submit(torch.get_num_threads).result() == 1
            later: list[int] = []
            t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
            t.start()
            t.join()
            assert later == [2] and torch.get_num_threads() == 2
        finally:
            eng.close()
    finally:
        torch.set_num_threads(before)


def test_a_worker_on_a_cuda_run_makes_the_device_current_first(monkeypatch):
    """The current CUDA device is per thread (``cuda:0`` in a new one): a worker of the rank on ``cuda:1`` sets it
    before any work, then its intra-op threads."""
    import threading

    from megatrain_lightning.engine.threads import start_worker

    calls: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", threading.current_thread().name, d)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", threading.current_thread().name, n)))
    pool = start_worker("test-worker", 3, torch.device("cuda", 1))
    try:
        name = pool.submit(lambda: threading.current_thread().name).result()
    finally:
        pool.shutdown()
    main = threading.current_thread().name
    assert name.startswith("test-worker")
    assert calls == [("device", name, 1), ("threads", name, 3), ("threads", main, calls[-1][2])]
    cpu = start_worker("test-cpu", None, torch.device("cpu"))
    cpu.submit(lambda: None).result()
    cpu.shutdown()
    assert len(calls) == 3  # a CPU worker with torch's setting: nothing set
    # "cuda" without an index (StreamingEngine(model, "cuda")): the caller's current device, by index (torch's
    # set_device refuses a device without one)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    bare = start_worker("test-bare", None, "cuda")
    name = bare.submit(lambda: threading.current_thread().name).result()
    bare.shutdown()
    assert calls[3:] == [("device", name, 2)]
