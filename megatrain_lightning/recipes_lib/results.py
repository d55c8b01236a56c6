"""What a recipe run leaves in its directory to keep and look at: ``summary.json``, ``summary.md``, ``loss.png``,
and the summary table it prints (before/after metrics, throughput, memory, bytes moved).

``summary.json`` keys (:data:`SUMMARY_KEYS`): ``metrics`` (``{name: {"before", "after"}}``, every metric of the
printed table; ``before`` is ``null`` with ``eval.before=false``), ``run`` (the statistics
:func:`~.run.fit` returns), ``timings`` (seconds of each recipe step), ``loss`` (``[{"step", "loss"}]``,
:class:`LossHistory`), ``sample`` (``{"prompt", "completion"}`` or ``{}``), ``checkpoint`` (the saved directory or
``null``), ``config`` (the composed config, resolved).
"""

from __future__ import annotations

import json
import logging
import math
import resource
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl

log = logging.getLogger(__name__)
SUMMARY_KEYS = ("metrics", "run", "timings", "loss", "sample", "checkpoint", "config")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (bytes; Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_table(rows: Sequence[tuple[str, str, str]],
                 header: tuple[str, str, str] = ("metric", "before", "after")) -> str:
    """A plain-text table with a header row; every cell is already a string."""
    all_rows = [header, *rows]
    widths = [max(len(r[i]) for r in all_rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_rows(before: dict[str, float], after: dict[str, float], run: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows: every metric measured before or after (an empty cell where it was not), then the run statistics of
    :func:`~.run.fit` (with ``device`` ``"cpu"`` the H2D/D2H rows are named as host-memory copies)."""
    cell = lambda d, k: f"{d[k]:.4f}" if k in d else ""  # noqa: E731
    rows = [(k, cell(before, k), cell(after, k)) for k in sorted(set(before) | set(after))]
    h2d, d2h = "H2D per step", "D2H per step"
    if run.get("device") == "cpu":  # no accelerator: the "transfers" are copies within host memory
        h2d, d2h = "weight copies per step (host, no GPU)", "gradient copies per step (host, no GPU)"
    extra = [
        ("optimizer steps", f"{run.get('steps', 0)}" + (f" ({run['steps_run']} in this run)"
                                                         if run.get("steps_run", run.get("steps")) != run.get("steps")
                                                         else "")),
        ("train seconds", f"{run.get('seconds', float('nan')):.1f}"),
        ("train tokens/s", f"{tps:,.0f}" if (tps := run.get("tokens_per_s", float("nan"))) >= 100 else f"{tps:.3g}"),
        ("peak RSS", f"{run.get('peak_rss_bytes', 0) / 2**30:.2f} GiB"),
        (h2d, f"{run.get('h2d_bytes', 0) / 2**20:.1f} MiB"),
        (d2h, f"{run.get('d2h_bytes', 0) / 2**20:.1f} MiB"),
    ]
    for key, what in (("examples_left_out", "train examples left out (no answer within seq_len)"),
                      ("examples_cut", "train examples cut at seq_len")):
        if run.get(key):
            extra.append((what, f"{run[key]}"))
    rows.extend((k, "", v) for k, v in extra)
    return rows


class LossHistory(pl.Callback):
    """Training loss of every optimizer step: ``steps`` is ``[{"step": global step after it, "loss": ...}]``, the
    logged ``metric`` when the step's last micro-batch ends, i.e. what the loggers write (the step's mean loss, see
    :meth:`~.module.CausalLMModule.training_step`; ``outputs["loss"]`` is not used: Lightning divides it by
    ``accumulate_grad_batches``). A step with no logged ``metric`` is left out (one warning)."""

    def __init__(self, metric: str = "train_loss") -> None:
        self.metric = metric
        self.steps: list[dict[str, float]] = []
        self._last_step = 0
        self._warned = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._last_step = int(trainer.global_step)  # a resumed run starts past 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step <= self._last_step:  # a micro-batch that did not complete an optimizer step
            return
        self._last_step = int(trainer.global_step)
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            if not self._warned:
                log.warning("The training loss history (summary.json, loss.png) is empty: the LightningModule logs "
                            "no %r (self.log(%r, loss) in training_step).", self.metric, self.metric)
                self._warned = True
            return
        self.steps.append({"step": self._last_step, "loss": float(value)})


def _num(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v


def build_summary(before: dict[str, float], after: dict[str, float], run: dict[str, Any], timings: dict[str, float],
                  loss: list[dict], sample: dict[str, str], checkpoint: str | None, config: dict) -> dict[str, Any]:
    """The ``summary.json`` mapping (keys :data:`SUMMARY_KEYS`; see the module docstring)."""
    metrics = {k: {"before": _num(before.get(k)), "after": _num(after.get(k))} for k in sorted(set(before) | set(after))}
    return {"metrics": metrics, "run": {k: _num(v) for k, v in run.items()}, "timings": timings, "loss": loss,
            "sample": sample, "checkpoint": checkpoint, "config": config}


def _measured(summary: dict[str, Any], when: str) -> dict[str, float]:
    """The metrics of ``summary`` measured ``when`` (``"before"`` or ``"after"``)."""
    return {k: v[when] for k, v in summary["metrics"].items() if v[when] is not None}


def summary_markdown(summary: dict[str, Any]) -> str:
    """``summary.md``: the printed table, the timings, the sample and where the checkpoint is."""
    rows = summary_rows(_measured(summary, "before"), _measured(summary, "after"), summary["run"])
    lines = ["# Fine-tuning run", "", "| metric | before | after |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", "| step | seconds |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in summary["timings"].items()]
    if summary["checkpoint"]:
        lines += ["", f"Checkpoint: `{summary['checkpoint']}` (Hugging Face model in `model/`)"]
    s = summary["sample"]
    if s:
        lines += ["", "Sample prompt:", "", "```", s["prompt"], "```", "", "Completion:", "", "```", s["completion"], "```"]
    if summary.get("plot"):
        lines += ["", "![loss](loss.png)"]
    return "\n".join(lines) + "\n"


def plot_loss(path: Path, loss: list[dict], before: dict[str, float], after: dict[str, float]) -> bool:
    """Write ``loss.png``: training loss per optimizer step, validation loss before (at step 0) and after (at the
    last step). Returns ``False`` (and logs one line) when matplotlib is missing or there is nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("loss.png not written: matplotlib is not installed (pip install 'megatrain-lightning[plots]').")
        return False
    if not loss and "val_loss" not in after:
        log.info("loss.png not written: no training loss and no validation loss to plot.")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if loss:
        ax.plot([p["step"] for p in loss], [p["loss"] for p in loss], marker=".", label="train loss")
    last = loss[-1]["step"] if loss else 0
    if "val_loss" in before:
        ax.scatter([0], [before["val_loss"]], color="tab:red", zorder=3, label="val loss before")
    if "val_loss" in after:
        ax.scatter([last], [after["val_loss"]], color="tab:green", zorder=3, label="val loss after")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_results(out_dir: Path, summary: dict[str, Any], plot: bool) -> dict[str, Path]:
    """Write ``summary.json``, ``summary.md`` and (``plot``) ``loss.png`` into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "summary.json", "md": out_dir / "summary.md"}
    if plot:
        if plot_loss(out_dir / "loss.png", summary["loss"], _measured(summary, "before"), _measured(summary, "after")):
            paths["png"] = out_dir / "loss.png"
            summary = {**summary, "plot": "loss.png"}
    paths["json"].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    paths["md"].write_text(summary_markdown(summary))
    return paths
