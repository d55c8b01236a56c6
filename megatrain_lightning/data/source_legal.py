"""Legal text offline: the license texts of PyPI ``spdx==2.5.1`` (CC0), Debian's common licenses as fallback/extra."""

from __future__ import annotations

import logging
from pathlib import Path

from .package_files import package_dir

log = logging.getLogger(__name__)

SPDX_PIP = "spdx==2.5.1"
DEBIAN_LICENSES = Path("/usr/share/common-licenses")


def _license_family(name: str) -> str:
    """Split group of a license: its name up to the first ``-`` (``GPL-2.0+`` -> ``GPL``, ``CC-BY-SA-4.0`` -> ``CC``),
    so near-identical versions and variants never sit on both sides of the train/validation split."""
    name = name.removeprefix("deprecated_")
    return name.split("-")[0].rstrip("+").upper()


def spdx_texts() -> list[dict]:
    """The license texts of the installed ``spdx`` package: ``[{"id": "spdx/<ID>", "text", "group"}]``.

    338 documents (``spdx/data/*.txt`` without its README), about 3.6 MB, sorted by file name.

    Raises:
        ModuleNotFoundError: ``spdx`` is not installed (``pip install spdx==2.5.1``).
    """
    data = package_dir("spdx", SPDX_PIP) / "data"
    return _license_docs((f for f in sorted(data.glob("*.txt")) if f.stem.upper() != "README"), "spdx", lambda f: f.stem)


def debian_texts(directory: Path = DEBIAN_LICENSES) -> list[dict]:
    """Debian's ``/usr/share/common-licenses/*`` (package ``base-files``; symlinks skipped): ``[{"id": "debian/<name>", ...}]``.

    Returns an empty list when the directory does not exist (non-Debian systems).
    """
    if not directory.is_dir():
        return []
    files = (f for f in sorted(directory.iterdir()) if f.is_file() and not f.is_symlink())
    return _license_docs(files, "debian", lambda f: f.name)


def _license_docs(files, prefix: str, name) -> list[dict]:
    """``{"id": "<prefix>/<name>", "text", "group": "license/<family>"}`` for each non-empty file."""
    docs = []
    for f in files:
        raw = f.read_bytes()
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:  # the few older files (``OSL-2.1.txt``) that are not UTF-8
            text = raw.decode("latin-1").strip()
        if text:
            docs.append({"id": f"{prefix}/{name(f)}", "text": text, "group": "license/" + _license_family(name(f))})
    return docs


def legal_texts(include_debian: bool = False) -> list[dict]:
    """Legal documents of the text shape: the SPDX license texts, optionally plus Debian's common licenses.

    Args:
        include_debian: also add ``/usr/share/common-licenses`` (mostly the same licenses as SPDX in
            another layout; off by default so the corpus is the same on every machine and no near
            duplicate crosses the split). When ``spdx`` is not installed, Debian's texts are used
            instead (with a warning) if present.

    Returns:
        ``[{"id": str, "text": str, "group": str}]``, groups are license families.

    Raises:
        ModuleNotFoundError: ``spdx`` is missing and no Debian license directory exists.
    """
    try:
        docs = spdx_texts()
    except ModuleNotFoundError:
        fallback = debian_texts()
        if not fallback:
            raise
        log.warning("spdx is not installed (pip install %s); using %d Debian license texts from %s instead.",
                    SPDX_PIP, len(fallback), DEBIAN_LICENSES)
        return fallback
    return docs + debian_texts() if include_debian else docs
