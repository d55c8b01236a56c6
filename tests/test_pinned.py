"""Pinned memory inside ``host_memory_limit``.

* The arena's sub-allocator against an independent occupancy map (random alloc/free sequences).
* Exact pinning (``cudaHostRegister`` mocked on this CPU build): the bytes registered are the bytes
  asked for, unregistered only when the last view dies; the pinning preflight decides by pinning,
  never by ``ulimit -l``.
* NVMe runs with regions of awkward sizes: every window buffer lies in the one arena, whose size
  (measured from the allocations made, not from the budget) stays within ``host_memory_limit``;
  results bitwise those of the RAM tier (which matches plain PyTorch, tests/test_parity.py).
* The H2D staging ring: at most 2 slots in flight, a slot reused only after its copy's event, and
  bitwise results with mixed precision when every release is delayed to a later "event".
"""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.engine import streaming as streaming_mod
from megatrain_lightning.engine.accounting import compute_window_bytes
from megatrain_lightning.engine.staging import StagingRing
from megatrain_lightning.engine.transport import CPUTransport
from megatrain_lightning.engine.window import nvme_window
from megatrain_lightning.store import nvme as nvme_mod
from megatrain_lightning.store import pinned
from megatrain_lightning.store.host import slab_layout
from megatrain_lightning.config import MegaTrainConfig
from megatrain_lightning.store.pinned import PAGE, HostPinningError, PinnedArena, host_buffer, try_host_buffer
from megatrain_lightning.testing import LM, make_model
from test_nvme import assert_bitwise, fit

# regions of awkward sizes: a prime vocabulary (embedding and head ~3x a layer, not page multiples),
# an MLP width that is no power of two
AWKWARD = {"num_hidden_layers": 5, "vocab_size": 1021, "intermediate_size": 70}


# ---------------------------------------------------------------- the sub-allocator
def test_arena_against_an_occupancy_map():
    """Random alloc/free: sub-buffers are page aligned, never overlap, stay inside the arena, and an
    allocation fails only when no free run of pages of that length exists (checked on a page map)."""
    rng = random.Random(0)
    cap_pages = 64
    arena = PinnedArena(cap_pages * PAGE - 100)  # rounded up to whole pages
    assert arena.capacity == cap_pages * PAGE and not arena.pinned
    pages = [False] * cap_pages
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            n = live.pop(off)
            arena.free(off)
            for p in range(off // PAGE, off // PAGE + n):
                pages[p] = False
            continue
        want = rng.randint(1, 12 * PAGE)
        n = -(-want // PAGE)
        off = arena.alloc(want)
        runs, run = [], 0
        for used in pages + [True]:
            run = 0 if used else run + 1
            runs.append(run)
        if off is None:
            assert max(runs) < n, "a free run of pages was there"
            continue
        assert off % PAGE == 0 and off + n * PAGE <= arena.capacity
        assert not any(pages[off // PAGE : off // PAGE + n]), "overlaps a live sub-buffer"
        for p in range(off // PAGE, off // PAGE + n):
            pages[p] = True
        live[off] = n
        assert arena.used == sum(live.values()) * PAGE
        assert arena.view(off, want).data_ptr() == arena.buf.data_ptr() + off
    assert arena.peak <= arena.capacity


def test_arena_best_fit_reuse_and_contiguity_plan():
    a = PinnedArena(10 * PAGE)
    offs = [a.alloc(2 * PAGE) for _ in range(5)]  # full: [0,2) [2,4) [4,6) [6,8) [8,10) pages
    assert offs == [0, 2 * PAGE, 4 * PAGE, 6 * PAGE, 8 * PAGE] and a.alloc(1) is None
    a.free(offs[1])
    a.free(offs[3])
    assert a.alloc(2 * PAGE) == offs[1]  # the freed range is reused (best fit: both fit, lowest first)
    a.free(offs[1])
    assert a.alloc(3 * PAGE) is None  # 4 pages free, but in two ranges of 2
    # 3 contiguous pages: evicting offs[0] (merging [0,4)) or offs[2] (merging [2,8)) both work: the cheaper
    cost = {offs[0]: 1.0, offs[2]: 5.0, offs[4]: None}
    assert a.eviction_plan(3 * PAGE, cost.get) == [offs[0]]
    cost[offs[0]] = 10.0
    assert a.eviction_plan(3 * PAGE, cost.get) == [offs[2]]
    cost[offs[2]] = None  # in use: only offs[0] can go, which opens 4 pages at most
    assert a.eviction_plan(5 * PAGE, cost.get) is None
    cost[offs[0]] = None
    assert a.eviction_plan(3 * PAGE, cost.get) is None
    assert a.eviction_plan(2 * PAGE, cost.get) == []  # a free range already fits


# ---------------------------------------------------------------- exact pinning, preflight by pinning
class FakeDriver:
    """Stands in for cudaHostRegister/cudaHostUnregister on this CPU build."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, ptr: int, n: int) -> None:
        if self.fail:
            raise HostPinningError("out of memory")
        self.registered[ptr] = n

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


@pytest.fixture
def driver(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(pinned, "REGISTER", d.register)
    monkeypatch.setattr(pinned, "UNREGISTER", d.unregister)
    return d


def test_host_buffer_pins_exactly_and_unpins_after_the_last_view(driver):
    t = host_buffer(2_100_000_000 // 1000 + 1, pin=True)  # an awkward 2.1 MB: pinned to the page, not 4 MiB
    n = t.numel()
    assert n == -(-2_100_001 // PAGE) * PAGE and t.data_ptr() % PAGE == 0
    assert driver.registered == {t.data_ptr(): n}
    ptr = t.data_ptr()
    view = t[PAGE:].view(torch.float32)
    del t
    assert driver.unregistered == []  # a view still uses the memory
    view.fill_(1.0)
    del view
    assert driver.unregistered == [ptr]


def test_pinning_failure_names_host_memory_and_the_option(monkeypatch, caplog):
    d = FakeDriver(fail=True)
    monkeypatch.setattr(pinned, "REGISTER", d.register)
    with pytest.raises(HostPinningError, match=r"page-locking 1.00 MiB of host memory.*host_memory_limit.*pin_memory=False"):
        try_host_buffer(2**20, True, "the NVMe window")
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.store.pinned"):
        t, ok = try_host_buffer(2**20, None, "the NVMe window")  # the default: fall back, with a warning
    assert not ok and t.numel() == 2**20 and "Using pageable memory for the NVMe window" in caplog.text
    t, ok = try_host_buffer(2**20, False, "x")
    assert not ok and d.registered == {}


def _blocks():
    return discover_blocks(LM(make_model("llama", **AWKWARD)))


def test_preflight_pins_instead_of_reading_ulimit(tmp_path, monkeypatch, driver):
    """A container with a 64 KiB memlock limit is not refused when pinning works (CUDA's pinned
    memory is not under RLIMIT_MEMLOCK); the run is refused, naming host memory and pin_memory,
    when pinning fails and pin_memory=True, and falls back with a warning by default."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda r: (64 * 2**10, 64 * 2**10))
    cuda = torch.device("cuda")  # nothing of CUDA runs in nvme_window: its pinning goes through REGISTER
    blocks = _blocks()
    layout = [(n, t) for _, n, t in slab_layout(blocks)]
    cfg = MegaTrainConfig(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                          host_memory_limit="8MiB").nvme
    budget, min_window, _ = nvme_window(blocks, cfg, cuda, 1, pin=True)
    staging = 2 * (-(-4 * max(t for _, t in layout) // PAGE) * PAGE)
    assert budget.used == staging  # the D2H staging buffers are counted in the limit
    (ptr, n), = driver.registered.items()
    # what is pinned: the arena (at least the minimum window less the staging) + the staging, within the limit
    assert min_window - staging <= n and n + staging <= cfg.host_memory_limit
    driver.fail = True
    with pytest.raises(HostPinningError, match="host memory.*pin_memory=False"):
        nvme_window(blocks, cfg, cuda, 1, pin=True)
    nvme_window(blocks, cfg, cuda, 1, pin=None)  # default: pageable with a warning, not refused
    # too small a limit is still refused by the budget check, before anything is pinned
    driver.fail, driver.registered = False, {}
    small = MegaTrainConfig(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                            host_memory_limit=min_window - 1).nvme
    with pytest.raises(ValueError, match="host_memory_limit"):
        nvme_window(blocks, small, cuda, 1, pin=True)
    assert driver.registered == {}


# ---------------------------------------------------------------- NVMe runs: what is allocated
def _tight_limit() -> int:
    blocks = _blocks()
    layout = [(n, t) for _, n, t in slab_layout(blocks)]
    cfg = MegaTrainConfig(offload_params="nvme", offload_optimizer="nvme", nvme_path="/tmp",
                          host_memory_limit=2**30).nvme
    return cfg.min_window(layout) + compute_window_bytes(layout, blocks, 1) + 3 * PAGE


class ArenaSpy:
    """Records every host_buffer (the only way the window gets memory) and checks each window buffer
    the store fills lies inside the arena."""

    def __init__(self, monkeypatch):
        self.allocated: list[int] = []
        self.outside = 0
        self.plans = 0
        real, real_read, real_plan = pinned.host_buffer, nvme_mod.NVMeStore._start_read, PinnedArena.eviction_plan
        spy = self

        def host_buffer_spy(nbytes, pin):
            t = real(nbytes, pin)
            spy.allocated.append(t.numel())
            return t

        def start_read_spy(store, i, kind, e, fresh):
            base, cap = store.arena.buf.data_ptr(), store.arena.capacity
            real_read(store, i, kind, e, fresh)
            if e.buf is not None and not (base <= e.buf.data_ptr() and e.buf.data_ptr() + e.nbytes <= base + cap):
                spy.outside += 1

        def plan_spy(arena, n, cost):
            plan = real_plan(arena, n, cost)
            spy.plans += bool(plan)
            return plan

        monkeypatch.setattr(pinned, "host_buffer", host_buffer_spy)
        monkeypatch.setattr(nvme_mod.NVMeStore, "_start_read", start_read_spy)
        monkeypatch.setattr(PinnedArena, "eviction_plan", plan_spy)


def test_window_memory_stays_within_the_limit_with_awkward_regions(tmp_path, monkeypatch):
    limit = _tight_limit()
    ram, _ = fit(MegaTrainStrategy(), model_kw=AWKWARD, steps=6)
    spy = ArenaSpy(monkeypatch)
    disk, tr = fit(MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                                     host_memory_limit=limit), model_kw=AWKWARD, steps=6)
    assert_bitwise(ram, disk)
    eng = tr.strategy.engine
    arena = eng.store.nvme.arena
    assert spy.allocated == [arena.capacity]  # one allocation for the whole window
    assert sum(spy.allocated) <= limit and arena.peak <= arena.capacity
    assert spy.outside == 0  # every buffer read from disk was a view of the arena
    assert spy.plans > 0  # the embedding/head regions needed evictions for a contiguous range
    assert max(h["megatrain/host_budget_peak_bytes"] for h in eng.history) <= limit
    tr.strategy.close()


# ---------------------------------------------------------------- the H2D staging ring
class ManualEvents:
    """``when_done`` whose events complete when the test says so (in order, as on one CUDA stream)."""

    def __init__(self):
        self.pending: list[tuple[object, object]] = []

    def when_done(self, ev, fn):
        if ev is None:
            fn()
        else:
            self.pending.append((ev, fn))

    def complete_oldest(self):
        _, fn = self.pending.pop(0)
        fn()


def test_ring_reuses_a_slot_only_after_its_copy_completed():
    arena = PinnedArena(16 * PAGE)
    ev = ManualEvents()

    def alloc(n):
        off = arena.alloc(n)
        return off, arena.view(off, n)

    ring = StagingRing(alloc, lambda off, n: arena.free(off), ev.when_done, slots=2)
    a, b = ring.acquire(3 * PAGE), ring.acquire(3 * PAGE)
    ring.release_after(a, "copy a")
    ring.release_after(b, "copy b")
    got = []
    th = threading.Thread(target=lambda: got.append(ring.acquire(3 * PAGE)))
    th.start()
    time.sleep(0.05)
    assert not got and ring.inflight == 2  # both copies still run: the third cast waits
    ev.complete_oldest()  # copy a done
    th.join(5)
    assert got and got[0].key == a.key  # a's range, given back, is the one reused
    assert ring.released == [0] and ring.acquired == [0, 1, 2] and ring.peak_inflight == 2
    ev.complete_oldest()
    ring.release_after(got[0], None)
    assert ring.inflight == 0 and arena.used == 0


class LateEvent:
    def __init__(self):
        self.done = threading.Event()
        threading.Timer(0.002, self.done.set).start()

    def synchronize(self):  # as torch.cuda.Event: Slab.wait_reads waits on the last read this way
        self.done.wait()


class LateReleaseTransport(CPUTransport):
    """CPUTransport whose copies 'complete' 2 ms after they are issued: the window holds and ring slots
    are given back later, on another thread, as on CUDA."""

    def __init__(self, device, zero_copy=False):
        super().__init__(device, zero_copy=False)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def to_device(self, host, dtype=torch.float32, layout=None):
        buf, _ = super().to_device(host, dtype, layout)
        return buf, LateEvent()

    def when_done(self, event, fn):
        if event is None:
            return fn()

        def run():
            event.done.wait()
            fn()

        th = threading.Thread(target=run)
        with self._lock:
            self._threads.append(th)
        th.start()

    def last_read_done(self, event):
        if event is not None:
            event.done.wait()

    def settle(self):
        with self._lock:
            ths, self._threads = self._threads, []
        for th in ths:
            th.join()


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_late_copy_releases_keep_nvme_results(tmp_path, monkeypatch, precision):
    """Window holds (fp32 wire) and staging slots (16-bit wire) given back only when a copy 'completes':
    results stay bitwise the RAM tier's, the ring never has more than 2 slots out, and everything is
    given back at the end."""
    monkeypatch.setattr(streaming_mod, "make_transport", lambda device, n, zc=False, **kw: LateReleaseTransport(device))
    limit = _tight_limit() + 2 * 4 * 11 * PAGE
    disk, tr = fit(MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                                     host_memory_limit=limit), model_kw=AWKWARD, steps=4, precision=precision)
    monkeypatch.undo()
    ram, _ = fit(MegaTrainStrategy(), model_kw=AWKWARD, steps=4, precision=precision)
    assert_bitwise(ram, disk)
    eng = tr.strategy.engine
    ring = eng.fetcher.ring
    if precision == "bf16-mixed":
        assert len(ring.acquired) > 0 and ring.peak_inflight <= 2
        assert sorted(ring.released) == ring.acquired  # every slot came back
    else:
        assert ring.acquired == []  # fp32 copies read the window buffer itself
    assert ring.inflight == 0
    assert all(e.pins == 0 for e in eng.store.nvme.entries.values())  # every window hold ended
    assert max(h["megatrain/host_budget_peak_bytes"] for h in eng.history) <= limit
    tr.strategy.close()


def test_hold_lets_its_own_buffers_go_when_they_split_the_arena(tmp_path):
    """A 3-page arena: the first region of a hold lands in the middle page, so its 2-page master fits
    nowhere while it stays pinned; the hold lets it go and places both again, instead of waiting forever."""
    from megatrain_lightning.store.budget import HostBudget
    from megatrain_lightning.store.nvme import NVMeStore

    layout = [(2048, 1024), (1024, 0), (1024, 0), (1024, 0)]  # block 0: master 2 pages, exp_avg 1 page
    st = NVMeStore(tmp_path, layout, HostBudget(3 * PAGE), arena=PinnedArena(3 * PAGE), place_timeout_s=5)
    for i in (1, 2, 3):
        with st.hold(i, ["master"], write=True, fresh=["master"]) as t:
            t["master"].fill_(i)
    st.wait_io()
    st.discard(2, "master")  # page 1 free: the next 1-page buffer goes there
    with st.hold(0, ["exp_avg", "master"], write=True, fresh=["exp_avg", "master"]) as t:
        t["exp_avg"].fill_(5.0)
        t["master"].fill_(7.0)
        assert {st.entries[(0, "exp_avg")].off, st.entries[(0, "master")].off} == {0, PAGE}
    st.wait_io()
    for i, v in ((1, 1.0), (2, 2.0), (3, 3.0), (0, 7.0)):
        with st.hold(i, ["master"]) as t:
            assert torch.all(t["master"] == v)
    st.close()


@pytest.mark.parametrize("pin,registered", [(False, 0), (None, 1), (True, 1)])
def test_wire_shadows_honour_pin_memory(driver, pin, registered):
    """RAM tier, 16-bit wire on a CUDA device: the cached wire image of a slab is pinned exactly (one
    registration of its page-rounded size) unless pin_memory=False."""
    from megatrain_lightning.engine.accounting import ByteAccounting
    from megatrain_lightning.engine.fetch import WeightFetcher
    from megatrain_lightning.store.host import build_store

    blocks = _blocks()
    store = build_store(blocks)
    fetcher = WeightFetcher(blocks, store, CPUTransport(torch.device("cpu")), ByteAccounting(),
                            torch.device("cuda"), pin_memory=pin)
    fetcher.configure(torch.bfloat16, torch.bfloat16)  # bf16-true: every slab travels as a bf16 image
    blk = blocks[1]  # a decoder layer
    (buf, _), = fetcher.fetch(blk).values()
    slab = store.slabs[blk.slabs[0]]
    assert torch.equal(buf, slab.master.to(torch.bfloat16))
    assert len(driver.registered) == registered
    if registered:
        assert list(driver.registered.values()) == [-(-2 * slab.numel // PAGE) * PAGE]


class _FailsAfter(FakeDriver):
    """Pins the first ``n`` buffers, then refuses (the host runs out of lockable memory)."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def register(self, ptr: int, n: int) -> None:
        if self.left == 0:
            raise HostPinningError("out of memory")
        self.left -= 1
        super().register(ptr, n)


@pytest.mark.parametrize("pin", [None, True, False])
def test_ram_tier_masters_fall_back_to_pageable_memory_under_the_default(monkeypatch, caplog, pin):
    """RAM tier on CUDA: the master slabs are pinned while the driver can; with ``pin_memory=None`` the slab it
    refuses and every later one are pageable, after one warning, and hold the same weights; ``True`` raises;
    ``False`` never pins."""
    from megatrain_lightning.store.host import build_store

    d = _FailsAfter(2)
    monkeypatch.setattr(pinned, "REGISTER", d.register)
    monkeypatch.setattr(pinned, "UNREGISTER", d.unregister)
    model = make_model("llama", **AWKWARD)
    want = {k: v.detach().clone() for k, v in model.named_parameters()}
    blocks = discover_blocks(LM(model))
    if pin is True:
        with pytest.raises(HostPinningError, match="out of memory"):
            build_store(blocks, pin_memory=True)
        return
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning.store.pinned"):
        store = build_store(blocks, pin_memory=pin)
    masters = [s.master for s in store.slabs if s.master is not None and s.master.numel()]
    pinned_ptrs = set(d.registered)
    is_pinned = [m.untyped_storage().data_ptr() in pinned_ptrs for m in masters]
    if pin is None:
        assert is_pinned[:2] == [True, True] and not any(is_pinned[2:]) and len(masters) > 3
        assert caplog.text.count("Using pageable memory for the master weights") == 1
    else:
        assert not any(is_pinned) and not d.registered
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), want[k]), k
