"""The node-shared store's pieces (store/shared.py) without processes: two mappings of one file stand for two
local ranks (the data-parallel runs themselves are tests/test_data_parallel.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatrain_lightning.store import shared as S


def test_two_mappings_share_every_region_and_regions_do_not_alias(tmp_path):
    layout = [(10, 6), (7, 0), (33, 33)]
    path = str(tmp_path / "state")
    a = S.SharedRegions.map(path, layout, create=True)
    b = S.SharedRegions.map(path, layout, create=False)
    kinds = ("master", "grad_accum", "exp_avg", "exp_avg_sq")
    for i, (n, t) in enumerate(layout):
        for k, kind in enumerate(kinds):
            r = a.region(i, kind)
            assert r.numel() == (n if kind == "master" else t) and r.dtype == torch.float32
            r.fill_(100 * i + k + 1)
    for i, (n, t) in enumerate(layout):  # the other mapping sees every value, none overwritten by a neighbour
        for k, kind in enumerate(kinds):
            r = b.region(i, kind)
            assert torch.all(r == 100 * i + k + 1), (i, kind)
    a.counts[2] = 5
    assert int(b.counts[2]) == 5
    # autograd's version counter of a master does not move when another region of the file is written
    m = b.region(0, "master")
    v = m._version
    b.region(0, "grad_accum").add_(1)
    assert m._version == v


def test_balance_spreads_work_by_size():
    sizes = [100, 90, 10, 10, 10, 5, 80, 1]
    owner = S.balance(sizes, 3)
    load = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert sorted(set(owner)) == [0, 1, 2]
    assert max(load) - min(load) <= max(sizes) and max(load) <= sum(sizes) / 3 + max(sizes)
    assert S.balance(sizes, 1) == [0] * len(sizes)


def test_non_owner_waits_for_the_owners_update_and_times_out_naming_it(tmp_path):
    counts = torch.zeros(2, dtype=torch.int64)
    kw = dict(global_rank_of=lambda r: 10 + r, all_reduce=lambda t, op: None, sync=lambda: None)
    owner = S.SlabOwnership([0, 1], 0, counts, timeout_s=5, **kw)
    other = S.SlabOwnership([0, 1], 1, counts, timeout_s=5, **kw)
    assert owner.owns(0) and not other.owns(0)
    done = []
    t = threading.Thread(target=lambda: (other.wait(0), done.append(time.monotonic())))
    t.start()
    time.sleep(0.2)
    assert not done  # still waiting: nothing published
    t_pub = time.monotonic()
    owner.published(0)
    t.join(5)
    assert done and done[0] >= t_pub
    quick = S.SlabOwnership([0, 1], 1, counts, timeout_s=0.2, **kw)
    quick.expected[0] = 1
    with pytest.raises(S.OwnerTimeout, match="rank 10 .*local rank 0.*slab 0"):
        quick.wait(0)


def test_wire_image_generations(tmp_path):
    path = str(tmp_path / "wire")
    a = S.SharedWireImages(path, [8, 0, 4], create=True, pin=False, timeout_s=0.3)
    b = S.SharedWireImages(path, [8, 0, 4], create=False, pin=False, timeout_s=0.3)
    a.images[0].fill_(7)
    a.written(0)
    b.wait_newer(0, owner_rank=0)  # generation 1 is newer than none
    assert torch.all(b.images[0] == 7)
    with pytest.raises(S.OwnerTimeout, match="rank 3, which writes the wire image of slab 0, did not write it within"):
        b.wait_newer(0, owner_rank=3)  # no newer generation comes
    b.timeout_s = 60
    t0 = time.monotonic()
    with pytest.raises(S.OwnerTimeout, match="rank 3, .*did not write it: its process has exited"):
        b.wait_newer(0, owner_rank=3, exited=lambda: True)  # a dead owner is noticed within about a second
    assert time.monotonic() - t0 < 10


def test_check_shm_names_the_numbers_and_the_fix(monkeypatch):
    class St:
        f_bavail, f_frsize, f_blocks = 1000, 4096, 2000
    monkeypatch.setattr(S.os, "statvfs", lambda d: St)
    S.check_shm(1000 * 4096, "/dev/shm")
    with pytest.raises(S.SharedMemoryTooSmall, match=r"needs 4.00 MiB .*has 3.91 MiB free.*--shm-size"):
        S.check_shm(4 * 2**20, "/dev/shm")


def test_copy_on_write_mapping_reads_shared_pages_and_keeps_writes_private(tmp_path):
    """``private_mapping``: reads see the file (also what another process writes later to a page not yet written
    here); writes stay private and are found by ``written_privately`` (also through ``.data``); after
    ``madvise(MADV_DONTNEED)`` the pages show the file again. Regions larger than a page, so a write to one
    region is told apart from its neighbours'."""
    import mmap

    layout = [(5000, 3000), (4000, 4000)]
    path = str(tmp_path / "state")
    shared = S.SharedRegions.map(path, layout, create=True)
    other = S.SharedRegions.map(path, layout, create=False)  # another local rank
    shared.region(0, "grad_accum").fill_(1.0)
    shared.region(1, "grad_accum").fill_(2.0)
    cow = shared.private_mapping()
    g0, g1 = shared.region(0, "grad_accum", cow), shared.region(1, "grad_accum", cow)
    assert torch.all(g0 == 1.0) and torch.all(g1 == 2.0)
    assert not shared.written_privately(g0) and not shared.written_privately(g1)
    g1.data[3500:].mul_(0.5)  # through .data: no autograd version bump
    assert shared.written_privately(g1) and not shared.written_privately(g0)
    assert torch.all(other.region(1, "grad_accum") == 2.0)  # the file is untouched
    other.region(0, "grad_accum").fill_(3.0)  # another rank's write to pages not written here: seen
    assert torch.all(g0 == 3.0)
    other.region(1, "grad_accum")[3500:].fill_(7.0)  # to pages written here: the private copy stays
    assert torch.all(g1[3500:] == 1.0)
    cow.madvise(mmap.MADV_DONTNEED)
    assert torch.all(g1[3500:] == 7.0) and not shared.written_privately(g1)
