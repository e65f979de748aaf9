"""Plots and markdown tables of side-by-side benchmark runs: the JSON that peers.py --json writes.

    python tools/benchmarks/plot.py docs/data/h100-2026-11-26.json [more.json ...]   # PNGs into docs/img/
    python tools/benchmarks/plot.py docs/data/*.json --markdown                      # also print the tables

For each file, one PNG (``<out-dir>/<file name>.png``) with a panel per measure the file holds:
forward+backward as a ratio to the cuBLAS 3-GEMM floor, forward only as a ratio to one cuBLAS GEMM,
and MiB above the gradients; one group of bars per shape, one bar per implementation (its range over
rounds as an error bar where the file has one); a call that failed is marked where its bar would be.
Under the panels: GPU, date, versions, flce's revision and the command that made the numbers.

A file is one process's run: ``{"gpu", "date", "versions": {package: version}, "command", "rows"}``
and optionally ``dtype``, ``call`` (what was timed), ``memory`` (what the MiB count, if not "MiB above
the gradients"), ``flce`` (its revision), ``inputs``, ``source`` (where transcribed numbers were
published), ``clocks`` (peers.py's clock summary, or a list of them, one per process, where a file merges
several runs) and ``notes``. Each row is peers.py's summary of one
implementation at one shape: ``shape``, ``method`` and any of ``ratio``, ``ratio_range``,
``peak_mib``, ``error``, ``fwd_ratio``, ``fwd_ratio_range``, ``fwd_peak_mib``, ``fwd_error``.

Needs matplotlib, which flce does not depend on (``pip install matplotlib``); --markdown alone does not.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

FLOOR = "3-GEMM floor"
REQUIRED = ("gpu", "date", "versions", "command", "rows")
# Display names of peers.py's methods (and of the transcribed runs' extra ones); others show as named.
LABELS = {
    "flce": "flce", "flce_64MiB": "flce, 64 MiB", "flce_128MiB": "flce, 128 MiB", "flce_512MiB": "flce, 512 MiB",
    "flce_1GiB": "flce, 1 GiB", "flce_2GiB": "flce, 2 GiB", "flce_accurate": "flce, accurate",
    "quack": "quack scaled-exp", "quack_chunked": "quack chunked",
    "torch_compile": "torch.compile", "torch_eager": "torch eager", "torch_chunked_compile": "torch chunked compile",
    "torch_native_chunked": "torch F.linear_cross_entropy", "liger": "Liger (Triton)", "liger_cute": "Liger CuTe SM90",
    "liger_cute_ce": "Liger CuTe CE", "liger_cute_rl": "Liger CuTe scaled (RL)", "cce": "Cut Cross-Entropy",
    "verl": "verl (Triton)", "areal": "AReaL (Triton)", "trl": "TRL chunked",
}
# One colour per implementation in every plot (tab10's, flce's in greys); others take the rest in turn.
COLOURS = {
    "flce": "#000000", "flce_64MiB": "#7f7f7f", "flce_128MiB": "#a0a0a0", "flce_512MiB": "#7f7f7f",
    "flce_1GiB": "#303030", "flce_2GiB": "#606060", "flce_accurate": "#505050",
    "quack_chunked": "#ff7f0e", "quack": "#2ca02c", "torch_compile": "#d62728",
    "liger_cute": "#9467bd", "liger_cute_rl": "#9467bd", "liger": "#8c564b", "cce": "#e377c2", "verl": "#bcbd22",
    "areal": "#17becf", "trl": "#1f77b4",
}
SPARE_COLOURS = ("#1f77b4", "#17becf", "#bcbd22", "#e377c2")
# (row key, its range key, its error key, panel title, table title)
MEASURES = (
    ("ratio", "ratio_range", "error", "fwd+bwd, x cuBLAS 3-GEMM floor", "fwd+bwd, x floor"),
    ("fwd_ratio", "fwd_ratio_range", "fwd_error", "forward only, x one cuBLAS GEMM", "forward, x 1 GEMM"),
    ("peak_mib", None, "error", "MiB above the gradients", "MiB"),
)


def load_run(path: Path) -> dict:
    """A run file, checked: a missing key or a malformed row is an error naming the file and what."""
    run = json.loads(path.read_text())
    if not isinstance(run, dict):
        raise ValueError(f"{path}: expected an object with {', '.join(REQUIRED)}, got a {type(run).__name__} "
                         "(write it with peers.py --json)")
    missing = [key for key in REQUIRED if key not in run]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    for position, row in enumerate(run["rows"]):
        if not isinstance(row, dict) or not {"shape", "method"} <= row.keys():
            raise ValueError(f"{path}: row {position}: expected an object with shape and method, got {row!r}")
        for key in ("ratio", "fwd_ratio", "peak_mib", "fwd_peak_mib"):
            if key in row and not isinstance(row[key], (int, float)):
                raise ValueError(f"{path}: row {position} ({row['shape']}, {row['method']}): {key}={row[key]!r}, "
                                 "expected a number")
    return run


def shapes_and_methods(run: dict) -> tuple[list[str], list[str]]:
    """Shapes and implementations in the order the run measured them (the floor row is the baseline)."""
    shapes, methods = [], []
    for row in run["rows"]:
        if row["method"] == FLOOR:
            continue
        shapes += [row["shape"]] if row["shape"] not in shapes else []
        methods += [row["method"]] if row["method"] not in methods else []
    return shapes, methods


def measured(run: dict) -> list[tuple]:
    """The measures of MEASURES that at least one implementation's row holds."""
    rows = [row for row in run["rows"] if row["method"] != FLOOR]
    return [m for m in MEASURES if any(m[0] in row or (m[2] in row and m[0] != "peak_mib") for row in rows)]


def footer(run: dict, width: int = 160) -> str:
    """What the numbers are: GPU, date, versions, flce's revision, the command, the source, the GPU's clocks
    over the run where peers.py sampled them; lines of at most ``width`` characters."""
    versions = ", ".join(f"{name} {version}" for name, version in run["versions"].items())
    parts = [f"{run['gpu']}, {run.get('dtype', 'bfloat16')}, {run['date']}; {versions}",
             f"flce: {run.get('flce', 'not recorded')}", f"command: {run['command']}"]
    if "source" in run:
        parts.append(f"source: {run['source']}")
    # A file merged from several processes (one per shape) holds one clock summary per process, in order.
    summaries = run.get("clocks") or []
    for clocks in [summaries] if isinstance(summaries, dict) else summaries:
        parts.append(f"SM clock {clocks['sm_mhz_mean']:.0f} MHz mean ({clocks['sm_mhz_min']:.0f}-"
                     f"{clocks['sm_mhz_max']:.0f}), {clocks['temperature_max_c']:.0f} C at most, slowdowns: "
                     f"{', '.join(clocks['reasons']) or 'none'}{' (HELD BACK)' if clocks['held_back'] else ''}")
    return "\n".join(textwrap.fill(part, width, subsequent_indent="  ") for part in parts)


def plot_run(run: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("tools/benchmarks/plot.py draws with matplotlib, which flce does not install: "
                         "pip install matplotlib (or pass --markdown only)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shapes, methods = shapes_and_methods(run)
    panels = measured(run)
    by_key = {(row["shape"], row["method"]): row for row in run["rows"]}
    colours = {m: COLOURS.get(m, SPARE_COLOURS[i % len(SPARE_COLOURS)]) for i, m in enumerate(methods)}
    width = 0.8 / len(methods)
    inches = max(8.0, 1.0 + 0.42 * len(shapes) * len(methods))
    notes = footer(run, width=int(inches * 17))  # characters of 6.5-point monospace across the figure
    figure, axes = plt.subplots(len(panels), 1, figsize=(inches, 2.9 * len(panels) + 1.2), squeeze=False)
    for axis, (key, range_key, error_key, title, _) in zip(axes[:, 0], panels, strict=True):
        for position, method in enumerate(methods):
            for index, shape in enumerate(shapes):
                row = by_key.get((shape, method), {})
                x = index - 0.4 + width * (position + 0.5)
                draw_bar(axis, x, width, row, key, range_key, error_key, colours[method])
        if key == "peak_mib":
            axis.set_yscale("symlog", linthresh=1.0)
            peaks = [row["peak_mib"] for row in run["rows"] if "peak_mib" in row]
            axis.set_ylim(0, max(peaks, default=1.0) * 4)  # room for the labels above the bars
            title = run.get("memory", title)
        else:
            axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            tops = [row[key] for row in run["rows"] if key in row and row["method"] != FLOOR]
            axis.set_ylim(min(0.8, min(tops, default=1.0) - 0.05), max(tops, default=1.0) * 1.08)
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(shapes)), [shape.replace("x", " x ") for shape in shapes], fontsize=9)
        axis.tick_params(axis="y", labelsize=8)
    handles = [Patch(color=colours[m], label=LABELS.get(m, m)) for m in methods]
    axes[0, 0].legend(handles=handles, ncol=min(4, len(methods)), fontsize=8, loc="lower left",
                      bbox_to_anchor=(0, 1.12))
    figure.text(0.01, 0.005, notes, fontsize=6.5, va="bottom", family="monospace")
    figure.tight_layout(rect=(0, 0.03 + 0.012 * notes.count("\n"), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)


def draw_bar(axis, x: float, width: float, row: dict, key: str, range_key: str | None, error_key: str,
             colour) -> None:
    """One implementation's bar at one shape, its value above it; "fails" where it raised; nothing where
    the run did not measure it."""
    if key in row:
        value = top = row[key]
        axis.bar(x, value, width, color=colour)
        if range_key and range_key in row:
            low, top = row[range_key]
            axis.errorbar(x, value, yerr=[[value - low], [top - value]], color="grey", capsize=2, linewidth=0.8)
        text = mib_text(value) if key == "peak_mib" else ratio_text(value)
        axis.annotate(text, (x, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                      fontsize=6, rotation=90)
    elif error_key in row:
        axis.annotate("fails", (x, 0), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                      fontsize=6, rotation=90, color="firebrick", xycoords=("data", "axes fraction"))


def ratio_text(value: float) -> str:
    """A ratio to three decimals, or as recorded where it has fewer: a transcribed 1.34 stays 1.34, not 1.340."""
    return f"{round(value, 3):g}"


def mib_text(value: float) -> str:
    """MiB whole from 10 up, to a tenth below (a peer that holds almost nothing)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def cell(row: dict | None, key: str, range_key: str | None, error_key: str) -> str:
    if row is None:
        return ""
    if key in row:
        if key == "peak_mib":
            return mib_text(row[key])
        spread = (f" ({ratio_text(row[range_key][0])}-{ratio_text(row[range_key][1])})"
                  if range_key and range_key in row else "")
        return f"{ratio_text(row[key])}x{spread}"
    if error_key in row and key != "peak_mib":
        return row[error_key]
    return row.get("peak_text", "") if key == "peak_mib" else ""


def markdown(run: dict) -> str:
    """The run as markdown: a line saying what it is, then one table per measure (rows: shapes)."""
    shapes, methods = shapes_and_methods(run)
    by_key = {(row["shape"], row["method"]): row for row in run["rows"]}
    lines = [footer(run, width=1 << 20).replace("\n", "; "), ""]
    for key, range_key, error_key, _, title in measured(run):
        lines += [f"| {title} | " + " | ".join(LABELS.get(m, m) for m in methods) + " |",
                  "|---" * (len(methods) + 1) + "|"]
        for shape in shapes:
            cells = [cell(by_key.get((shape, m)), key, range_key, error_key) for m in methods]
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files written by peers.py --json")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/img"), help="where the PNGs go")
    parser.add_argument("--markdown", action="store_true", help="print each run's tables")
    parser.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    args = parser.parse_args()
    for path in args.runs:
        run = load_run(path)
        if not args.no_plots:
            target = args.out_dir / f"{path.stem}.png"
            plot_run(run, target)
            print(f"wrote {target}")
        if args.markdown:
            print(f"\n{path}\n\n{markdown(run)}")


if __name__ == "__main__":
    main()
