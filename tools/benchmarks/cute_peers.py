"""The CuTe-DSL peers of peers.py: quack's linear cross-entropy and plain GEMM, Liger-Kernel's CuTe paths.

They need nvidia-cutlass-dsl (quack 0.6.5 pairs with 4.7.1: 4.8.1 breaks it at import), so each loader
returns nothing where its package does not import, and peers.py prints why. How to bring the wheels to
a machine that cannot reach a registry: tools/benchmarks/quack_setup.sh.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable

import torch

GemmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _key_dsl_objects_by_name() -> None:
    """quack 0.6.5 keys its epilogue compile cache by fingerprinting everything an epilogue function's
    closure reaches, and refuses what it cannot fingerprint; the CUTLASS DSL's own module loggers and
    context variables sit in those closures (``TypeError: epilogue fn depends on ...``). They do not
    change the generated code, so key them by type and name. The fingerprint recurses through the
    module-level name, so replacing it there covers nested values too."""
    from quack.gemm_runtime import identity

    fingerprint = identity.semantic_value_key
    if getattr(fingerprint, "keys_dsl_objects_by_name", False):
        return

    def semantic_value_key(value: object, seen: set) -> object:
        if isinstance(value, (logging.Logger, contextvars.ContextVar)):
            return ("by-name", type(value).__module__, type(value).__qualname__, value.name)
        return fingerprint(value, seen)

    semantic_value_key.keys_dsl_objects_by_name = True
    identity.semantic_value_key = semantic_value_key


def quack_chunk_size(hidden: int) -> int:
    """quack's default chunk of 4096 rows makes its dx GEMM square when H = 4096, and quack 0.6.5 then
    cannot tell rows from columns (``m == n makes row/col inference ambiguous``): take 8192 there."""
    return 8192 if hidden == 4096 else 4096


def quack_methods() -> dict[str, Callable]:
    """``quack``: quack's default (the scaled-exp fused backward on sm_90 where V % 128 == 0);
    ``quack_chunked``: its chunked pipeline (logits chunk, row kernel, three GEMMs)."""
    try:
        _key_dsl_objects_by_name()  # before the import: the module builds its epilogues as it loads
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
    except Exception as exc:
        print(f"quack unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}

    def quack(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scaled_exp: bool | None = None) -> torch.Tensor:
        return chunked_linear_cross_entropy(x, w, t, chunk_size=quack_chunk_size(x.shape[1]), ignore_index=-100,
                                            use_scaled_exp=scaled_exp)

    return {"quack": quack, "quack_chunked": lambda x, w, t: quack(x, w, t, scaled_exp=False)}


def quack_gemm() -> GemmFn | None:
    """quack's GEMM, ``a @ b``, with the tile configuration its heuristic picks (``tuned=False``), or None.
    Its autotuner compiles 44 sm_90 configurations per problem: with it, a run on an H100 (2026-11-25)
    got through one shape of three in seven minutes, more device time than a benchmark call has."""
    try:
        _key_dsl_objects_by_name()
        from quack.gemm_interface import gemm
    except Exception as exc:
        print(f"quack gemm unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return lambda a, b: gemm(a, b, tuned=False)


def liger_cute_methods() -> dict[str, Callable]:
    """Liger-Kernel 0.8.5's two CuTe-DSL routes: ``liger_cute``, its SM90 fused op (logits GEMM, an
    in-place CE kernel turning them into dZ, dX in forward, dW in backward; bf16, M % 128 and V % 256
    only), and ``liger_cute_ce``, its chunked Triton-era op with the CuTe CE kernel inside."""
    try:
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
            liger_fused_linear_cross_entropy_sm90,
        )
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception as exc:
        print(f"liger CuTe paths unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}

    def liger_cute_ce(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # positional: apply() takes no keywords; the 16th argument is ce_impl
        defaults = (None, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False)
        return LigerFusedLinearCrossEntropyFunction.apply(x, w, t, *defaults, "nvidia-cutedsl")[0]

    return {"liger_cute": lambda x, w, t: liger_fused_linear_cross_entropy_sm90(x, w, t, -100),
            "liger_cute_ce": liger_cute_ce}
