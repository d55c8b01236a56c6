"""Pieces shared by the Hydra recipes in ``recipes/``: the LightningModule, model building, reporting."""
