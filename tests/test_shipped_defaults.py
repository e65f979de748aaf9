"""Every key of every shipped autotune entry (flce/autotune/defaults) does something on the GPU it names: set
to another valid value, it changes what some call of the entry's shape runs there (its record: schedule,
sizes, kernels or launches), for one of a default training call, one with a bias, a per-token (deferred)
call and a forward-only call. A key no path of that GPU reads would be inert: left in the file, it only
misleads whoever reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from flce.autotune.lookup import TunedEntry
from flce.config import LCEConfig
from flce.engine.choice import CallDescription
from flce.engine.plans import PlanRequest

DEFAULTS = Path(__file__).resolve().parent.parent / "flce" / "autotune" / "defaults"
# Another valid value of each knob the shipped files hold.
OTHER = {
    "forward_logits": {"fused": "cublas", "cublas": "fused"},
    "forward_stats": {"fused": "cublas", "cublas": "fused"},
    "grad_gemm_kernel": {"cublas": "warp_specialized", "warp_specialized": "cublas"},
    "grad_schedule": {"token_chunks": "vocab_blocks", "vocab_blocks": "token_chunks"},
    "block_v": {4096: 2048, 2048: 4096},
    "num_warps": {8: 4, 4: 8},
}


def _entries() -> list[dict]:
    found = []
    for path in sorted(DEFAULTS.glob("*.yaml")):
        found += [dict(entry, file=path.name) for entry in yaml.safe_load(path.read_text())["entries"]]
    return found


def _calls(entry: dict) -> list[CallDescription]:
    dtype = getattr(torch, entry["dtype"])
    shapes = dict(n_rows=entry["tokens"], hidden=entry["hidden"], vocab=entry["vocab"], dtype=dtype,
                  rows_aligned=True, variant=entry["variant"])
    training = PlanRequest(training=True)
    return [CallDescription(bias=False, cfg=LCEConfig(), request=training, **shapes),
            CallDescription(bias=True, cfg=LCEConfig(), request=training, **shapes),
            CallDescription(bias=False, cfg=LCEConfig(reduction="none"), request=training, **shapes),
            CallDescription(bias=False, cfg=LCEConfig(), request=PlanRequest(training=False), **shapes)]


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: f"{e['file']}:{e['hidden']}x{e['vocab']}x{e['tokens']}")
def test_every_shipped_key_changes_what_runs(entry: dict) -> None:
    from flce.backends.cuda.choice import choose
    from flce.backends.cuda.hardware import gpu_description

    assert entry["backend"] == "cuda"
    gpu = gpu_description(entry["device"], triton="3.6.0")
    params = entry["params"]

    def records(knobs: dict) -> list:
        tuned = TunedEntry(knobs, entry["logits_save_limit_bytes"], "shipped")
        return [choose(gpu, call, tuned)[0] for call in _calls(entry)]

    shipped = records(params)
    for key, value in params.items():
        other = max(1, value // 2) if key == "tokens_per_chunk" else OTHER[key][value]
        assert records(dict(params, **{key: other})) != shipped, f"{key}={value} changes nothing on {entry['device']}"
