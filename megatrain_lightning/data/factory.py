"""``make_datamodule``: the Hydra entry (``conf/data/*.yaml``) from a domain name and a source setting, and the
offline sources of the three domains, each a list of documents (see :mod:`megatrain_lightning.data.corpus`):

======================  ==============  =============================================================
function                shape           content
======================  ==============  =============================================================
``legal_texts()``       text            338 SPDX license texts (PyPI ``spdx``), Debian's as fallback
``code_texts()``        text            ~730 non-test stdlib modules of the running interpreter
``biomedical_pairs()``  instruction     76,557 drug (MeSH) and ICD-10-CM question/answer pairs
======================  ==============  =============================================================
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .datamodule import DomainDataModule
from .source_biomedical import biomedical_pairs
from .source_code import code_texts
from .source_legal import legal_texts
from .source_user import USER_OPTIONS, load_user_source

OFFLINE: dict[str, tuple[Callable[..., list[dict]], str]] = {
    "legal": (legal_texts, "text"),
    "code": (code_texts, "text"),
    "biomedical": (biomedical_pairs, "instruction"),
}


def offline_source(domain: str, **options: Any) -> list[dict]:
    """Documents of the offline default source of ``domain`` (``options`` go to its function,
    e.g. ``max_files`` for code, ``kinds`` for biomedical, ``include_debian`` for legal).

    Raises:
        ValueError: unknown domain.
    """
    if domain not in OFFLINE:
        raise ValueError(f"Unknown domain {domain!r}; offline sources exist for {sorted(OFFLINE)}.")
    return OFFLINE[domain][0](**options)


def make_datamodule(
    tokenizer: Any,
    domain: str | None = None,
    source: str = "offline",
    shape: str | None = None,
    max_seq_len: int | None = None,
    source_options: dict | None = None,
    probe: dict | None = None,
    **datamodule_options: Any,
) -> DomainDataModule:
    """A :class:`DomainDataModule` for ``domain`` reading ``source``.

    Args:
        tokenizer: the model's tokenizer.
        domain: ``"legal"``, ``"biomedical"`` or ``"code"``: picks the offline source, the default shape and the
            probe; ``None`` (the generic ``data=text`` / ``data=instruction`` groups): no offline corpus and no
            probe, so ``source`` and ``shape`` are required.
        source: ``"offline"`` (the domain's packaged corpus), or what
            :func:`~megatrain_lightning.data.load_user_source` reads.
        shape: ``"text"`` or ``"instruction"``; ``None``: the domain's (legal/code: text, biomedical: instruction).
        max_seq_len: the model's ``max_position_embeddings`` (``seq_len`` above it is an error).
        source_options: keyword arguments of the offline source function (:func:`offline_source`) or of
            ``load_user_source``.
        probe: ``{"enabled": bool, "max_items": int, ...}`` (``DomainDataModule``'s ``probe_options``);
            ``enabled: false`` or ``None`` turns the domain probe off.
        **datamodule_options: the other arguments of :class:`DomainDataModule`.

    Raises:
        ValueError: unknown domain, a ``source_options`` key the chosen source does not take, or no domain and no
            user source / shape.
    """
    if domain is not None and domain not in OFFLINE:
        raise ValueError(f"Unknown data domain {domain!r}; choose from {sorted(OFFLINE)} or None (your own data).")
    if domain is None and (source in (None, "", "offline") or shape is None):
        raise ValueError("Without a domain, give your data as source= (a file, directory or dataset id) and its "
                         "shape= ('text' or 'instruction').")
    shape = shape or OFFLINE[domain][1]
    opts = dict(source_options or {})
    if source == "offline":
        reader = functools.partial(offline_source, domain, **opts)
    else:
        bad = set(opts) - set(USER_OPTIONS)
        if bad:
            raise ValueError(f"source_options {sorted(bad)} do not apply to a user source; allowed: {list(USER_OPTIONS)}.")
        reader = functools.partial(load_user_source, source, shape, **opts)
    probe_opts = dict(probe or {})
    enabled = probe_opts.pop("enabled", bool(probe)) and domain is not None
    return DomainDataModule(tokenizer, source=reader, shape=shape, max_seq_len=max_seq_len,
                            probe=domain if enabled else None, probe_options=probe_opts, **datamodule_options)
