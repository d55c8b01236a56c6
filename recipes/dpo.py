"""Preference fine-tuning recipe (Hydra): DPO, IPO or SimPO through ``strategy="megatrain"``. Copy this file to
change one step.

    python recipes/dpo.py                                        # SmolLM2-135M-Instruct, biomedical pairs
    python recipes/dpo.py preference.source=pairs.jsonl          # your {prompt, chosen, rejected} records
    python recipes/dpo.py model.weights=outputs/sft/checkpoint/model   # after a recipes/finetune.py run
    python recipes/dpo.py dpo.loss_type=simpo dpo.reference=null dpo.beta=2.0

Configuration: conf/dpo.yaml (groups model, strategy, trainer, hardware as for finetune.py). Results land in the run
directory (outputs/DATE/TIME/): summary.json, summary.md, loss.png (loss and reward margin per step), checkpoint/.
"""

from __future__ import annotations

import time

import hydra
from omegaconf import DictConfig


def dpo(cfg: DictConfig) -> dict:
    """Run the recipe on a composed config; returns the summary (see ``recipes_lib.preference.report``)."""
    import lightning.pytorch as pl  # imported here, not at the top: `--help` stays fast

    import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
    from megatrain_lightning.recipes_lib import preference as step
    from megatrain_lightning.recipes_lib import run

    timings: dict[str, float] = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        timings[name] = time.perf_counter() - t0
        return out

    pl.seed_everything(cfg.seed, workers=True)
    tokenizer = timed("preflight", step.preflight, cfg)    # tokenizer, every pair encoded and checked, the planner
    history = step.StepHistory()
    trainer = step.build_trainer(cfg, history)             # Lightning's own checks of trainer.*, before the model loads
    data = timed("build_data", step.build_pairs, cfg, tokenizer)
    model, tokenizer = timed("build_model", run.build_model, cfg)
    module = step.build_module(cfg, model, tokenizer)
    before = timed("evaluate_before", step.evaluate, cfg, trainer, module, data, tokenizer)
    result = timed("fit", step.fit, trainer, module, data)  # the reference pass runs at its start
    ckpt = timed("save", run.save, cfg, trainer)
    after = timed("evaluate_after", step.evaluate, cfg, trainer, module, data, tokenizer)
    text = timed("sample", step.sample, cfg, trainer, module, tokenizer, data)
    return step.report(cfg, trainer, before, after, result, timings, history, text, ckpt)


@hydra.main(version_base="1.3", config_path="../conf", config_name="dpo")
def main(cfg: DictConfig) -> None:
    from megatrain_lightning.recipes_lib.console import tidy_console
    from megatrain_lightning.recipes_lib.run import refusals_exit

    tidy_console()  # one line per log message; known-harmless third-party notices filtered
    with refusals_exit(cfg.output_dir):  # a config/data refusal: one line naming the key, exit 2
        dpo(cfg)


if __name__ == "__main__":
    import sys

    if not any(a.startswith("-") for a in sys.argv[1:]):  # flags (--help, -m, --cfg) go to Hydra as they are
        from pathlib import Path

        from megatrain_lightning.recipes_lib.checks import refuse_misspelt_override
        from megatrain_lightning.recipes_lib.preference import DPO_KEYS

        # `preference.max_lenght=64`: one "did you mean" line, not Hydra's advice to add `+`
        refuse_misspelt_override(sys.argv[1:], "dpo", Path(__file__).resolve().parents[1] / "conf", DPO_KEYS)
    main()
