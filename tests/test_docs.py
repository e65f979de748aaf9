"""The documentation a user reads: every document the code and docs cite exists, every link and anchor
resolves, the option tables name every option, the benchmark data behind the tables and plots loads,
and the docs describe the project rather than how it was built."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from flce.autotune.schema import FORMER_HEADERS
from flce.config import LCEConfig

REPO = Path(__file__).resolve().parents[1]


def _load_plot_tool() -> ModuleType:
    """tools/benchmarks/plot.py, loaded by path (tools/ is not a package; its folder on sys.path would
    expose every benchmark script's name to the whole test session)."""
    spec = importlib.util.spec_from_file_location("flce_tools_plot", REPO / "tools" / "benchmarks" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot = _load_plot_tool()

# A path to a document: under docs/ or tools/ and ending in .md, or a top-level name in capitals + .md.
CITED_DOCUMENT = re.compile(r"(?<![\w./-])((?:docs|tools)/[\w./-]*\.md|[A-Z][A-Z_]+\.md)\b")
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".toml", ".cfg", ".txt", ""}


def tracked_text_files() -> list[Path]:
    """The repository's files as git knows them (tracked and not ignored), text only."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    paths = [REPO / name for name in listed]
    return [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and "data" not in p.relative_to(REPO).parts]


def markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "tools" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(path: Path) -> str:
    """A markdown file without its code blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_cited_document_exists() -> None:
    """Code comments, docstrings, tests, tools and docs cite documents by path (docs/design.md, ...):
    each one is in the repository. The header older autotune cache files carry is recognised, not cited."""
    missing = []
    for path in tracked_text_files():
        text = path.read_text(errors="replace")
        for header in FORMER_HEADERS:
            text = text.replace(header, "")
        for number, line in enumerate(text.splitlines(), 1):
            missing += [f"{path.relative_to(REPO)}:{number}: {name}" for name in CITED_DOCUMENT.findall(line)
                        if not (REPO / name).is_file()]
    assert not missing, "cited documents the repository does not have:\n" + "\n".join(missing)


def test_markdown_links_and_anchors_resolve() -> None:
    broken = []
    for path in markdown_files():
        for target in MARKDOWN_LINK.findall(prose(path)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def option_rows(path: Path) -> set[str]:
    """The option names in the first column of a file's options table (the rows after `| option |`)."""
    text = path.read_text()
    table = text[text.index("| option | default | meaning |"):]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip().strip("`"))
    return set(rows)


@pytest.mark.parametrize("document", ["README.md", "docs/design.md"])
def test_option_tables_name_every_option(document: str) -> None:
    """The options table a user reads has a row for each option a call takes, and for nothing else."""
    options = {field.name for field in dataclasses.fields(LCEConfig)} | {"selected_ids", "token_weights"}
    assert option_rows(REPO / document) == options


def test_benchmark_data_loads() -> None:
    """The published runs (docs/data) say what made them (tests/test_benchmarks_page.py checks that each plot in
    docs/img is drawn from them)."""
    runs = sorted((REPO / "docs" / "data").glob("*.json"))
    assert runs
    for path in runs:
        run = plot.load_run(path)
        assert run["rows"] and run["gpu"] and run["date"], path
        assert plot.markdown(run).count("|") > 0


def test_a_run_file_without_its_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text('[{"shape": "8x8x8", "method": "flce", "ratio": 1.0}]')
    with pytest.raises(ValueError, match="expected an object with gpu, date, versions, command, rows"):
        plot.load_run(path)
    path.write_text('{"gpu": "g", "date": "d", "versions": {}, "rows": []}')
    with pytest.raises(ValueError, match="missing command"):
        plot.load_run(path)
    path.write_text('{"gpu": "g", "date": "d", "versions": {}, "command": "c", "rows": [{"shape": "s", '
                    '"method": "m", "ratio": "1.05x"}]}')
    with pytest.raises(ValueError, match=r"row 0 \(s, m\): ratio='1.05x', expected a number"):
        plot.load_run(path)


def test_the_docs_describe_the_project_not_how_it_was_built() -> None:
    """No narration of the work: the README and docs say what is, with measurements dated, not which
    sitting of work did what."""
    narration = re.compile(r"\bsessions?\b|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
                           r" (?:session|round of work)\b", re.IGNORECASE)
    found = [f"{path.relative_to(REPO)}:{number}" for path in markdown_files()
             for number, line in enumerate(path.read_text().splitlines(), 1) if narration.search(line)]
    assert not found, f"narration in {found}"


def _python_range() -> tuple[str, str]:
    """pyproject's requires-python ">=3.A,<3.B" as ("3.A", "3.(B-1)"): the supported versions, both ends in."""
    text = (REPO / "pyproject.toml").read_text()
    low, high = re.search(r'requires-python\s*=\s*">=(3\.\d+),<3\.(\d+)"', text).groups()
    return low, f"3.{int(high) - 1}"


def test_install_page_and_examples_state_what_a_fresh_machine_needs() -> None:
    """What a newcomer on a laptop needs first, where they read first: the Python range (pyproject's) at the
    top of docs/install.md and in each example's docstring, and OMP_NUM_THREADS=1 for a small shared machine
    in both (the examples ran 6x slower without it there)."""
    low, high = _python_range()
    stated = f"Python {low} to {high}"
    install = (REPO / "docs" / "install.md").read_text()
    first_section = install.split("\n## ", 1)[0]
    assert stated in first_section and "OMP_NUM_THREADS=1" in first_section, first_section
    for example in sorted((REPO / "examples").glob("*.py")):
        docstring = ast.get_docstring(ast.parse(example.read_text())) or ""
        assert stated in docstring and f"OMP_NUM_THREADS=1 python examples/{example.name}" in docstring, example
