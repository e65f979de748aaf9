"""docs/benchmarks.md, README's performance table and the plots are what tools/benchmarks/benchmarks_page.py makes of
the committed data: a figure changes only through a new run in docs/data and a re-run of the script. The page
stays short, README stays small, and the script picks the runs it says it picks."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools" / "benchmarks"
RERUN = "run `python tools/benchmarks/benchmarks_page.py` (with matplotlib for the plots) and commit what it writes"


@pytest.fixture(scope="module")
def page():
    """tools/benchmarks/benchmarks_page.py, loaded by path with its sibling plot.py, as when run as a script."""
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location("flce_tools_benchmarks_page", TOOLS / "benchmarks_page.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while the classes are made
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TOOLS))
        sys.modules.pop("flce_tools_benchmarks_page", None)
        sys.modules.pop("plot", None)
    return module


@pytest.fixture(scope="module")
def rendered(page):
    runs = page.load_runs()
    text, tables = page.render(runs, page.TEMPLATE.read_text())
    return runs, text, tables


def test_the_committed_page_is_what_the_committed_data_make(page, rendered) -> None:
    _, text, _ = rendered
    assert page.PAGE.read_text() == text, f"docs/benchmarks.md differs from what docs/data make: {RERUN}"


def test_the_page_is_at_most_250_lines(page) -> None:
    lines = page.PAGE.read_text().count("\n")
    assert lines <= 250, f"docs/benchmarks.md has {lines} lines; the limit is 250 (shorten the template)"


def test_readme_performance_table_is_generated_from_the_same_runs(page, rendered) -> None:
    _, _, tables = rendered
    readme = page.README.read_text()
    assert page.with_readme_table(readme, tables) == readme, f"README's performance table is stale: {RERUN}"


def test_readme_is_small_and_its_performance_section_short() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024, f"README.md is {len(readme.encode())} bytes; the limit is 12 KiB"
    section = re.search(r"^## Performance\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Performance' section"
    lines = ("## Performance\n" + section.group(1)).rstrip("\n").split("\n")
    assert len(lines) <= 15, f"README's performance section has {len(lines)} lines; the limit is 15"
    assert "(docs/benchmarks.md)" in section.group(1)


def test_every_plot_is_drawn_from_the_current_data_and_none_is_orphaned(page, rendered) -> None:
    runs, _, tables = rendered
    drawn = page.plots(runs, tables)
    stale = [path.name for path, run in drawn.items()
             if not path.is_file() or page.plot.png_digest(path) != page.plot.run_digest(run)]
    assert not stale, f"plots not drawn from today's data: {stale}: {RERUN}"
    orphans = sorted(p.name for p in page.IMAGES.glob("*.png") if p not in drawn)
    assert not orphans, f"plots in docs/img that no data in docs/data draw: {orphans}"


def run_file(directory: Path, name: str, gpu: str, date: str, rows: list[dict], committed: str | None = None) -> None:
    run = {"gpu": gpu, "date": date, "versions": {"torch": "2.11.0"}, "flce": "abcdef1", "command": "peers.py",
           "rows": rows}
    if committed:
        run["flce_committed"] = committed
    (directory / name).write_text(json.dumps(run))


def rows_at(shape: str, methods: tuple[str, ...], ratio: float) -> list[dict]:
    return [{"shape": shape, "method": m, "ratio": ratio, "ratio_range": [ratio - 0.01, ratio + 0.01],
             "peak_mib": 100.0, "fwd_ratio": 1.0} for m in methods]


def test_each_shape_takes_the_newest_complete_run(page, tmp_path: Path) -> None:
    """Complete: flce and every peer of COMPLETE at that shape. Newest: date, then flce_committed, then name."""
    complete, shape, other = page.COMPLETE, "8x16x32", "4x16x32"
    run_file(tmp_path, "a.json", "G", "2026-01-01", rows_at(shape, complete, 1.5) + rows_at(other, complete, 1.4))
    run_file(tmp_path, "b.json", "G", "2026-01-02", rows_at(shape, complete, 1.2), committed="2026-01-01T10:00:00Z")
    run_file(tmp_path, "c.json", "G", "2026-01-02", rows_at(shape, complete, 1.1024), committed="2026-01-02T09:00:00Z")
    run_file(tmp_path, "d.json", "G", "2026-01-03", rows_at(shape, ("flce", "torch_compile"), 0.9))  # incomplete
    run_file(tmp_path, "e.json", "H", "2026-01-04", rows_at(shape, complete, 0.8))  # another GPU
    table = page.side_by_side(page.load_runs(tmp_path), "G")
    assert {s: source.name for s, source in table.sources.items()} == {shape: "c.json", other: "a.json"}
    assert page.fwd_bwd_cell(table.row("flce", shape)) == "1.102 (1.092-1.112) / 100"
    with pytest.raises(ValueError, match="no run in docs/data on 'X'"):
        page.side_by_side(page.load_runs(tmp_path), "X")


def test_tables_share_one_order_and_mark_what_did_not_run(page, tmp_path: Path) -> None:
    complete = page.COMPLETE
    failing = [{"shape": "2x8x8", "method": "quack", "error": "fails: ValueError: operand 'v': m == n makes it"}]
    run_file(tmp_path, "g.json", "G", "2026-01-01", rows_at("2x8x8", complete, 1.0) + failing
             + rows_at("16x8x8", complete, 1.0))
    run_file(tmp_path, "h.json", "H", "2026-01-01", rows_at("4x8x8", (*complete, "liger_cute"), 1.0))
    runs = page.load_runs(tmp_path)
    tables = [page.side_by_side(runs, "G"), page.side_by_side(runs, "H")]
    shapes, methods = page.columns(tables)
    assert shapes == ["2x8x8", "4x8x8", "16x8x8"]  # by size, not by name
    assert methods == ["flce", "quack_chunked", "quack", "torch_compile", "liger_cute", "liger", "cce"]
    g, h = (page.side_by_side_block(t, shapes, methods) for t in tables)
    g_row = next(line for line in g if line.startswith("| fwd+bwd | 2x8x8 |"))
    assert "| fails (m == n) |" in g_row and "| not run |" in g_row  # quack raised; liger_cute was not run
    assert next(line for line in h if line.startswith("| fwd+bwd | 2x8x8 |")).count("not run") == len(methods)
    assert g[0] == h[0]  # the same columns on both GPUs


def test_a_placeholder_quotes_its_table_and_one_without_data_is_refused(page, tmp_path: Path) -> None:
    run_file(tmp_path, "g.json", "G", "2026-01-01", rows_at("2x8x8", page.COMPLETE, 1.0624))
    runs = page.load_runs(tmp_path)
    template = "# T\n\n<!-- side-by-side: G -->\n\nflce takes {fwd_bwd flce 2x8x8} in {mib flce 2x8x8} MiB.\n"
    text, _ = page.render(runs, template)
    assert "flce takes 1.062 (1.052-1.072) in 100 MiB." in text
    with pytest.raises(ValueError, match=r"\{fwd_bwd cce 4x8x8\}: G has no ratio of cce at 4x8x8"):
        page.render(runs, template.replace("{mib flce 2x8x8}", "{fwd_bwd cce 4x8x8}"))


def test_a_plot_digest_changes_with_its_data(page) -> None:
    run = {"gpu": "G", "rows": [{"shape": "2x8x8", "method": "flce", "ratio": 1.0}]}
    changed = copy.deepcopy(run)
    changed["rows"][0]["ratio"] = 1.01
    assert page.plot.run_digest(run) != page.plot.run_digest(changed)
    assert page.plot.run_digest(run) == page.plot.run_digest(copy.deepcopy(run))


def test_readme_table_replaces_only_its_block(page, rendered) -> None:
    _, _, tables = rendered
    readme = f"# R\n\n## Performance\n\nintro\n\n{page.README_MARKER}\n| old |\n|---|\n\n## Next\n"
    updated = page.with_readme_table(readme, tables)
    assert "| old |" not in updated and updated.endswith("\n\n## Next\n") and updated.startswith("# R\n\n## Perf")
    assert page.with_readme_table(updated, tables) == updated
    with pytest.raises(ValueError, match="README.md has no line"):
        page.with_readme_table("# R\n", tables)
