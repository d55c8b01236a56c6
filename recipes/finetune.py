"""Fine-tuning recipe (Hydra): the steps it runs, top to bottom. Copy this file to change one.

    python recipes/finetune.py                                   # SmolLM2-135M on the legal corpus
    python recipes/finetune.py data=instruction data.source=pairs.jsonl trainer.max_steps=50
    python recipes/finetune.py data=biomedical eval.before=false checkpoint.every_n_steps=10
    python recipes/finetune.py resume=last trainer.max_steps=100  # continue the newest run
    python recipes/finetune.py model=llama100b data=legal         # preflight says what this needs

Configuration: conf/finetune.yaml and its groups (model, data, strategy, trainer, hardware). Results land in the
run directory (outputs/DATE/TIME/): summary.json, summary.md, loss.png, logs/, checkpoint/. The console: one line per
log message, a progress bar (or, where none is visible, a line per optimizer step), and two known-harmless
third-party notices filtered with warnings.filterwarnings / a logging filter (megatrain_lightning/recipes_lib/console.py).
"""

from __future__ import annotations

import time

import hydra
from omegaconf import DictConfig


def finetune(cfg: DictConfig) -> dict:
    """Run the recipe on a composed config; returns the summary (see ``recipes_lib.results``)."""
    import lightning.pytorch as pl  # imported here, not at the top: `--help` stays fast

    import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
    from megatrain_lightning.recipes_lib import run as step

    timings: dict[str, float] = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        timings[name] = time.perf_counter() - t0
        return out

    resumed = timed("preflight", step.preflight, cfg)     # config keys, data, paths, memory, the checkpoint `resume` names
    trainer, history = step.build_trainer(cfg)              # Lightning's own checks of trainer.*, before the model loads
    pl.seed_everything(cfg.seed, workers=True)
    model, tok = timed("build_model", step.build_model, cfg)
    dm = timed("build_data", step.build_data, cfg, tok)
    lm = step.build_module(cfg, model, tok)
    with step.closing_loggers(trainer):                     # a wandb run ends here, also on an error
        # resumed: "before" is of the weights the run continues from
        before = timed("evaluate_before", step.evaluate, trainer, lm, dm, resumed) if cfg.eval.before else {}
        run = timed("fit", step.fit, cfg, trainer, lm, dm, resumed)
        ckpt = timed("save", step.save, cfg, trainer)       # first after fit: a later failure keeps the training
        after = timed("evaluate_after", step.evaluate, trainer, lm, dm)
        text = timed("sample", step.sample, cfg, trainer, lm, tok, dm)
        return step.report(cfg, trainer, before, after, run, timings, history, text, ckpt)


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    from megatrain_lightning.recipes_lib.console import tidy_console
    from megatrain_lightning.recipes_lib.run import refusals_exit

    tidy_console()  # one line per log message; known-harmless third-party notices filtered (see its docstring)
    with refusals_exit(cfg.output_dir):  # a config/data/memory refusal: one line naming the key, exit 2
        finetune(cfg)


if __name__ == "__main__":
    import sys

    if not any(a.startswith("-") for a in sys.argv[1:]):  # flags (--help, -m, --cfg) go to Hydra as they are
        from pathlib import Path

        from megatrain_lightning.recipes_lib.checks import refuse_misspelt_override

        # `trainer.max_stpes=3`: one "did you mean" line, not Hydra's advice to add `+`
        refuse_misspelt_override(sys.argv[1:], "finetune", Path(__file__).resolve().parents[1] / "conf")
    main()
