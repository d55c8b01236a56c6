"""The recipe's end-of-run summary: before/after metrics, throughput, memory, bytes moved."""

from __future__ import annotations

import resource
from typing import Any, Sequence


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes; Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_table(rows: Sequence[tuple[str, str, str]], header: tuple[str, str, str] = ("metric", "before", "after")) -> str:
    """A plain-text table with a header row; every cell is already a string."""
    all_rows = [header, *rows]
    widths = [max(len(r[i]) for r in all_rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_rows(before: dict[str, float], after: dict[str, float], run: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows: every metric measured before or after (an empty cell where it was not), then the run statistics of
    :func:`~.run.fit` (with ``device`` ``"cpu"`` the H2D/D2H rows are named as host-memory copies)."""
    rows = []
    cell = lambda d, k: f"{d[k]:.4f}" if k in d else ""  # noqa: E731
    for k in sorted(set(before) | set(after)):
        rows.append((k, cell(before, k), cell(after, k)))
    gib = 2**30
    h2d, d2h = "H2D per step", "D2H per step"
    if run.get("device") == "cpu":  # no accelerator: the "transfers" are copies within host memory
        h2d, d2h = "weight copies per step (host, no GPU)", "gradient copies per step (host, no GPU)"
    extra = [
        ("optimizer steps", f"{run.get('steps', 0)}"),
        ("train seconds", f"{run.get('seconds', float('nan')):.1f}"),
        ("train tokens/s", f"{tps:,.0f}" if (tps := run.get("tokens_per_s", float("nan"))) >= 100 else f"{tps:.3g}"),
        ("peak RSS", f"{run.get('peak_rss_bytes', 0) / gib:.2f} GiB"),
        (h2d, f"{run.get('h2d_bytes', 0) / 2**20:.1f} MiB"),
        (d2h, f"{run.get('d2h_bytes', 0) / 2**20:.1f} MiB"),
    ]
    for key, what in (("examples_left_out", "train examples left out (no answer within seq_len)"),
                      ("examples_cut", "train examples cut at seq_len")):
        if run.get(key):
            extra.append((what, f"{run[key]}"))
    rows.extend((k, "", v) for k, v in extra)
    return rows

