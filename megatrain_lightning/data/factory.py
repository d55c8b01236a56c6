"""``make_datamodule``: the Hydra entry (``conf/data/*.yaml``) from a domain name and a source setting.

The recipe calls ``hydra.utils.instantiate(cfg.data, tokenizer=tok, max_seq_len=model.config.max_position_embeddings)``.
"""

from __future__ import annotations

import functools
from typing import Any

from .datamodule import DomainDataModule
from .sources import OFFLINE, offline_source
from .source_user import USER_OPTIONS, load_user_source


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
        domain: ``"legal"``, ``"biomedical"`` or ``"code"``: picks the offline source, the default shape and the probe;
            ``None`` (the generic ``data=text`` / ``data=instruction`` groups): no offline corpus and no probe, so
            ``source`` must name the user's data and ``shape`` is required.
        source: ``"offline"`` (the domain's packaged corpus), or a local ``.jsonl``/``.json``/``.parquet``/``.txt`` file,
            a directory of them, or a Hugging Face dataset id (see :func:`~megatrain_lightning.data.load_user_source`).
        shape: ``"text"`` or ``"instruction"``; ``None``: the domain's (legal/code: text, biomedical: instruction).
        max_seq_len: the model's ``max_position_embeddings`` (``seq_len`` above it is an error).
        source_options: keyword arguments of the offline source function (e.g. ``{"max_files": 200}`` for code,
            ``{"kinds": ["mesh_category"]}`` for biomedical) or of ``load_user_source`` (``text_field``,
            ``prompt_field``, ``response_field``, ``input_field``, ``messages_field``, ``conversations_field``,
            ``id_field``, ``txt_mode``, ``errors``, ``hf_split``, ``limit``).
        probe: probe settings ``{"enabled": bool, "max_items": int, ...}`` (see ``DomainDataModule.probe_options``);
            ``enabled: false`` or ``None`` turns the domain probe off.
        **datamodule_options: ``seq_len``, ``batch_size``, ``val_fraction``, ``seed``, ``cache_dir``, ``num_workers``,
            ``max_documents``, ``use_chat_template``, ``pin_memory`` of :class:`DomainDataModule`.

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
