"""The documentation: the site builds, its code runs, the README stays short and the guide is linked.

* ``mkdocs build --strict`` passes (mkdocs.yml; the ``docs`` extra, also in the ``test`` extra).
* Every ```` ```python ```` block of README.md and docs/guide/*.md runs, on a CPU with tiny models. A block
  that needs a CUDA GPU, a network connection, a large download or files of a run made before is marked on
  the line before it with ``<!-- skip: <reason> -->`` and reported as skipped with that reason.
* README.md has at most 220 lines, the two commands and a library example in its first 80 lines, and links
  every guide page; mkdocs.yml's nav lists every guide page.
* No history (sessions, probes, issue numbers) in README.md and docs/.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GUIDE = DOCS / "guide"

SKIP_MARK = re.compile(r"^\s*<!--\s*skip:\s*(.+?)\s*-->\s*$")
FENCE_OPEN = re.compile(r"^(\s*)```python\s*$")
HISTORY = re.compile(r"session [0-9]|probe [a-z]\b|issue [0-9]|fault-finding round|fresh-user probe|found by a probe|"
                     r"user probe|found by trying", re.IGNORECASE)


def python_blocks(path: Path) -> list[tuple[str, int, str, str | None]]:
    """(file, line of the fence, code, skip reason or None) for every ```python block of ``path``."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        start = i
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        skip = SKIP_MARK.match(lines[prev]) if prev >= 0 else None
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        blocks.append((str(path.relative_to(ROOT)), start + 1, "\n".join(body) + "\n",
                       skip.group(1) if skip else None))
    return blocks


def doc_files_with_code() -> list[Path]:
    return [README, *sorted(GUIDE.glob("*.md"))]


ALL_BLOCKS = [b for f in doc_files_with_code() for b in python_blocks(f)]


def guide_pages() -> list[str]:
    return sorted(p.name for p in GUIDE.glob("*.md"))


# --------------------------------------------------------------------------------------------- the site


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install '.[docs]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert (tmp_path / "site" / "reference" / "index.html").is_file()
    assert "lookahead" in (tmp_path / "site" / "reference" / "index.html").read_text()  # the API page rendered


# ------------------------------------------------------------------------------------------ code blocks


def test_blocks_were_found():
    assert len(ALL_BLOCKS) >= 5
    readme_blocks = [b for b in ALL_BLOCKS if b[0] == "README.md"]
    assert readme_blocks and readme_blocks[0][3] is None, "the README's library example must run"


@pytest.mark.parametrize("where,line,code,skip", ALL_BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in ALL_BLOCKS])
def test_python_block_runs(where, line, code, skip, tmp_path, monkeypatch):
    if skip:
        pytest.skip(f"{where}:{line}: {skip}")
    monkeypatch.chdir(tmp_path)  # files a block writes land in a temporary directory
    monkeypatch.setenv("MEGATRAIN_NVME_PATH", str(tmp_path / "nvme"))
    (tmp_path / "nvme").mkdir()
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{where}:{line}", "exec"), namespace)
    finally:
        strategy = getattr(namespace.get("trainer"), "strategy", None)
        if hasattr(strategy, "close"):
            strategy.close()  # an NVMe store removed before tmp_path is


# ----------------------------------------------------------------------------------- README and links


def test_readme_short_with_commands_and_example_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines (at most 220)"
    head = "\n".join(lines[:80])
    assert "```bash\nbash scripts/run_main.sh\n```" in head
    assert "```bash\nbash scripts/test.sh\n```" in head
    assert 'strategy="megatrain"' in head and "```python" in head


@pytest.mark.parametrize("page", guide_pages())
def test_guide_page_linked_from_readme_and_nav(page):
    import yaml

    assert f"docs/guide/{page}" in README.read_text(), f"README.md does not link docs/guide/{page}"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert f"guide/{page}" in str(nav), f"mkdocs.yml nav does not list guide/{page}"
    text = (GUIDE / page).read_text()
    n = len(text.splitlines())
    assert 100 <= n <= 300, f"{page} has {n} lines (100-300)"
    first_block = re.search(r"^```", text, re.MULTILINE)
    first_heading_2 = re.search(r"^## ", text, re.MULTILINE)
    assert first_block and (not first_heading_2 or first_block.start() < first_heading_2.start()), \
        f"{page} does not start with the command or code a user runs"


def test_nav_lists_every_page():
    import yaml

    nav = str(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for page in ("index.md", "compatibility.md", "benchmarks.md", "architecture.md", "internals/index.md",
                 "reference.md"):
        assert page in nav, page


def test_compatibility_names_real_tests():
    text = (DOCS / "compatibility.md").read_text()
    ids = re.findall(r"tests/(test_\w+\.py)::(?:\w+::)?(\w+)", text)
    assert len(ids) >= 20
    for file, name in ids:
        source = (ROOT / "tests" / file).read_text()
        assert re.search(rf"^\s*def {name}\(", source, re.MULTILINE), f"tests/{file}::{name} does not exist"


# --------------------------------------------------------------------------------------------- history


@pytest.mark.parametrize("path", [README, *sorted(DOCS.rglob("*.md")),
                                  *sorted((ROOT / "megatrain_lightning").rglob("*.py")),
                                  *sorted(t for t in (ROOT / "tests").glob("*.py") if t.name != "test_docs.py"),
                                  *sorted((ROOT / "bench").glob("*.py"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history(path):
    hits = [f"{i}: {line}" for i, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits[:10])
