"""The reference backend's entry point: its kernels and plan bound to the shared Function."""

from __future__ import annotations

import torch

from flce.backends.chunked_function import ChunkedCall, apply_chunked
from flce.backends.reference.kernels import ReferenceKernels
from flce.backends.reference.ops import plan_chunks
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput

_KERNELS = ReferenceKernels()


def reference_chunked_call(flat: FlatInputs, cfg: LCEConfig, variant: str, training: bool | None = None) -> ChunkedCall:
    """training is accepted for the descriptor's signature: the reference plan is the same either way."""
    return ChunkedCall(kernels=_KERNELS, cfg=cfg, plan=plan_chunks(flat, cfg), plain=variant == "plain",
                       token_shape=flat.token_shape)


def reference_linear_cross_entropy(flat: FlatInputs, cfg: LCEConfig, variant: str) -> torch.Tensor | LCEOutput:
    return apply_chunked(flat, reference_chunked_call(flat, cfg, variant))
