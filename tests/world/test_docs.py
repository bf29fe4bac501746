"""Every python block in docs/ runs: pytest files (``# test_*.py``) under the plugin, the rest as scripts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _doc_files import ENV, Session, run_files

DOCS = Path(__file__).resolve().parents[2] / "docs"
# Pages whose blocks their own tests run.
OWN_TESTS = frozenset({"GPU.md"})
# A block that only sketches a program names the example that runs it instead.
SKETCH = re.compile(r"# sketch: .*?(examples/\w+\.py)")


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name in OWN_TESTS:
            continue
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            found.append((page.name, i, block))
    return found


def test_docs_have_python_blocks_and_few_sketches() -> None:
    blocks = _blocks()
    assert {"views.md", "testing.md", "nodes.md"} <= {page for page, _, _ in blocks}
    sketches = [SKETCH.match(block) for _, _, block in blocks if block.startswith("# sketch:")]
    assert len(sketches) <= 1, "a sketch is the exception: make the block run instead"
    for sketch in sketches:
        assert sketch is not None, "a sketch names the example that runs it"
        assert (DOCS.parent / sketch.group(1)).is_file(), sketch.group(1)


def _file_name(page: str, index: int, block: str) -> str | None:
    """The name a pytest block runs under: its own, made unique by its page and place."""
    name = re.match(r"# test_(\w+)\.py", block)
    return None if name is None else f"test_{Path(page).stem}_{index}_{name.group(1)}.py"


@pytest.fixture(scope="module")
def doc_session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    """Every pytest block of docs/, run once, together, under the plugin."""
    files = {}
    for page, index, block in _blocks():
        name = _file_name(page, index, block)
        if name is not None:
            files[name] = block
    return run_files(files, tmp_path_factory.mktemp("docs"))


@pytest.mark.launch
@pytest.mark.parametrize(("page", "index", "block"), _blocks(), ids=lambda v: str(v)[:20])
def test_docs_block_runs(
    page: str, index: int, block: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if block.startswith("# sketch:"):
        return  # checked above: it names an example that tests/world/test_examples.py runs
    name = _file_name(page, index, block)
    if name is not None:
        request.getfixturevalue("doc_session").check(name)
        return
    (tmp_path / "block.py").write_text(block)
    run = subprocess.run(
        [sys.executable, "block.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert run.returncode == 0, f"{page} block {index}:\n{run.stdout}{run.stderr}"


@pytest.mark.parametrize(
    "page", ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]
)
def test_relative_links_resolve(page: str) -> None:
    path = DOCS.parent / page
    targets = re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, f"{page} links to {missing}"
