"""The reference backend's planner: always TokenChunks, the chunk size from the memory budget (or the
autotune cache), and how many rows a deferred backward keeps the logits of. A pure function of the
device's and the call's descriptions (flce.engine.choice), whose record ``python -m flce explain`` prints."""

from __future__ import annotations

import torch

from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.backends.reference.kernels import CPU_BLOCK_BYTES, ReferenceKernels, math_dtype
from flce.config import LCEConfig
from flce.engine.call import EngineCall, call_record, logits_kept_for_gradients
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription, MemoryPlan, describe_device
from flce.engine.memory import MiB, call_budget, call_save_limit, saved_logits_rows, tuned_chunk_rows
from flce.engine.plans import BATCH_INVARIANT_TOKENS, PlanRequest, TokenChunks
from flce.engine.rows import logits_bytes_per_row
from flce.engine.steps import RowKernelNames, row_kernel_steps
from flce.inputs import FlatInputs

# Without a budget a chunk may use this much: large enough for full-speed CPU GEMMs
# (>= 512 rows at V = 128k in fp32; 2 chunks at 4096 x 32000), small next to the logits it replaces.
DEFAULT_CHUNK_BUDGET = 256 * MiB
# Math-dtype temporaries the kernels hold at once over the rows they work on (the full variant's
# z, probabilities and one product; the plain variant needs at most one, for low-precision logits).
_TEMPORARIES = 3
_KERNELS_CLASS = "flce.backends.reference.kernels.ReferenceKernels."
KERNEL_NAMES = RowKernelNames(**{role: _KERNELS_CLASS + method for role, method in (
    ("plain_loss", "plain_loss"), ("plain_grad", "plain_grad_"), ("row_stats", "row_stats"),
    ("full_grad", "full_grad_"), ("scale", "scale_"), ("bias_sums", "add_column_sums_"),
    ("fp32_product", "accumulate_fp32_"))})


def working_bytes_per_row(device_type: str, vocab: int, dtype: torch.dtype, cfg: LCEConfig) -> int:
    """Working memory per token row of a chunk.

    On the CPU the kernels work in place on the chunk's logits and keep their temporaries to
    cache-sized row blocks (at most ``_TEMPORARIES * CPU_BLOCK_BYTES``, a fixed 24 MiB whatever the
    shape), so a row costs its logits alone. On other devices a block is the whole chunk: each
    row also carries the temporaries.
    """
    logits = logits_bytes_per_row(vocab, dtype, cfg)
    if device_type == "cpu":
        return logits
    return logits + vocab * _TEMPORARIES * math_dtype(dtype).itemsize


def lookup_variant(cfg: LCEConfig) -> str:
    """The cache entry a call reads: the one of the variant its options need (a forced variant too)."""
    return "full" if cfg.needs_full else "plain"


def plan_chunks(device: DeviceDescription, call: CallDescription, entry: TunedEntry) -> tuple[TokenChunks, MemoryPlan]:
    """The autotune cache's tokens_per_chunk and logits_save_limit_bytes for this shape replace the
    heuristic's; an explicit memory_budget still bounds them. Batch-invariant calls: tiles of
    BATCH_INVARIANT_TOKENS rows whatever the budget and the cache, no kept logits (backward would turn
    them into gradients with GEMMs over all kept rows at once)."""
    cfg = call.cfg
    per_row = working_bytes_per_row(device.type, call.vocab, call.dtype, cfg)
    budget, budget_from = call_budget(cfg.memory_budget, DEFAULT_CHUNK_BUDGET, "DEFAULT_CHUNK_BUDGET")
    if cfg.batch_invariant:
        # The call pads its tokens to whole tiles (a copy of hidden and the targets where they are not already).
        padded = -(-call.n_rows // BATCH_INVARIANT_TOKENS) * BATCH_INVARIANT_TOKENS
        copy = padded * (call.hidden * call.dtype.itemsize + 8) if padded != call.n_rows else 0
        return (TokenChunks(tokens_per_chunk=BATCH_INVARIANT_TOKENS, saved_rows=0),
                MemoryPlan(budget, "batch_invariant: fixed tiles of 128 rows, the tokens padded to whole tiles",
                           BATCH_INVARIANT_TOKENS * per_row + copy))
    params = entry.params or {}
    tokens = tuned_chunk_rows(call.n_rows, per_row, params.get("tokens_per_chunk"), budget)
    save_limit, limit_from = call_save_limit(entry.logits_save_limit_bytes, cfg.memory_budget, device.total_memory)
    logits_row_bytes = logits_bytes_per_row(call.vocab, call.dtype, cfg)
    saved = saved_logits_rows(call.n_rows, tokens, logits_row_bytes, per_row, save_limit)
    return (TokenChunks(tokens_per_chunk=tokens, saved_rows=saved),
            MemoryPlan(budget, budget_from, 0 if saved == call.n_rows else tokens * per_row,
                       saved * logits_row_bytes, save_limit, limit_from))


def choose(device: DeviceDescription, call: CallDescription, entry: TunedEntry | None = None) -> CallChoice:
    """The same plan whether gradients follow or not (inference keeps no logits whatever saved_rows says)."""
    if entry is None:
        entry = entry_for(device, call)
    plan, memory = plan_chunks(device, call, entry)
    if not logits_kept_for_gradients(call.cfg, call.request):
        # Neither a deferred backward nor a second pass in forward: the plan's saved rows are never kept.
        per_row = working_bytes_per_row(device.type, call.vocab, call.dtype, call.cfg)
        memory = memory.without_kept_logits(min(plan.tokens_per_chunk, call.n_rows) * per_row)
    blocks = (f"row blocks of {CPU_BLOCK_BYTES >> 20} MiB" if device.type == "cpu" else "the whole chunk at once")
    steps = row_kernel_steps(call, plan, KERNEL_NAMES, lambda role: f"torch ops, {blocks}")
    return call_record("reference", device, call, entry.source, plan, memory, steps, "flce.backends.reference.kernels")


def entry_for(device: DeviceDescription, call: CallDescription) -> TunedEntry:
    return tuned_entry(device.name, "reference", lookup_variant(call.cfg), call.dtype, call.hidden, call.vocab,
                       call.n_rows)


_KERNELS = ReferenceKernels()
# Records by call description: the choice is a pure function of it and costs more than a dictionary lookup.
_planned: dict[tuple, CallChoice] = {}
_PLANNED_LIMIT = 256


def plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    device, call = describe_device(flat.hidden.device), CallDescription.of(flat, cfg, variant, request)
    entry = entry_for(device, call)
    key = (device, call.key, entry.key)
    record = _planned.get(key)
    if record is None:
        if len(_planned) >= _PLANNED_LIMIT:
            _planned.clear()
        record = _planned[key] = choose(device, call, entry)
    return EngineCall(kernels=_KERNELS, cfg=cfg, plan=record.plan, plain=variant == "plain",
                      token_shape=flat.token_shape, choice=record)
