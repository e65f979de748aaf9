"""Static SASS of the warp-specialised GEMM, compiled for sm_90a on this machine (no GPU needed).

Counts the opcodes that tell two Triton releases apart on this kernel: local-memory spills (LDL/STL),
moves from vector to uniform registers (R2UR), uniform against vector integer arithmetic, barriers,
wgmma. Run it once under each Triton (e.g. ``PYTHONPATH=<a folder with another triton>``) and compare;
docs/design-notes.md ("An opaque ring position for Triton 3.9") has what it showed.

    python tools/profiling/ws_sass.py                      # every variant, this Triton
    python tools/profiling/ws_sass.py --variants exponentials --ops LDL,STL,R2UR
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton
from ws_kernels import compile_for_hopper

# name -> compile_for_hopper's arguments: the products' GEMM (x @ W.T's operand order) and the statistics
# GEMM keeping nothing, the logits or the exponentials.
VARIANTS = {
    "products": {"a_mmajor": False, "b_kmajor": True},
    "statistics": {"a_mmajor": False, "b_kmajor": True, "row_stats": True},
    "logits": {"a_mmajor": False, "b_kmajor": True, "row_stats": True, "store_tile": True},
    "exponentials": {"a_mmajor": False, "b_kmajor": True, "row_stats": True, "store_exp": True},
}
DEFAULT_OPS = "LDL,STL,R2UR,UIADD3,ULEA,VIADD,IMAD,LEA,BAR,HGMMA"
# `/*0a40*/  @!P0 IADD3.X R4, ...`: the opcode is the first word after the address and an optional predicate.
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def opcode_counts(kernel) -> collections.Counter:
    """Opcode -> static count in the compiled kernel's SASS (Triton's bundled cuobjdump)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return collections.Counter(m.group(1) for m in map(INSTRUCTION.match, sass.splitlines()) if m)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--ops", default=DEFAULT_OPS, help="comma-separated SASS opcodes to count")
    args = parser.parse_args()
    ops = args.ops.split(",")
    print(f"Triton {triton.__version__}, sm_90a, static SASS counts\n")
    print("| variant | " + " | ".join(ops) + " | all |")
    print("|---|" + "---|" * (len(ops) + 1))
    for name in args.variants.split(","):
        counts = opcode_counts(compile_for_hopper(**VARIANTS[name]))
        print(f"| {name} | " + " | ".join(str(counts[op]) for op in ops) + f" | {sum(counts.values())} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
