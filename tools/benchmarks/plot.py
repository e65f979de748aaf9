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
the gradients"), ``flce`` (its revision), ``flce_committed`` (when that revision was committed, UTC ISO
8601: it orders the runs of one day), ``inputs``, ``source`` (where transcribed numbers were published),
``clocks`` (peers.py's clock summary, or a list of them, one per process, where a file merges several
runs) and ``notes``. Each row is peers.py's summary of one implementation at one shape: ``shape``,
``method`` and any of ``ratio``, ``ratio_range``, ``best_ratio``, ``peak_mib``, ``error``, ``fwd_ratio``,
``fwd_ratio_range``, ``fwd_peak_mib``, ``fwd_error``. A run drawn from several files (benchmarks_page.py's plot of
a GPU) also says which ``shapes`` and ``methods`` to show, in order, and has a ``caption`` to show under the panels.

Every plot shows the implementations in one order (LABELS') and the shapes by size, marks "fails" where an
implementation raised and "not run" where the run left it out, and carries in its PNG metadata a digest of
the data it was drawn from (``png_digest``), so that a test can tell a plot its data no longer make.

Needs matplotlib, which flce does not depend on (``pip install matplotlib``); --markdown alone does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import textwrap
from pathlib import Path

FLOOR = "3-GEMM floor"
REQUIRED = ("gpu", "date", "versions", "command", "rows")
# Display names of peers.py's methods (and of the transcribed runs' extra ones), in the order every table and
# plot shows them: flce and its budgets, then the peers; others show as named, after these, by name.
LABELS = {
    "flce": "flce", "flce_2GiB": "flce, 2 GiB", "flce_1GiB": "flce, 1 GiB", "flce_512MiB": "flce, 512 MiB",
    "flce_128MiB": "flce, 128 MiB", "flce_64MiB": "flce, 64 MiB", "flce_accurate": "flce, accurate",
    "flce_generic": "flce generic (as an A100)", "flce_generic_exp": "flce generic, Triton exponentials",
    "flce_generic_logits": "flce generic, Triton logits",
    "quack_chunked": "quack chunked", "quack": "quack scaled-exp",
    "torch_compile": "torch.compile", "torch_eager": "torch eager", "torch_chunked_compile": "torch chunked compile",
    "torch_native_chunked": "torch F.linear_cross_entropy", "liger_cute": "Liger CuTe SM90",
    "liger_cute_ce": "Liger CuTe CE", "liger_cute_rl": "Liger CuTe scaled (RL)", "liger": "Liger Triton",
    "cce": "Cut Cross-Entropy", "verl": "verl (Triton)", "areal": "AReaL (Triton)", "trl": "TRL chunked",
}
# What a failure's message is about, for its cell: (a fragment of the message, the reason shown).
FAILURE_REASONS = (("m == n", "m == n"), ("multiple of 256", "V % 256 != 0"))
# One colour per implementation in every plot (tab10's, flce's in greys); others take the rest in turn.
COLOURS = {
    "flce": "#000000", "flce_64MiB": "#7f7f7f", "flce_128MiB": "#a0a0a0", "flce_512MiB": "#7f7f7f",
    "flce_1GiB": "#303030", "flce_2GiB": "#606060", "flce_accurate": "#505050", "flce_generic": "#404080",
    "flce_generic_exp": "#6060a0", "flce_generic_logits": "#8080c0",
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
Y_LABELS = {"ratio": "time / cuBLAS 3-GEMM floor", "fwd_ratio": "time / one cuBLAS GEMM", "peak_mib": "MiB (log)"}
# The ratio panels end here, so that the differences near the floor stay readable; a taller bar is cut off at it,
# its value written at the top with an arrow.
RATIO_CEILING = 1.6
DIGEST_KEY = "flce-data-digest"


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
    if not isinstance(run.get("flce_committed", ""), str):
        raise ValueError(f"{path}: flce_committed={run['flce_committed']!r}, expected an ISO 8601 time as a string")
    return run


def shape_order(shape: str) -> tuple:
    """Shapes by size: tokens, then H, then V (a label that is not NxHxV goes last, by name)."""
    parts = shape.split("x")
    return (0, *map(int, parts)) if all(part.isdigit() for part in parts) else (1, shape)


def method_order(method: str) -> tuple:
    """Implementations in LABELS' order, others after them by name."""
    order = list(LABELS)
    return (order.index(method), "") if method in order else (len(order), method)


def shapes_and_methods(run: dict) -> tuple[list[str], list[str]]:
    """Shapes by size and implementations in LABELS' order (the floor row is the baseline, not a column), or
    those the run names."""
    rows = [row for row in run["rows"] if row["method"] != FLOOR]
    return (run.get("shapes") or sorted({row["shape"] for row in rows}, key=shape_order),
            run.get("methods") or sorted({row["method"] for row in rows}, key=method_order))


def failure_text(error: str) -> str:
    """A failure's cell: "fails (reason)", the reason short (peers.py records the whole message)."""
    if error.startswith("fails ("):
        return error
    for fragment, reason in FAILURE_REASONS:
        if fragment in error:
            return f"fails ({reason})"
    kind = error.removeprefix("fails:").strip().split(":")[0]
    return f"fails ({kind})" if kind else "fails"


def run_digest(run: dict) -> str:
    """What a plot was drawn from, as a short digest of the run's JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()[:16]


def png_digest(path: Path) -> str | None:
    """The digest ``plot_run`` wrote into a PNG's text chunks, None where it has none (read without matplotlib)."""
    data = path.read_bytes()
    position = 8  # after the PNG signature: chunks of length, type, data, CRC
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"tEXt" and body.split(b"\0", 1)[0] == DIGEST_KEY.encode():
            return body.split(b"\0", 1)[1].decode("latin-1")
        position += 12 + length
    return None


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
    """The run's PNG: a panel per measure it holds, a group of bars per shape, a bar per implementation (in
    LABELS' order), "fails" / "not run" where an implementation has no bar; under the panels the run's caption,
    by default what made the numbers (``footer``); the run's digest in the PNG's metadata."""
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
    chars = int(inches * 17)  # characters of 6.5-point monospace across the figure
    notes = "\n".join(textwrap.fill(line, chars, subsequent_indent="  ") for line in run["caption"].splitlines()
                      ) if "caption" in run else footer(run, width=chars)
    figure, axes = plt.subplots(len(panels), 1, figsize=(inches, 2.9 * len(panels) + 1.2), squeeze=False)
    for axis, (key, range_key, error_key, title, _) in zip(axes[:, 0], panels, strict=True):
        label_below = None
        if key == "peak_mib":
            axis.set_yscale("symlog", linthresh=1.0)
            peaks = [row["peak_mib"] for row in run["rows"] if "peak_mib" in row]
            axis.set_ylim(0, max(peaks, default=1.0) * 4)  # room for the labels above the bars
            title = run.get("memory", title)
        else:
            axis.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            tops = [row[key] for row in run["rows"] if key in row and row["method"] != FLOOR]
            bottom, top = min(0.9, min(tops, default=1.0) - 0.05), min(max(tops, default=1.0) * 1.08, RATIO_CEILING)
            axis.set_ylim(bottom, top)
            label_below = top - 0.12 * (top - bottom)  # a label starting above this would not fit: it goes inside
        for position, method in enumerate(methods):
            for index, shape in enumerate(shapes):
                x = index - 0.4 + width * (position + 0.5)
                draw_bar(axis, x, width, by_key.get((shape, method)), key, range_key, error_key, colours[method],
                         label_below)
        axis.set_title(title, fontsize=10)
        axis.set_ylabel(Y_LABELS[key], fontsize=8)
        axis.set_xticks(range(len(shapes)), [shape.replace("x", " x ") for shape in shapes], fontsize=9)
        axis.tick_params(axis="y", labelsize=8)
    handles = [Patch(color=colours[m], label=LABELS.get(m, m)) for m in methods]
    axes[0, 0].legend(handles=handles, ncol=min(5, len(methods)), fontsize=8, loc="lower left",
                      bbox_to_anchor=(0, 1.12))
    figure.text(0.01, 0.005, notes, fontsize=6.5, va="bottom", family="monospace")
    figure.tight_layout(rect=(0, 0.03 + 0.012 * notes.count("\n"), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, metadata={"Software": None, DIGEST_KEY: run_digest(run)})
    plt.close(figure)


def draw_bar(axis, x: float, width: float, row: dict | None, key: str, range_key: str | None, error_key: str,
             colour, label_below: float | None = None) -> None:
    """One implementation's bar at one shape, its value above it, or inside the bar's top where it would start
    above ``label_below`` (with an arrow where the bar passes the panel's top); "fails" where it raised, "not run"
    where the run has no row for it (nothing where a transcribed row lacks this measure)."""
    if row is not None and key in row:
        value = top = row[key]
        axis.bar(x, value, width, color=colour)
        if range_key and range_key in row:
            low, top = row[range_key]
            axis.errorbar(x, value, yerr=[[value - low], [top - value]], color="grey", capsize=2, linewidth=0.8)
        text = mib_text(value) if key == "peak_mib" else ratio_text(value)
        if label_below is not None and top > label_below:
            cut = value > axis.get_ylim()[1]
            axis.annotate(f"{text} \u2191" if cut else text, (x, min(value, axis.get_ylim()[1])), xytext=(0, -2),
                          textcoords="offset points", ha="center", va="top", fontsize=6, rotation=90, color="white")
            return
        axis.annotate(text, (x, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                      fontsize=6, rotation=90)
    elif row is None or error_key in row:
        mark, colour = ("not run", "dimgrey") if row is None else ("fails", "firebrick")
        axis.annotate(mark, (x, 0), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                      fontsize=6, rotation=90, color=colour, xycoords=("data", "axes fraction"))


def ratio_text(value: float) -> str:
    """A ratio to three decimals, or as recorded where it has fewer: a transcribed 1.34 stays 1.34, not 1.340."""
    return f"{value:g}" if round(value, 3) == value else f"{value:.3f}"


def mib_text(value: float) -> str:
    """MiB whole from 10 up, to a tenth below (a peer that holds almost nothing)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def cell(row: dict | None, key: str, range_key: str | None, error_key: str) -> str:
    if row is None:
        return "not run"
    if key in row:
        if key == "peak_mib":
            return mib_text(row[key])
        spread = (f" ({ratio_text(row[range_key][0])}-{ratio_text(row[range_key][1])})"
                  if range_key and range_key in row else "")
        return f"{ratio_text(row[key])}x{spread}"
    if error_key in row and key != "peak_mib":
        return failure_text(row[error_key])
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
