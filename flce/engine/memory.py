"""Memory figures every backend's planner uses."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GiB = 1 << 30
MiB = 1 << 20


def total_memory_bytes(device: torch.device) -> int:
    """Device memory for accelerators, physical RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "npu":
        return torch.npu.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_logits_save_limit(device: torch.device) -> int:
    """Largest logits (bytes) kept from forward for backward when the cache has no tuned value."""
    return logits_save_limit_for(total_memory_bytes(device))


def logits_save_limit_for(total_memory: int) -> int:
    """max(1 GiB, min(4 GiB, total memory / 8))."""
    return max(GiB, min(4 * GiB, total_memory // 8))


def logits_save_limit(tuned_limit: int | None, memory_budget: int | None, default_limit: int) -> int:
    """Bytes of logits a deferred backward may keep: the autotune cache's limit, bounded by an
    explicit memory_budget; without a tuned limit, the budget itself (the user's statement of what
    the call may use), else the device's default."""
    if memory_budget is None:
        return default_limit if tuned_limit is None else tuned_limit
    return memory_budget if tuned_limit is None else min(tuned_limit, memory_budget)


def call_save_limit(tuned_limit: int | None, memory_budget: int | None, total_memory: int) -> tuple[int, str]:
    """(bytes of logits a deferred backward may keep, where that figure comes from): logits_save_limit with the
    device's default (1/8 of its memory, 1-4 GiB)."""
    limit = logits_save_limit(tuned_limit, memory_budget, logits_save_limit_for(total_memory))
    source = ("the autotune cache's" if tuned_limit is not None else
              "memory_budget" if memory_budget is not None else "1/8 of the device's memory, 1-4 GiB")
    return limit, source


def saved_logits_rows(n_rows: int, tokens_per_chunk: int, logits_row_bytes: int, working_row_bytes: int,
                      save_limit: int) -> int:
    """Rows whose logits the deferred schedule keeps from forward for backward (ChunkPlan.saved_rows).

    All rows when their logits fit ``save_limit`` beside one chunk's temporaries (working_row_bytes
    counts a row's logits and temporaries; the kernels that overwrite logits in place have none).
    Otherwise the most whole leading chunks that fit beside one recomputed chunk's working memory:
    each kept chunk saves backward one GEMM, so a limit too small for all logits still buys speed.
    """
    temporaries = tokens_per_chunk * (working_row_bytes - logits_row_bytes)
    if n_rows * logits_row_bytes + temporaries <= save_limit:
        return n_rows
    chunks = (save_limit - tokens_per_chunk * working_row_bytes) // max(1, tokens_per_chunk * logits_row_bytes)
    return max(0, min(chunks * tokens_per_chunk, n_rows))


def positive_int(value: object) -> int | None:
    """A cached knob that counts something, where it is one: files outlive the versions that wrote them."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def call_budget(memory_budget: int | None, default: int, default_name: str) -> tuple[int, str]:
    """(bytes of working memory a call may use, where that figure comes from): the call's memory_budget, else the
    planner's default."""
    return (memory_budget, "memory_budget") if memory_budget is not None else (default, default_name)


def tuned_chunk_rows(n_rows: int, row_bytes: int, tuned_rows: object, budget: int,
                     budget_rows: Callable[[int, int], int] | None = None) -> int:
    """Rows per token chunk, by the one rule every planner follows: the autotune cache's ``tokens_per_chunk``
    (``tuned_rows``, where it holds a usable one) is used as tuned while its chunk of ``row_bytes`` rows fits
    ``budget`` (the call's memory_budget, or the planner's default: a changed default bounds cached chunks too);
    otherwise the chunks are sized to the budget, by ``budget_rows(n_rows, rows the budget holds)`` where the
    planner has a rule of its own, else as many rows as it holds. At least one row, at most all of them."""
    fits = max(1, budget // max(1, row_bytes))
    tuned = positive_int(tuned_rows)
    if tuned is not None and tuned <= fits:
        return max(1, min(n_rows, tuned))
    return budget_rows(n_rows, fits) if budget_rows is not None else max(1, min(n_rows, fits))
