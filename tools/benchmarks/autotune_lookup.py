"""Micro-benchmark of the autotune lookup that every planner pays per call.

    python tools/benchmarks/autotune_lookup.py [--entries 300] [--calls 200000]

Writes a temporary cache with ``--entries`` entries for this CPU, points FLCE_AUTOTUNE_CACHE at
it, and times ``flce.autotune.tuned_params`` for a hit (nearest bucket), a miss (heuristic) and
under ``override_params`` (the tuner's path). The first call parses the file; the target is
< 20 us per call after it. Exits 1 when a steady-state figure is over ``--limit-us``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=300, help="entries in the temporary cache file")
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timed case")
    parser.add_argument("--limit-us", type=float, default=20.0, help="fail above this many us per call")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "autotune.yaml"
        os.environ["FLCE_AUTOTUNE_CACHE"] = str(path)
        import flce.autotune as autotune
        from flce.autotune.cache import update_file
        from flce.autotune.schema import Entry

        cpu = torch.device("cpu")
        name = autotune.device_name(cpu)
        shapes = [(h, v, t) for h in (2048, 4096, 5120, 8192) for v in (32000, 128256, 151936)
                  for t in (1024, 2048, 4096, 8192, 16384, 32768)]
        entries = [
            Entry(device=name if i % 2 == 0 else f"other device {i}", backend="reference", variant="plain",
                  dtype="bfloat16", hidden=h, vocab=v, tokens=t, params={"tokens_per_chunk": 1024},
                  logits_save_limit_bytes=1 << 30, measured={"ms": 1.0})
            for i, (h, v, t) in enumerate((shapes * (args.entries // len(shapes) + 1))[:args.entries])
        ]
        stored = update_file(path, entries).entries
        autotune.reload()

        def hit() -> object:
            return autotune.tuned_params(cpu, "reference", "plain", torch.bfloat16, 4096, 128256, 8000)

        def miss() -> object:
            return autotune.tuned_params(cpu, "reference", "plain", torch.bfloat16, 1000, 1000, 8000)

        start = time.perf_counter()
        first = hit()
        first_us = (time.perf_counter() - start) * 1e6
        print(f"cache file: {stored} entries; first call (parses the file): {first_us:.0f} us -> {first}")
        worst = 0.0
        for label, fn in (("hit", hit), ("miss", miss)):
            per_call = _per_call_us(fn, args.calls)
            worst = max(worst, per_call)
            print(f"{label:>9}: {per_call:.2f} us per call")
        with autotune.override_params({"tokens_per_chunk": 512}):
            per_call = _per_call_us(hit, args.calls)
        worst = max(worst, per_call)
        print(f"{'override':>9}: {per_call:.2f} us per call")
    print(f"steady state worst: {worst:.2f} us (limit {args.limit_us} us): {'ok' if worst < args.limit_us else 'OVER'}")
    return 0 if worst < args.limit_us else 1


def _per_call_us(fn: object, calls: int) -> float:
    """Median over 5 rounds, so one descheduled round on a busy machine does not decide."""
    fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        rounds.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    return statistics.median(rounds)


if __name__ == "__main__":
    sys.exit(main())
