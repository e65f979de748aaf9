"""The reference backend's planner: always TokenChunks, the chunk size from the memory budget (or the
autotune cache), and how many rows a deferred backward keeps the logits of."""

from __future__ import annotations

from flce.autotune.lookup import tuned_params
from flce.backends.reference.kernels import ReferenceKernels, math_dtype
from flce.config import LCEConfig
from flce.engine.call import EngineCall
from flce.engine.memory import MiB, default_logits_save_limit, logits_save_limit, saved_logits_rows
from flce.engine.plans import BATCH_INVARIANT_TOKENS, PlanRequest, TokenChunks
from flce.engine.rows import logits_bytes_per_row
from flce.inputs import FlatInputs

# Without a budget a chunk may use this much: large enough for full-speed CPU GEMMs
# (>= 512 rows at V = 128k in fp32; 2 chunks at 4096 x 32000), small next to the logits it replaces.
DEFAULT_CHUNK_BUDGET = 256 * MiB
# Math-dtype temporaries the kernels hold at once over the rows they work on (the full variant's
# z, probabilities and one product; the plain variant needs at most one, for low-precision logits).
_TEMPORARIES = 3


def working_bytes_per_row(flat: FlatInputs, cfg: LCEConfig | None = None) -> int:
    """Working memory per token row of a chunk.

    On the CPU the kernels work in place on the chunk's logits and keep their temporaries to
    cache-sized row blocks (at most ``_TEMPORARIES * CPU_BLOCK_BYTES``, a fixed 24 MiB whatever the
    shape), so a row costs its logits alone. On other devices a block is the whole chunk: each
    row also carries the temporaries.
    """
    vocab = flat.weight.shape[0]
    logits = logits_bytes_per_row(vocab, flat.weight.dtype, cfg or LCEConfig())
    if flat.hidden.device.type == "cpu":
        return logits
    return logits + vocab * _TEMPORARIES * math_dtype(flat.weight.dtype).itemsize


def plan_chunks(flat: FlatInputs, cfg: LCEConfig, variant: str | None = None) -> TokenChunks:
    """The autotune cache's tokens_per_chunk and logits_save_limit_bytes for this shape replace the
    heuristic's; an explicit memory_budget still bounds them. variant None: the one "auto" picks.
    Batch-invariant calls: tiles of BATCH_INVARIANT_TOKENS rows whatever the budget and the cache,
    no kept logits (backward would turn them into gradients with GEMMs over all kept rows at once)."""
    if cfg.batch_invariant:
        return TokenChunks(tokens_per_chunk=BATCH_INVARIANT_TOKENS, saved_rows=0)
    n_rows = flat.target.shape[0]
    per_row = working_bytes_per_row(flat, cfg)
    budget = cfg.memory_budget if cfg.memory_budget is not None else DEFAULT_CHUNK_BUDGET
    tokens = max(1, min(n_rows, budget // per_row))
    params, cached_limit = tuned_params(
        flat.hidden.device, "reference", variant or ("full" if cfg.needs_full else "plain"), flat.weight.dtype,
        flat.weight.shape[1], flat.weight.shape[0], n_rows,
    )
    cached_tokens = (params or {}).get("tokens_per_chunk")
    # Entries from other flce versions may hold anything: only a positive int is used.
    if isinstance(cached_tokens, int) and not isinstance(cached_tokens, bool) and cached_tokens > 0:
        tokens = min(n_rows, cached_tokens)
        if cfg.memory_budget is not None:
            tokens = min(tokens, cfg.memory_budget // per_row)
        tokens = max(1, tokens)
    save_limit = logits_save_limit(cached_limit, cfg.memory_budget, default_logits_save_limit(flat.hidden.device))
    logits_row_bytes = logits_bytes_per_row(flat.weight.shape[0], flat.weight.dtype, cfg)
    return TokenChunks(tokens_per_chunk=tokens,
                     saved_rows=saved_logits_rows(n_rows, tokens, logits_row_bytes, per_row, save_limit))


_KERNELS = ReferenceKernels()


def plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    """The same plan whether gradients follow or not (inference keeps no logits whatever saved_rows
    says); the cache entry is the one of the variant the options need."""
    return EngineCall(kernels=_KERNELS, cfg=cfg, plan=plan_chunks(flat, cfg), plain=variant == "plain",
                      token_shape=flat.token_shape)
