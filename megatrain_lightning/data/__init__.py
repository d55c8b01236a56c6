from .datamodule import DomainDataModule
from .factory import biomedical_pairs, code_texts, legal_texts, load_user_source, make_datamodule, offline_source
from .probes import PROBES, biomedical_probe, code_probe, continuation_loss, legal_probe
from .probe_items import code_items, instruction_items, legal_items
from .resumable import ResumableDataLoader
from .resume_alignment import ResumedEpochAlignment

__all__ = [
    "DomainDataModule",
    "PROBES",
    "ResumableDataLoader",
    "ResumedEpochAlignment",
    "biomedical_pairs",
    "biomedical_probe",
    "code_items",
    "code_probe",
    "code_texts",
    "continuation_loss",
    "instruction_items",
    "legal_items",
    "legal_probe",
    "legal_texts",
    "load_user_source",
    "make_datamodule",
    "offline_source",
]
