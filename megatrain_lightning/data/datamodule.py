"""``DomainDataModule``: documents -> split by document -> tokenized (and cached) -> Lightning loaders and probes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from . import cache
from .corpus import check_document, check_shape, dedupe_ids, fingerprint, split_documents, subsample
from .datasets import InstructionDataset, PackedDataset, PadCollate
from .encode import encode_instructions, pack_texts
from .formatting import eos_id, resolve_chat_template
from .probes import PROBES
from .resumable import ResumableDataLoader

log = logging.getLogger(__name__)
# probe_options keys: for the item builder, for the probe function (plus "max_items" for both)
_BUILDER_OPTIONS = {"legal": {"min_words"}, "code": {"max_body_lines"}, "biomedical": {"kinds"}}
_PROBE_OPTIONS = {"legal": {"batch_size", "max_tokens"}, "code": {"batch_size", "max_tokens"},
                  "biomedical": {"batch_size", "max_new_tokens", "use_chat_template"}}


def probe_option_names(probe: str) -> set[str]:
    """The ``probe_options`` keys probe ``probe`` takes (its item builder's, its function's, and ``max_items``).

    Raises:
        ValueError: unknown probe name.
    """
    if probe not in PROBES:
        raise ValueError(f"Unknown probe {probe!r}; choose from {sorted(PROBES)} or None.")
    return _PROBE_OPTIONS[probe] | _BUILDER_OPTIONS[probe] | {"max_items"}


def split_corpus(raw: Iterable[dict], shape: str, val_fraction: float, seed: int,
                 max_documents: int | None = None) -> tuple[list[dict], list[dict]]:
    """The training and validation documents of a corpus as :class:`DomainDataModule` builds them (checked,
    de-duplicated, subsampled, split by :func:`~.corpus.split_documents`); also the recipes' preflight check.

    Raises:
        ValueError: a document is malformed (:func:`~.corpus.check_document`), the corpus is empty, every document
            fell into the validation split, or none did while ``val_fraction > 0`` (each says what to change).
        TypeError: a document of the wrong type.
    """
    docs = dedupe_ids(check_document(d, shape, f"document {i}") for i, d in enumerate(raw))
    if not docs:
        raise ValueError("The corpus is empty: the source gave no documents.")
    docs = subsample(docs, max_documents, seed)
    train, val = split_documents(docs, val_fraction, seed)
    if not train:
        raise ValueError(f"All {len(docs)} documents fell into the validation split; lower val_fraction.")
    if val_fraction > 0 and not val:
        raise ValueError(f"No document fell into the validation split ({len(docs)} documents, val_fraction="
                         f"{val_fraction}); add documents, raise val_fraction, or set it to 0.")
    return train, val


class DomainDataModule(pl.LightningDataModule):
    """Fine-tuning data for any of the three domains (or a user corpus), in one of two shapes.

    * ``shape="text"``: each document is tokenized with the model's tokenizer (its BOS first if it adds one),
      followed by EOS; a split's documents are concatenated and cut into rows of ``seq_len`` tokens (the
      last partial row is dropped). Batches: ``input_ids = labels`` ``[B, seq_len]``, ``attention_mask`` ones.
    * ``shape="instruction"``: each conversation is rendered with the tokenizer's chat template, or the plain
      "### Question/### Answer" format (see :mod:`~megatrain_lightning.data.formatting`), truncated to
      ``seq_len``; labels are ``-100`` on every prompt token. Batches are right-padded to their longest example
      (``[B, T]``, ``T <= seq_len``): padding has ``attention_mask`` 0 and label ``-100``.

    The split is by document (:func:`~.corpus.split_documents`). Every batch is a dict of LongTensors
    ``{"input_ids", "labels", "attention_mask"}``. The training loader is a shuffling
    :class:`~megatrain_lightning.data.ResumableDataLoader` (exact mid-epoch resume, sharded per rank); validation
    is in order, and with several processes gets Lightning's ``DistributedSampler`` (strided, padded by repeating
    up to world size - 1 rows).

    Args:
        tokenizer: a Hugging Face tokenizer (needs an EOS token).
        documents: the documents (see :mod:`~megatrain_lightning.data.corpus`), or
        source: a callable returning them (called once, at the first ``prepare_data``/``setup``/``stats``).
        shape: ``"text"`` or ``"instruction"``.
        seq_len: tokens per row (text) or maximum tokens per example (instruction).
        batch_size: rows per batch (of each process, with several).
        val_fraction: expected fraction of documents (groups) held out, in ``[0, 1)``; 0 disables validation.
        seed: split, subsample and shuffle seed.
        cache_dir: directory of the tokenized-data cache (safetensors); ``None`` disables caching.
        num_workers: DataLoader worker processes (``persistent_workers`` is on when > 0).
        max_documents: keep this many documents (a deterministic hash-ordered subsample); ``None``: all.
        max_seq_len: the model's limit (``max_position_embeddings``), given by the caller.
        use_chat_template: instruction shape: ``None`` uses the tokenizer's chat template iff it has one.
        probe: the domain probe run by :meth:`run_probe`: ``"legal"``, ``"code"``, ``"biomedical"`` or ``None``.
        probe_options: ``max_items`` and options of the item builder (``min_words``, ``max_body_lines``, ``kinds``)
            and of the probe function (``batch_size``, ``max_tokens``, ``max_new_tokens``).
        pin_memory: DataLoader ``pin_memory``.

    Raises:
        ValueError: bad argument (neither or both of documents/source, ``seq_len > max_seq_len``, non-positive
            sizes, unknown shape/probe). Building raises ValueError for an empty corpus or split.
    """

    def __init__(
        self,
        tokenizer: Any,
        documents: Iterable[dict] | None = None,
        source: Callable[[], Iterable[dict]] | None = None,
        shape: str = "text",
        seq_len: int = 512,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        num_workers: int = 0,
        max_documents: int | None = None,
        max_seq_len: int | None = None,
        use_chat_template: bool | None = None,
        probe: str | None = None,
        probe_options: dict | None = None,
        pin_memory: bool = False,
    ):
        super().__init__()
        if (documents is None) == (source is None):
            raise ValueError("Give exactly one of documents= (a list of dicts) or source= (a callable returning them).")
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}.")
        if max_seq_len is not None and seq_len > max_seq_len:
            raise ValueError(f"seq_len={seq_len} is longer than the model's maximum of {max_seq_len} positions "
                             "(max_position_embeddings); lower data.seq_len to at most that.")
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"batch_size must be >= 1 and num_workers >= 0, got {batch_size} and {num_workers}.")
        allowed = probe_option_names(probe) if probe is not None else set(probe_options or {})
        if set(probe_options or {}) - allowed:
            raise ValueError(f"Unknown probe option(s) {sorted(set(probe_options) - allowed)} for probe {probe!r}; "
                             f"allowed: {sorted(allowed)}.")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        eos_id(tokenizer)
        self.tokenizer, self.shape = tokenizer, check_shape(shape)
        self._documents, self._source = documents, source
        self.seq_len, self.batch_size, self.val_fraction, self.seed = seq_len, batch_size, val_fraction, seed
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.num_workers, self.max_documents, self.pin_memory = num_workers, max_documents, pin_memory
        self.max_seq_len = max_seq_len
        self.use_chat_template = resolve_chat_template(tokenizer, use_chat_template) if shape == "instruction" else False
        self.probe, self.probe_options = probe, dict(probe_options or {})
        self.datasets: dict[str, Dataset] = {}
        self.documents: dict[str, list[dict]] = {}
        self.cache_file: Path | None = None
        self.cache_hit = False
        self._stats: dict[str, dict] = {}

    def _encode_split(self, docs: list[dict], split: str) -> tuple[dict[str, torch.Tensor], dict]:
        if self.shape == "text":
            rows, tokens, tail = pack_texts(self.tokenizer, docs, self.seq_len)
            if rows.shape[0] == 0:
                raise ValueError(f"The {split} split has {tokens} tokens, fewer than seq_len={self.seq_len}: no full "
                                 "row can be packed. Lower seq_len, add documents or change val_fraction.")
            return {f"{split}.rows": rows}, {"documents": len(docs), "tokens": tokens, "sequences": rows.shape[0],
                                              "tail_tokens_dropped": tail}
        t, st = encode_instructions(self.tokenizer, docs, self.seq_len, self.use_chat_template)
        if t["lengths"].numel() == 0:
            raise ValueError(f"The {split} split has no example with an answer token within seq_len={self.seq_len} "
                             f"({len(docs)} documents, {st['dropped']} dropped: the prompt fills seq_len, or the "
                             "record has no answer / assistant turn); raise seq_len, or check that the records have "
                             "answers.")
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), t["lengths"].cumsum(0)])
        tensors = {f"{split}.ids": t["ids"], f"{split}.trained": t["trained"], f"{split}.offsets": offsets}
        stats = {"documents": len(docs), "tokens": int(t["lengths"].sum()), "sequences": t["lengths"].numel(),
                 "trained_tokens": int(t["trained"].sum()), **st}
        return tensors, stats

    def _build(self) -> None:
        if self.datasets:
            return
        raw = self._documents if self._documents is not None else self._source()  # type: ignore[misc]
        train, val = split_corpus(raw, self.shape, self.val_fraction, self.seed, self.max_documents)
        docs = train + val
        self.documents = {"train": train, "val": val}
        loaded = None
        if self.cache_dir is not None:
            parts = {"source": fingerprint(docs, self.shape), "tokenizer": cache.tokenizer_fingerprint(self.tokenizer),
                     "seq_len": self.seq_len, "shape": self.shape, "val_fraction": self.val_fraction, "seed": self.seed,
                     "chat_template": self.use_chat_template}
            self.cache_file = cache.cache_path(self.cache_dir, parts)
            loaded = cache.load(self.cache_file)
        self.cache_hit = loaded is not None
        if loaded is not None:
            tensors, self._stats = loaded
            log.info("Loaded tokenized data from cache %s", self.cache_file)
        else:
            tensors, self._stats = {}, {}
            for split, part in (("train", train), ("val", val)):
                if part:
                    t, s = self._encode_split(part, split)
                    tensors.update(t)
                    self._stats[split] = s
            if self.cache_file is not None:
                cache.save(self.cache_file, tensors, self._stats)
                log.info("Wrote tokenized data cache %s", self.cache_file)
        for split, st in self._stats.items():  # instruction examples dropped or truncated (counts in stats())
            dropped, truncated, n = st.get("dropped", 0), st.get("truncated", 0), st.get("documents", 0)
            if dropped:
                log.warning("data: %d of %d %s examples are left out: the prompt alone fills seq_len=%d tokens (or "
                            "there is no answer), so no answer token would be trained. Raise data.seq_len (the model "
                            "takes up to %s positions) or shorten those prompts.", dropped, n, split, self.seq_len,
                            self.max_seq_len if self.max_seq_len is not None else "max_position_embeddings")
            if truncated:
                log.warning("data: %d of %d %s examples are cut at seq_len=%d tokens (the end of their answer is not "
                            "trained); raise data.seq_len to keep them whole.", truncated, n, split, self.seq_len)
        for split in ("train", "val"):
            if self.shape == "text" and f"{split}.rows" in tensors:
                self.datasets[split] = PackedDataset(tensors[f"{split}.rows"])
            elif f"{split}.ids" in tensors:
                self.datasets[split] = InstructionDataset(tensors[f"{split}.ids"], tensors[f"{split}.trained"],
                                                          tensors[f"{split}.offsets"])

    def prepare_data(self) -> None:
        """Build (and write the cache, if ``cache_dir`` is set)."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Build, or load from the cache."""
        self._build()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per split (``"train"``, ``"val"``): ``documents``, ``tokens`` (encoded, incl. BOS/EOS and prompts),
        ``sequences``, and ``tail_tokens_dropped`` (text) or ``trained_tokens``/``truncated``/``dropped``
        (instruction)."""
        self._build()
        return {k: dict(v) for k, v in self._stats.items()}

    def _loader_kwargs(self) -> dict:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos_id(self.tokenizer)
        return {"batch_size": self.batch_size, "collate_fn": PadCollate(pad), "num_workers": self.num_workers,
                "persistent_workers": self.num_workers > 0, "pin_memory": self.pin_memory}

    def train_dataloader(self) -> ResumableDataLoader:
        """Shuffled (seeded per epoch), resumable mid-epoch through its ``state_dict``/``load_state_dict``."""
        self._build()
        return ResumableDataLoader(self.datasets["train"], shuffle=True, seed=self.seed, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader | list:
        """Validation rows in order; ``[]`` when ``val_fraction`` is 0."""
        self._build()
        if "val" not in self.datasets:
            return []
        return DataLoader(self.datasets["val"], shuffle=False, **self._loader_kwargs())

    def probe_items(self) -> list[dict]:
        """Items of this module's probe from the validation documents (``probe_options`` for the builder)."""
        if self.probe is None:
            raise ValueError("This data module has no probe (probe=None).")
        self._build()
        builder = PROBES[self.probe][0]
        opts = {k: v for k, v in self.probe_options.items() if k in _BUILDER_OPTIONS[self.probe]}
        return builder(self.documents["val"], max_items=self.probe_options.get("max_items", 64), seed=self.seed, **opts)

    def run_probe(self, model: torch.nn.Module, device: Any = None) -> dict[str, float]:
        """Run the domain probe on ``model`` over :meth:`probe_items` (keys: :mod:`~megatrain_lightning.data.probes`).
        ``device`` ``None``: the attached Trainer's ``strategy.root_device`` (a streamed model's parameters live on
        the host), else the model's parameter device."""
        items = self.probe_items()
        if device is None and getattr(self, "trainer", None) is not None:
            device = self.trainer.strategy.root_device
        fn = PROBES[self.probe][1]  # type: ignore[index]
        opts = {k: v for k, v in self.probe_options.items() if k not in _BUILDER_OPTIONS[self.probe] and k != "max_items"}
        if self.probe == "biomedical":
            opts.setdefault("use_chat_template", self.use_chat_template)
        return fn(model, self.tokenizer, items, device, None, **opts)

