"""Domain fine-tuning recipe (Hydra): legal, biomedical nomenclature, code.

    python recipes/finetune.py                            # SmolLM2-135M on the legal corpus
    python recipes/finetune.py data=biomedical trainer.max_steps=50
    python recipes/finetune.py model=llama100b data=legal  # preflight says what this needs
    python recipes/finetune.py --multirun data=legal,code

Configuration: conf/finetune.yaml and its groups (model, data, strategy, trainer, hardware).
"""

import hydra
from omegaconf import DictConfig

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.recipes_lib.run import finetune


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    finetune(cfg)


if __name__ == "__main__":
    main()
