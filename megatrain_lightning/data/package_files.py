"""Locate data files inside installed packages without importing them.

Importing a data package can have side effects (``drug_named_entity_recognition`` reads a pickle from
the user's home directory at import), so the offline sources find the package directory with
:func:`importlib.util.find_spec` and read only the files they need.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str, pip_spec: str) -> Path:
    """Directory of the installed top-level package ``module``.

    Raises:
        ModuleNotFoundError: the package is not installed; the message gives ``pip install <pip_spec>``.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The offline data source needs the PyPI package {pip_spec.split('==')[0]!r} "
            f"(module {module!r}); install it with `pip install {pip_spec}`.",
            name=module,
        )
    return Path(next(iter(spec.submodule_search_locations)))
