"""The Ascend backend's planner: always TokenChunks, the chunk size from the memory budget (or the
autotune cache), the logits-save limit from the device's memory."""

from __future__ import annotations

import warnings

from flce.autotune.lookup import tuned_params
from flce.backends.ascend.ops import AscendChunkKernels, AscendDeviceProperties, device_properties
from flce.config import LCEConfig
from flce.engine.call import EngineCall
from flce.engine.memory import GiB, MiB, logits_save_limit, saved_logits_rows
from flce.engine.plans import PlanRequest, TokenChunks
from flce.engine.rows import logits_bytes_per_row
from flce.inputs import FlatInputs

# Without a memory budget one chunk's logits may use this much (as the other backends).
DEFAULT_CHUNK_BUDGET = 256 * MiB

# A square weight this large is no LM head (H <= 16k, V >= 32k in practice): the caller most
# likely passed logits as `hidden` with an identity weight.
LOGITS_LIKE_MIN_VOCAB = 4096

_warned_logits_like = False


def warn_if_logits_like(flat: FlatInputs) -> bool:
    """Warns once per process when the inputs look like logits times an identity; True if so."""
    global _warned_logits_like
    vocab, hidden_size = flat.weight.shape
    if vocab != hidden_size or vocab < LOGITS_LIKE_MIN_VOCAB:
        return False
    if not _warned_logits_like:
        _warned_logits_like = True
        warnings.warn(
            f"flce: hidden's last dimension equals the vocabulary size ({vocab}): if hidden already holds "
            "logits, call torch.nn.functional.cross_entropy on them instead; flce would multiply them by a "
            f"[{vocab}, {vocab}] weight again, which only costs time",
            RuntimeWarning, stacklevel=5,
        )
    return True


def logits_save_limit_bytes(total_memory: int) -> int:
    """max(1 GiB, min(4 GiB, total memory / 8)): flce.engine.memory.default_logits_save_limit's
    rule, applied to the (possibly overridden) device memory."""
    return max(GiB, min(4 * GiB, total_memory // 8))


def plan_chunks(flat: FlatInputs, cfg: LCEConfig, props: AscendDeviceProperties, variant: str) -> TokenChunks:
    """Tokens per chunk and the rows whose logits a deferred backward keeps from forward.

    The autotune cache's ``tokens_per_chunk`` and logits-save limit win when it holds them for
    this device and shape; otherwise tokens come from the memory budget and the limit is
    :func:`logits_save_limit_bytes`. A given memory_budget bounds both, and without a tuned limit
    is the limit. The kernels overwrite
    the logits with their gradient, so a chunk needs its logits and nothing else of size [n, V].
    """
    n_rows = flat.target.shape[0]
    hidden_size = flat.weight.shape[1]
    row_bytes = logits_bytes_per_row(flat.weight.shape[0], flat.weight.dtype, cfg)
    params, tuned_limit = tuned_params(flat.hidden.device, "ascend", variant, flat.weight.dtype, hidden_size,
                                       flat.weight.shape[0], n_rows)
    tuned_tokens = (params or {}).get("tokens_per_chunk")
    budget = cfg.memory_budget if cfg.memory_budget is not None else DEFAULT_CHUNK_BUDGET
    if _is_positive_int(tuned_tokens):
        tokens = tuned_tokens
        if cfg.memory_budget is not None:
            tokens = min(tokens, cfg.memory_budget // max(1, row_bytes))
    else:
        tokens = budget // max(1, row_bytes)
    tokens = max(1, min(n_rows, tokens))
    save_limit = logits_save_limit(tuned_limit, cfg.memory_budget, logits_save_limit_bytes(props.total_memory_bytes))
    return TokenChunks(tokens_per_chunk=tokens,
                     saved_rows=saved_logits_rows(n_rows, tokens, row_bytes, row_bytes, save_limit))


def _is_positive_int(value: object) -> bool:
    """A cached knob is used only if it is a value the planner can use (files outlive versions)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0




def plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    """The same plan whether gradients follow or not (inference keeps no logits whatever saved_rows says)."""
    warn_if_logits_like(flat)
    props = device_properties(flat.hidden.device)
    return EngineCall(kernels=AscendChunkKernels(props), cfg=cfg, plan=plan_chunks(flat, cfg, props, variant),
                      plain=variant == "plain", token_shape=flat.token_shape)
