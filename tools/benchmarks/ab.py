"""Two flce checkouts on one GPU, interleaved: this one (B) against a baseline (A) unpacked into an ignored
folder, e.g. main's::

    mkdir -p build/ab/main && git -C <repo> archive main flce | tar -x -C build/ab/main
    python tools/benchmarks/ab.py --baseline build/ab/main [--rounds 5] [--json out.json] [--markdown out.md]

Each round runs one process per checkout (A then B, B then A in the next round, so a drift of the GPU's
clocks falls on both), importing flce from that checkout alone; the process times every call of every shape
(``triton.testing.do_bench``: median ms, L2 emptied before each call), the host's part of it (the median
time for one call to return with the GPU synchronised before it: every launch and Python step) and its peak
memory above the gradients. The table gives, per shape and call, the median over rounds of each and B's time over A's.
Calls: the default training call (loss, fwd+bwd), the loss without gradient, RL (log-probs and entropy at
T = 0.7, reduction="none", gradients through both), forward-only RL (no gradient) and the default call at a
64 MiB budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = "8192x4096x128256,16384x2048x151936,4096x4096x32000"
CALLS = ("default", "no-grad", "rl", "rl-no-grad", "64MiB")
HOST_REPEATS = 20


def worker(shapes: str) -> dict:
    """Times every call of every shape with the flce on sys.path; one JSON object on stdout."""
    import torch

    import flce
    from flce.testing import measure
    from flce.testing.measure import median_ms, parse_shape, peak_mib_above, shape_inputs

    # A checkout whose flce predates measure.host_ms gets no host column.
    host_ms = getattr(measure, "host_ms", None)

    results = {"flce": str(Path(flce.__file__).resolve().parent), "gpu": torch.cuda.get_device_name()}
    rl = {"reduction": "none", "temperature": 0.7, "return_logprobs": True, "return_entropy": True}
    for label in shapes.split(","):
        x, w, t, _ = shape_inputs(*parse_shape(label))

        def steps(x=x, w=w, t=t) -> dict:
            def default() -> object:
                return torch.autograd.grad(flce.linear_cross_entropy(x, w, t), (x, w))

            def no_grad() -> object:
                with torch.no_grad():
                    return flce.linear_cross_entropy(x, w, t)

            def rl_step() -> object:
                out = flce.linear_cross_entropy(x, w, t, **rl)
                return torch.autograd.grad(out.logprobs.sum() + 0.01 * out.entropy.sum(), (x, w))

            def rl_no_grad() -> object:
                with torch.no_grad():
                    return flce.linear_cross_entropy(x, w, t, **rl)

            def budget() -> object:
                return torch.autograd.grad(flce.linear_cross_entropy(x, w, t, memory_budget=64 << 20), (x, w))

            return dict(zip(CALLS, (default, no_grad, rl_step, rl_no_grad, budget), strict=True))

        for name, step in steps().items():
            step()  # compiles
            results[f"{label} {name}"] = {"ms": median_ms(step, warmup_ms=100, rep_ms=600),
                                          "host_ms": host_ms(step, repeats=HOST_REPEATS) if host_ms else None,
                                          "peak_mib": peak_mib_above(step)}
        del x, w, t
        torch.cuda.empty_cache()
    return results


def _median_text(values: list[float | None]) -> str:
    """The median of a checkout's per-round figures, or "-" where its flce did not measure them."""
    return "-" if None in values else f"{statistics.median(values):.3f}"


def run_one(root: Path, shapes: str) -> dict:
    # The checkout first; a caller's PYTHONPATH (e.g. another Triton) after it.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    script = str(Path(__file__).resolve())
    done = subprocess.run([sys.executable, script, "--worker", "--shapes", shapes], env=env, cwd=root,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{root}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="the other checkout's root (holds flce/)")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.shapes)))
        return
    if not args.baseline or not (Path(args.baseline) / "flce" / "__init__.py").exists():
        parser.error(f"--baseline {args.baseline!r}: expected a checkout root holding flce/__init__.py")
    roots = {"A": Path(args.baseline).resolve(), "B": REPO}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    # The clocks are sampled here, around both checkouts' workers (B's flce: A's may predate the sampler).
    import torch

    from flce.testing.clocks import ClockSampler

    with ClockSampler(torch.device("cuda")) as clocks:
        for round_index in range(args.rounds):
            for side in ("A", "B") if round_index % 2 == 0 else ("B", "A"):
                runs[side].append(run_one(roots[side], args.shapes))
                print(f"round {round_index + 1}/{args.rounds} {side} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["A"][0] if k not in ("flce", "gpu")]
    lines = [f"A: {runs['A'][0]['flce']}, B: {runs['B'][0]['flce']}, {runs['A'][0]['gpu']}, {args.rounds} rounds "
             "(median over rounds; each round's figure a do_bench median)", "",
             "| shape call | A ms | B ms | B / A | per-round B / A | A host ms | B host ms | A MiB | B MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for key in keys:
        a = [r[key]["ms"] for r in runs["A"]]
        b = [r[key]["ms"] for r in runs["B"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        summary[key] = {"a_ms": a, "b_ms": b, "a_host_ms": [r[key].get("host_ms") for r in runs["A"]],
                        "b_host_ms": [r[key].get("host_ms") for r in runs["B"]], "a_mib": runs["A"][0][key]["peak_mib"],
                        "b_mib": runs["B"][0][key]["peak_mib"]}
        lines.append(f"| {key} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
                     f"{statistics.median(b) / statistics.median(a):.3f} | "
                     f"{' '.join(f'{r:.3f}' for r in ratios)} | {_median_text(summary[key]['a_host_ms'])} | "
                     f"{_median_text(summary[key]['b_host_ms'])} | {summary[key]['a_mib']:.0f} | "
                     f"{summary[key]['b_mib']:.0f} |")
    if clocks.summary is not None:
        lines += ["", clocks.summary.describe() + "."]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary,
                                               "clocks": asdict(clocks.summary) if clocks.summary else None},
                                              indent=1))


if __name__ == "__main__":
    main()
