"""The CUDA backend's entry point: Triton chunk kernels and plan bound to the shared Function."""

from __future__ import annotations

import torch

from flce.backends.chunked_function import ChunkedCall, apply_chunked, needs_autograd
from flce.backends.cuda.ops import TritonChunkKernels, plan_chunks, tuned_knobs
from flce.config import LCEConfig
from flce.inputs import FlatInputs
from flce.outputs import LCEOutput

_KERNELS = TritonChunkKernels()


def cuda_chunked_call(flat: FlatInputs, cfg: LCEConfig, variant: str, training: bool | None = None) -> ChunkedCall:
    tuned = tuned_knobs(flat, variant)
    kernels = _KERNELS if tuned.launch is None and tuned.gemm is None else TritonChunkKernels(tuned.launch, tuned.gemm)
    if training is None:
        training = needs_autograd(flat)
    return ChunkedCall(kernels=kernels, cfg=cfg, plan=plan_chunks(flat, cfg, training, tuned),
                       plain=variant == "plain", token_shape=flat.token_shape)


def cuda_linear_cross_entropy(flat: FlatInputs, cfg: LCEConfig, variant: str) -> torch.Tensor | LCEOutput:
    return apply_chunked(flat, cuda_chunked_call(flat, cfg, variant))
