"""One owner per piece of state: no module assigns to the attributes of an object of a class defined in another
module of the package (imports running one way: ``tests/test_layering.py``).

The scan reads every module's source (``ast``) and flags an assignment ``x.attr = ...`` (or ``+=``, annotated)
inside a class whose target object is

* a collaborator held by ``self`` (``self.part.attr = ...``) whose class, known from ``self.part = Class(...)`` or
  ``self.part: Class``, is defined in another file, or whose class is not known; or
* a function argument annotated with a class defined in another file of the package.

Objects the package does not own (torch tensors and modules, Lightning's loops, Hugging Face configs) are changed
only in the places listed in ``EXTERNAL``, each with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatrain_lightning"

# (file, target as written): objects of torch, Lightning or transformers that the package changes on purpose
EXTERNAL = {
    ("megatrain_lightning/data/resume_alignment.py", "trainer.fit_loop.max_batches"):
        "Lightning's fit loop: a resumed epoch ends where the uninterrupted run's did, then is restored",
    ("megatrain_lightning/data/resume_alignment.py", "fit_loop._data_fetcher.length"):
        "Lightning's data fetcher: the same shortened epoch, as its loop reads it",
    ("megatrain_lightning/optim/host_adamw.py", "self.optimizer._opt_called"):
        "torch's LR schedulers check this flag; the user's optimizer's own step never runs",
}

TORCH_ATTRS = {"data", "grad", "forward", "requires_grad", "__wrapped__", "training"}


def _classes() -> dict[str, Path]:
    where: dict[str, Path] = {}
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, f)
    return where


def _class_named(expr: ast.AST, where: dict[str, Path]) -> str | None:
    text = ast.unparse(expr).replace("|", " ").replace("[", " ").replace("]", " ")
    for part in text.split():
        name = part.strip("\"'").split(".")[-1]
        if name in where:
            return name
    return None


def foreign_writes() -> list[str]:
    """``"file:line: target [class]"`` for every assignment the module docstring describes."""
    where = _classes()
    hits = set()
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            members: dict[str, str] = {}
            for n in ast.walk(cls):
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Attribute) \
                        and ast.unparse(n.target.value) == "self" and _class_named(n.annotation, where):
                    members[n.target.attr] = _class_named(n.annotation, where)
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _class_named(n.value.func, where):
                    for t in n.targets:
                        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                            members[t.attr] = _class_named(n.value.func, where)
            for fn in (n for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                typed = {a.arg: _class_named(a.annotation, where) for a in fn.args.args + fn.args.kwonlyargs
                         if a.annotation is not None}
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else \
                        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                    for t in targets:
                        for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if not isinstance(tt, ast.Attribute) or tt.attr in TORCH_ATTRS:
                                continue
                            owner = tt.value
                            if isinstance(owner, ast.Attribute) and ast.unparse(owner.value) == "self":
                                kind = members.get(owner.attr, "?")
                            elif isinstance(owner, ast.Name) and owner.id != "self" and typed.get(owner.id):
                                kind = typed[owner.id]
                            elif isinstance(owner, ast.Attribute):
                                kind = "?"
                            else:
                                continue
                            if kind != "?" and where[kind] == f:
                                continue  # the module changes its own objects
                            rel = str(f.relative_to(ROOT))
                            if (rel, ast.unparse(tt)) in EXTERNAL:
                                continue
                            hits.add(f"{rel}:{node.lineno}: {ast.unparse(tt)} [{kind}]")
    return sorted(hits)


def test_no_module_writes_another_modules_objects():
    hits = foreign_writes()
    assert not hits, "assignments to another module's objects (give the owner a method):\n" + "\n".join(hits)

