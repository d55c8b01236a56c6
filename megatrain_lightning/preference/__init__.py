"""Preference fine-tuning (DPO, IPO, SimPO) through ``Trainer(strategy="megatrain")``: docs/guide/preference.md."""

from .data import PreferenceDataError, PreferenceDataset, collate_pairs, encode_pair
from .losses import LOSS_TYPES, dpo_sigmoid, ipo, preference_loss, simpo
from .module import REFERENCES, DPOModule, chunked_sequence_logps, sequence_logps

__all__ = ["DPOModule", "LOSS_TYPES", "PreferenceDataError", "PreferenceDataset", "REFERENCES", "chunked_sequence_logps", "collate_pairs",
           "dpo_sigmoid", "encode_pair", "ipo", "preference_loss", "sequence_logps", "simpo"]
