"""Gather tools/distributed/gpu_run.sh's parts: results.json and summary.md into OUT, a short summary printed.

    python tools/distributed/gpu_summary.py PARTS_DIR OUT_DIR

PARTS_DIR holds one folder per part (vocab_parallel, megatron, client_realistic, client) with the JSON
and markdown each script wrote; a part that failed or timed out has none and is reported as missing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PARTS = {
    "vocab_parallel": ("vocab_parallel.json", "vocab_parallel.md"),
    "megatron": ("megatron_client.json", "megatron_client.md"),
    "client_realistic": ("dtensor_client.json", "dtensor_client.md"),
    "client": ("dtensor_client.json", "dtensor_client.md"),
}


def load(parts: Path) -> tuple[dict[str, Any], list[str]]:
    results, sections = {}, []
    for name, (json_name, md_name) in PARTS.items():
        folder = parts / name
        if (folder / json_name).is_file():
            results[name] = json.loads((folder / json_name).read_text())
        md = folder / md_name
        sections.append(f"## {name}\n\n" + (md.read_text() if md.is_file() else "(no result: see run.log)\n"))
    return results, sections


def summary_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    vocab = results.get("vocab_parallel")
    if vocab:
        ok = sum(c["ok"] for c in vocab["checks"])
        lines.append(f"vocab_parallel on {vocab['world_size']} x {vocab['device']}: checks {ok}/{len(vocab['checks'])}")
        for bench in vocab["benchmarks"]:
            cells = []
            for tp, entry in bench["per TP"].items():
                peer = entry.get("megatron")
                peer_text = f", Megatron {max(peer['median ms per rank']):.1f} ms" if peer else ""
                cells.append(f"TP={tp} {entry['flce slowest rank ms']:.1f} ms ({entry['fraction of TP=1']:.3f}x, "
                             f"{max(entry['flce']['peak MiB per rank']):.0f} MiB{peer_text})")
            lines.append(f"  {bench['shape']} {bench['layout']}: " + "; ".join(cells))
    else:
        lines.append("vocab_parallel: missing")
    megatron = results.get("megatron")
    if megatron:
        verdict = megatron["verdicts"]
        loss_ok = verdict["loss within Megatron's bf16 run-to-run spread"]
        grads_ok = verdict["grads within 1.5x of Megatron's bf16 error (CE and RL), every TP"]
        lines.append(f"megatron TP={sorted(megatron['per_tp'])}: loss within bf16 run-to-run spread: {loss_ok}, "
                     f"grads within 1.5x: {grads_ok}")
        for tp, entry in megatron["per_tp"].items():
            steps = entry["loss step"]
            lines.append(f"  TP={tp}: loss step CE {steps['CE megatron']['median_ms']:.1f} / "
                         f"{steps['CE flce']['median_ms']:.1f} ms, RL {steps['RL megatron']['median_ms']:.1f} / "
                         f"{steps['RL flce']['median_ms']:.1f} ms (megatron / flce); train step "
                         f"{entry['training']['megatron']['step_ms_median']:.0f} / "
                         f"{entry['training']['flce']['step_ms_median']:.0f} ms, "
                         f"{entry['training']['megatron']['peak_mib']:.0f} / "
                         f"{entry['training']['flce']['peak_mib']:.0f} MiB")
    else:
        lines.append("megatron: missing")
    for name in ("client", "client_realistic"):
        client = results.get(name)
        if not client:
            lines.append(f"{name}: missing")
            continue
        for r in client["results"]:
            peaks = "" if r["peak_mib_torch"] is None else \
                f", peak {r['peak_mib_torch']:.0f} / {r['peak_mib_flce']:.0f} MiB torch / flce"
            lines.append(f"{name} {r['mode']}: loss diff {r['max_loss_diff']:.1e}, grad err "
                         f"{r['max_grad_rel_error']:.1e}, step {r['step_ms_torch']:.0f} / {r['step_ms_flce']:.0f} ms"
                         f"{peaks}")
    return lines


def main() -> None:
    parts, out = Path(sys.argv[1]), Path(sys.argv[2])
    results, sections = load(parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text("\n".join(sections))
    print("\n".join(["", "==== summary ===="] + summary_lines(results)))


if __name__ == "__main__":
    main()
