"""Code offline: the Python standard library of the running interpreter (PSF license), test modules excluded."""

from __future__ import annotations

import sysconfig
from pathlib import Path

_SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Non-test ``.py`` files under the stdlib directory (``sysconfig.get_paths()["stdlib"]``), sorted by path.

    Skipped: any file under a ``test``/``tests``/``idle_test``/``__pycache__``/``site-packages`` directory
    and any ``test_*.py``. About 730 files, 12 MB on CPython 3.11.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_"))


def code_texts(max_files: int | None = None, root: str | Path | None = None) -> list[dict]:
    """Python source documents of the text shape, one per stdlib module.

    Args:
        max_files: read at most this many files (the first in path order); ``None`` reads all.
        root: another directory of ``.py`` files instead of the stdlib.

    Returns:
        ``[{"id": "<relative path>", "text": <source>, "group": <top-level package or module>}]``; the group
        keeps every file of one package on the same side of the train/validation split. Files that are
        not valid UTF-8 are decoded with replacement characters (the stdlib has none).

    Raises:
        FileNotFoundError: no ``.py`` file under the directory.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    if not files:
        raise FileNotFoundError(f"No .py files under {base}; pass root= a directory of Python sources.")
    docs = []
    for p in files[:max_files]:
        rel = p.relative_to(base)
        text = p.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            docs.append({"id": rel.as_posix(), "text": text, "group": "code/" + rel.parts[0].removesuffix(".py")})
    return docs
