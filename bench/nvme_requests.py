"""How the NVMe store should split a region into requests (the measurement behind nvme_io_block_size).

Moves --total-gib of 206 MB regions (one decoder layer of a hidden-2048 Llama in fp32) with O_DIRECT,
one or two regions in flight at once, each region either as one preadv/pwritev or split into
requests of 64/16/8 MiB run by a pool of 4 or 8 request threads (the store's io_threads), as
the store does in megatrain_lightning/store/nvme.py (NVMeStore._transfer). Prints a table of GB/s
and writes bench/results/nvme_requests.json.

Run:
    python bench/nvme_requests.py --dir /path/on/fast/disk    # ~2 minutes with 8 GiB
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatrain_lightning.store.nvme import aligned_empty  # noqa: E402

REGION = 206 * 2**20  # bytes: one 51.4M-parameter decoder layer in fp32
SETTINGS = [(None, 0), (64, 4), (16, 4), (8, 4), (64, 8), (16, 8), (8, 8)]  # (request MiB or whole region, threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--total-gib", type=float, default=8.0)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "nvme_requests.json"))
    a = p.parse_args()
    path = os.path.join(a.dir, f".requests_{os.getpid()}")
    total = int(a.total_gib * 2**30) // REGION * REGION
    n_regions = total // REGION
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    bufs = [aligned_empty(REGION) for _ in range(2)]
    for b in bufs:
        b.fill_(1)

    def region(op: str, r: int, chunk: int | None, pool: ThreadPoolExecutor | None) -> None:
        mv = memoryview(bufs[r % 2].numpy())
        fn = os.pwritev if op == "write" else os.preadv
        if chunk is None:
            fn(fd, [mv], r * REGION)
            return
        for f in [pool.submit(fn, fd, [mv[o : o + chunk]], r * REGION + o) for o in range(0, REGION, chunk)]:  # type: ignore[union-attr]
            f.result()

    rows = []
    try:
        os.posix_fallocate(fd, 0, total)
        for op in ("write", "read"):
            for in_flight in (1, 2):
                for mib, threads in SETTINGS:
                    chunk = None if mib is None else mib * 2**20
                    pool = ThreadPoolExecutor(threads) if threads else None
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(in_flight) as regions:
                        list(regions.map(lambda r: region(op, r, chunk, pool), range(n_regions)))
                    os.fsync(fd)
                    gbps = total / (time.perf_counter() - t0) / 1e9
                    if pool:
                        pool.shutdown()
                    rows.append({"op": op, "regions_in_flight": in_flight, "request_mib": mib, "threads": threads, "gbps": gbps})
                    print(f"{op:5s} regions in flight {in_flight}  request {'region' if mib is None else f'{mib} MiB':>7s} "
                          f"threads {threads or 1}: {gbps:5.2f} GB/s", flush=True)
    finally:
        os.close(fd)
        os.unlink(path)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"bench": "nvme_requests", "region_bytes": REGION, "total_bytes": total, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
