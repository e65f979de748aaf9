"""The Ascend backend's entry point: its chunk kernels and plan bound to the shared Function."""

from __future__ import annotations

import warnings

import torch

from flce.backends.ascend.ops import AscendChunkKernels, device_properties, plan_chunks
from flce.backends.chunked_function import ChunkedCall, apply_chunked
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput

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


def ascend_chunked_call(flat: FlatInputs, cfg: LCEConfig, variant: str) -> ChunkedCall:
    warn_if_logits_like(flat)
    props = device_properties(flat.hidden.device)
    return ChunkedCall(kernels=AscendChunkKernels(props), cfg=cfg, plan=plan_chunks(flat, cfg, props, variant),
                       plain=variant == "plain", token_shape=flat.token_shape)


def ascend_linear_cross_entropy(flat: FlatInputs, cfg: LCEConfig, variant: str) -> torch.Tensor | LCEOutput:
    return apply_chunked(flat, ascend_chunked_call(flat, cfg, variant))
