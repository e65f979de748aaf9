"""Input checks that need the global picture: target range and (debug mode) cross-rank agreement."""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

from flce.config import LCEConfig, option_names
from flce.distributed import collectives
from flce.errors import InputError
from flce.inputs import FlatInputs

DISTRIBUTED_CHECKS_ENV = "FLCE_DISTRIBUTED_CHECKS"

# Options that are not plain values and so cannot be compared by their repr.
_NOT_COMPARED = ("class_weight", "process_group")


def debug_checks_enabled() -> bool:
    return os.environ.get(DISTRIBUTED_CHECKS_ENV, "0").strip() not in ("", "0")


def check_target_range(target: torch.Tensor, global_vocab: int, ignore_index: int) -> None:
    """Targets are global ids: each must be in [0, global_vocab) or equal ignore_index.

    On the host for CPU tensors; elsewhere a device-side assertion, so no host sync. Not while torch.compile
    traces (reading values would break the graph): the ops a traced call becomes check at run time.
    """
    if target.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = ((target < 0) | (target >= global_vocab)) & (target != ignore_index)
    if target.device.type == "cpu":
        if bool(bad.any()):
            value = int(target[bad][0])
            raise InputError(
                f"target contains {value}, outside the global vocabulary [0, {global_vocab}) and not "
                f"ignore_index={ignore_index}"
            )
    else:
        torch._assert_async(
            ~bad.any(),
            f"target has a value outside the global vocabulary [0, {global_vocab}) that is not "
            f"ignore_index={ignore_index}",
        )


def check_class_weight(cfg: LCEConfig, global_vocab: int) -> None:
    if cfg.class_weight is not None and cfg.class_weight.shape[0] != global_vocab:
        raise InputError(
            f"class_weight: expected the global weight vector of shape [V={global_vocab}] (the same full "
            f"vector on every rank; each rank uses its own slice), got shape {tuple(cfg.class_weight.shape)}"
        )


def check_ranks_agree(flat: FlatInputs, cfg: LCEConfig, needs_grad_hidden: bool, group: Any) -> None:
    """Debug mode: one all_gather of a few integers per call; every rank raises on a mismatch.

    Catches what would otherwise hang NCCL or silently mix data: different token
    counts, hidden sizes, dtypes, targets, options, or a hidden that needs grad on some ranks
    only (its grad all-reduce would then be issued by some ranks only).
    """
    tokens, hidden_size = flat.hidden.shape
    positions = torch.arange(1, flat.target.numel() + 1, device=flat.target.device)
    # int64 overflow wraps identically on every rank, which is all a checksum needs.
    target_checksum = int((flat.target * positions).sum()) if flat.target.numel() else 0
    options = repr(tuple(getattr(cfg, n) for n in option_names() if n not in _NOT_COMPARED))
    fields = {
        "tokens": tokens,
        "hidden size": hidden_size,
        "dtype": zlib.crc32(str(flat.hidden.dtype).encode()),
        "target checksum": target_checksum,
        "options checksum": zlib.crc32(options.encode()),
        "hidden requires grad": int(needs_grad_hidden),
    }
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=flat.hidden.device)
    gathered = collectives.all_gather_small(mine, group).cpu()
    for column, name in enumerate(fields):
        values = gathered[:, column].tolist()
        if len(set(values)) != 1:
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise InputError(
                f"{DISTRIBUTED_CHECKS_ENV}: {name} differs across the ranks of process_group ({listing}); "
                "expected every rank to call with the same tokens, targets and options"
            )
