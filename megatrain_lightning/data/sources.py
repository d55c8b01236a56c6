"""All document sources in one place: the three offline domain defaults and user sources.

Each offline source returns a list of documents (see :mod:`megatrain_lightning.data.corpus`):

======================  ==============  =============================================================
function                shape           content
======================  ==============  =============================================================
``legal_texts()``       text            338 SPDX license texts (PyPI ``spdx``), Debian's as fallback
``code_texts()``        text            ~730 non-test stdlib modules of the running interpreter
``biomedical_pairs()``  instruction     76,557 drug (MeSH) and ICD-10-CM question/answer pairs
======================  ==============  =============================================================
"""

from __future__ import annotations

from typing import Any, Callable

from .source_biomedical import biomedical_pairs
from .source_code import code_texts
from .source_legal import legal_texts
from .source_user import load_user_source

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


__all__ = ["OFFLINE", "biomedical_pairs", "code_texts", "legal_texts", "load_user_source", "offline_source"]
