"""Where a directory checkpoint may be written: the local filesystem.

Plain Lightning writes its one-file checkpoints through fsspec (``s3://``, ``memory://``...). A directory
checkpoint is moved into place with an atomic rename, which only a local (POSIX) filesystem offers, and a URL
taken as a path would silently make a local folder (``memory://x``: ``./memory:/x``). :func:`local_path` turns
``file://`` and ``local://`` URLs into paths and refuses other protocols.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec

from .errors import CheckpointError


_LOCAL = ("file", "local")  # fsspec's two names of its LocalFileSystem


def is_local(path: Any) -> bool:
    """``path`` (a path or URL) is on the local filesystem: no protocol, ``file://`` or ``local://``."""
    return fsspec.utils.get_protocol(str(path)) in _LOCAL


def local_path(path: Any) -> Path:
    """The local path of a checkpoint location (``file://`` or ``local://`` stripped).

    Raises:
        CheckpointError: ``path`` is a URL of another filesystem.
    """
    if not is_local(path):
        raise CheckpointError(
            f"megatrain: {path} is on a remote filesystem ({fsspec.utils.get_protocol(str(path))}://); directory "
            "checkpoints of strategy='megatrain' are written to a local disk (an atomic rename puts each one in "
            "place). Save to a local path (ModelCheckpoint(dirpath=...), Trainer(default_root_dir=...)) and copy "
            "the directory to remote storage afterwards.")
    s = str(path)
    for protocol in _LOCAL:
        if s.startswith(protocol + "://"):
            return Path(s[len(protocol) + 3:])
    return Path(s)
