"""Dependencies run one way (docs/architecture.md, "Engine layout"): blocks < store < optim < engine <
checkpoint, precision < strategy < the tools built on it. Each import of the package (lazy ones inside
functions included) is checked against that order; engine files stay small, and no docstring cites a
document outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

import megatrain_lightning

PKG = Path(megatrain_lightning.__file__).parent
LAYER = {"blocks": 0, "store": 1, "optim": 2, "engine": 3, "checkpoint": 4, "precision": 4, "strategy": 5,
         "strategy_base": 5, "fabric": 5,
         "parallel": 5, "recipes_lib": 6, "export": 6, "plan": 6, "planning": 6, "data": 6, "testing": 7}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if parts[0] == "megatrain_lightning" and len(parts) > 1 else None


def _imports(path: Path, root: Path = PKG.parent) -> list[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved; an ``__init__.py``
    is its own package)."""
    pkg = list(path.relative_to(root).parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = pkg[: len(pkg) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def test_no_import_climbs_a_layer():
    upward = []
    for f in sorted(PKG.rglob("*.py")):
        module = ".".join(f.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        me = _layer(module)
        if me is None:
            continue
        for target in _imports(f):
            lt = _layer(target)
            if lt is not None and lt > me:
                upward.append(f"{module} imports {target}")
                break
    assert not upward, upward


def test_docs_stay_in_the_repo():
    cites = [str(f) for f in PKG.rglob("*.py") if "DESIGN.md" in f.read_text()]
    assert not cites, cites


def test_the_check_sees_an_upward_import(tmp_path):
    """The scan itself: a lazy ``from ..engine...`` inside a store function is found."""
    src = tmp_path / "megatrain_lightning" / "store"
    src.mkdir(parents=True)
    f = src / "x.py"
    f.write_text("def g():\n    from ..engine.streaming import StreamingEngine\n")
    found = _imports(f, root=tmp_path)
    assert "megatrain_lightning.engine.streaming" in found
    assert _layer("megatrain_lightning.engine.streaming") > _layer("megatrain_lightning.store.x")
