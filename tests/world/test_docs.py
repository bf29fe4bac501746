"""Every python block in docs/ runs: pytest files (``# test_*.py``) under the plugin, the rest as scripts."""

from __future__ import annotations

import re
import shlex
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
# A block that quotes an example (verbatim lines of it) names it; the example's own test runs it.
EXCERPT = re.compile(r"# from (examples/\w+\.py) \(run .* by (tests/[\w/]+\.py)\)\n")


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
    if EXCERPT.match(block):
        return  # checked (unmarked) by test_excerpts_are_verbatim_lines_of_their_example
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


def _excerpts() -> list[tuple[str, int, str]]:
    return [(p, i, b) for p, i, b in _blocks() if EXCERPT.match(b)]


@pytest.mark.parametrize(("page", "index", "block"), _excerpts(), ids=lambda v: str(v)[:20])
def test_excerpts_are_verbatim_lines_of_their_example(page: str, index: int, block: str) -> None:
    """A quoted block is a run of the example's lines (one indentation removed), it
    compiles, and the test it names exists and runs that example."""
    found = EXCERPT.match(block)
    assert found is not None
    example, test = (DOCS.parent / found[1]), DOCS.parent / found[2]
    body = block[found.end() :].splitlines()
    source = example.read_text().splitlines()
    compile("\n".join(body), f"{page} block {index}", "exec")
    indents = {line[: len(line) - len(line.lstrip())] for line in source}
    starts = [
        (start, indent)
        for start in range(len(source) - len(body) + 1)
        for indent in indents
        if source[start] == indent + body[0]
    ]
    assert any(
        all(source[start + k] == (indent + line if line else "") for k, line in enumerate(body))
        for start, indent in starts
    ), f"{page} block {index} is not a run of lines of {found[1]}"
    # The test runs the example itself, or an example that runs it.
    named = set(re.findall(r"(\w+)\.py", test.read_text()))
    examples = [DOCS.parent / "examples" / f"{name}.py" for name in named]
    assert example.stem in named or any(
        e.exists() and example.name in e.read_text() for e in examples
    ), f"{found[2]} does not run {found[1]}"


def _anchors(path: Path) -> set[str]:
    """The anchors a page offers: its headings' GitHub slugs, and ``<a id="...">``."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    slugs = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return slugs


@pytest.mark.parametrize(
    "page", ["README.md", *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))]
)
def test_links_to_a_section_find_it(page: str) -> None:
    path = DOCS.parent / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", text):
        linked = (path.parent / target) if target else path
        if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page} links to sections that are not there: {broken}"


def test_examples_page_lists_every_example() -> None:
    listed = set(re.findall(r"`examples/(\w+\.py)`", (DOCS / "examples.md").read_text()))
    present = {p.name for p in (DOCS.parent / "examples").glob("*.py")}
    assert present - listed == set(), f"docs/examples.md lacks {sorted(present - listed)}"
    assert listed - present == set(), f"docs/examples.md lists missing {sorted(listed - present)}"


def _quickstart_commands() -> list[str]:
    page = (DOCS / "replicas-quickstart.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", page, re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(".venv/bin/scopedmesh replicas")]


def test_the_quickstart_shows_the_launcher_on_one_host_and_on_several() -> None:
    from scopedmesh.launch.cli import parse

    commands = [shlex.split(c)[2:] for c in _quickstart_commands()]
    assert len(commands) == 3, commands
    first, *hosts = (
        parse([a.replace("examples/", f"{DOCS.parent}/examples/") for a in c]) for c in commands
    )
    assert first.job_store is None and first.host_replicas == (0, 1, 2)
    assert [h.host_job_store for h in hosts] == [True, False]
    assert hosts[0].job_store == hosts[1].job_store is not None
    assert set(hosts[0].host_replicas) | set(hosts[1].host_replicas) == set(
        range(hosts[0].replicas)
    )


@pytest.mark.launch
def test_the_quickstart_job_runs_verbatim() -> None:
    """The quickstart's one-host command (replicas_loop.py under the launcher), as written
    (the console script beside this interpreter), from the repository root: 44 s on 2
    cores shared with other jobs (load 15); 10 interpreters import torch."""
    (command,) = [c for c in _quickstart_commands() if "--job-store" not in c]
    argv = shlex.split(command)
    argv[0] = str(Path(sys.executable).parent / "scopedmesh")
    run = subprocess.run(
        argv, cwd=DOCS.parent, capture_output=True, text=True, timeout=300, env=ENV
    )
    assert run.returncode == 0, f"{command}\n{run.stdout}{run.stderr}"
    digests: dict[str, set[str]] = {}
    for coordinate, digest in re.findall(
        r"coordinate (\d+) pid \d+ done: .* digest (\w+)", run.stdout
    ):
        digests.setdefault(coordinate, set()).add(digest)
    assert len(re.findall(r"done: 20 steps", run.stdout)) == 6, run.stdout
    assert all(len(d) == 1 for d in digests.values()) and len(digests) == 2, digests
