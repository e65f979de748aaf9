"""Planning for the reference backend: chunk size from the memory budget, and whether the
deferred schedule keeps forward's logits for backward."""

from __future__ import annotations

from flce.backends.chunk_driver import ChunkPlan
from flce.backends.memory import MiB, default_logits_save_limit
from flce.backends.reference.kernels import math_dtype
from flce.config import LCEConfig
from flce.inputs import FlatInputs

# Without a budget a chunk may use this much: large enough for full-speed CPU GEMMs
# (>= 512 rows at V = 128k in fp32), small next to the logits it replaces.
DEFAULT_CHUNK_BUDGET = 256 * MiB


def working_bytes_per_row(flat: FlatInputs) -> int:
    """Logits in the compute dtype plus two math-dtype temporaries per vocabulary entry."""
    vocab = flat.weight.shape[0]
    compute = flat.weight.element_size()
    math = math_dtype(flat.weight.dtype).itemsize
    return vocab * (compute + 2 * math)


def plan_chunks(flat: FlatInputs, cfg: LCEConfig) -> ChunkPlan:
    n_rows = flat.target.shape[0]
    per_row = working_bytes_per_row(flat)
    budget = cfg.memory_budget if cfg.memory_budget is not None else DEFAULT_CHUNK_BUDGET
    tokens = max(1, min(n_rows, budget // per_row))
    logits_bytes = n_rows * flat.weight.shape[0] * flat.weight.element_size()
    save_limit = default_logits_save_limit(flat.hidden.device)
    if cfg.memory_budget is not None:
        save_limit = min(save_limit, cfg.memory_budget - tokens * per_row)
    return ChunkPlan(tokens_per_chunk=tokens, save_logits=logits_bytes <= save_limit)
