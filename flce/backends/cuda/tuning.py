"""The CUDA backend's tuning space (flce-autotune): chunk rows, row-kernel launches, fused-GEMM tiles,
and under a memory budget the two lean schedules at the largest size that fits."""

from __future__ import annotations

import torch

from flce.autotune.spaces import TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.engine.plans import CUBLAS, EXPONENTIALS, FUSED, GEMM_PATHS, LOGITS

# The space is registered when the backend is (at `import flce`); what it reads from the launchers
# and the planner, which import triton, is imported when the tuner first asks.


def _tuning_candidates(shape: TuneShape, quick: bool) -> list[dict]:
    """Chunk rows x row-kernel launches on the cuBLAS forward, and chunk rows x fused-GEMM tiles with
    the chunk's statistics and logits from the fused Triton forward (forward_logits). On Hopper also
    the warp-specialised forward (which also writes the logits, or for bf16 the row-offset exponentials:
    chunk_grad), and each forward's gradient products on cuBLAS and on the warp-specialised GEMM
    (grad_gemm_kernel)."""
    from flce.backends.cuda.choice import ws_takes_every_product
    from flce.backends.cuda.configs import WARP_SPECIALIZED, GemmConfig, default_gemm_config
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.plan import GRAD_GEMM_KERNELS

    device = describe_device(torch.device(shape.device))
    launches = [(4096, 8)] if quick else [(4096, 8), (4096, 16), (2048, 8)]
    tiles = [default_gemm_config(device, shape.dtype)]
    if not quick:
        tiles += [GemmConfig(128, 256, 64, 16, 8, 3), GemmConfig(128, 256, 64, 8, 8, 4)]
    rows = chunk_candidates(shape.tokens, quick, smallest=512)
    forwards = ([{"forward_logits": CUBLAS, "block_v": block_v, "num_warps": warps} for block_v, warps in launches]
                + [{"forward_logits": FUSED, "logits_kernel": "triton", **t.as_params()} for t in tiles])
    if ws_takes_every_product(device, shape.dtype, shape.hidden, shape.vocab):
        forwards.append({"forward_logits": FUSED, "logits_kernel": WARP_SPECIALIZED, "chunk_grad": LOGITS})
        if shape.dtype == torch.bfloat16:  # the exponentials need bf16's exponent range
            forwards.append({"forward_logits": FUSED, "logits_kernel": WARP_SPECIALIZED, "chunk_grad": EXPONENTIALS})
        forwards = [dict(f, grad_gemm_kernel=kernel) for f in forwards for kernel in GRAD_GEMM_KERNELS]
    return [{"tokens_per_chunk": n, **forward} for n in rows for forward in forwards]


def _tuning_budget_candidates(shape: TuneShape, budget: int) -> list[dict]:
    """Under an explicit budget, the two exact schedules at the largest size that fits it, so the
    cache records which is faster by measurement: token chunks (each read-modify-writes the V x H
    weight gradient; below 512 rows the ladder of _tuning_candidates has none) and vocabulary
    blocks of all rows (statistics first, each block's logits recomputed; the gradient from the
    fused GEMM or from cuBLAS + the row kernel)."""
    from flce.backends.cuda.plan import MIN_VOCAB_BLOCK, chunk_rows, vocab_block_columns

    itemsize = shape.dtype.itemsize
    candidates = []
    rows = chunk_rows(shape.tokens, budget // (shape.vocab * itemsize))
    if 0 < rows < shape.tokens:
        candidates.append({"tokens_per_chunk": rows, "grad_schedule": "token_chunks"})
    columns = vocab_block_columns(shape.tokens, itemsize, budget)
    if MIN_VOCAB_BLOCK <= columns < shape.vocab:
        candidates += [{"grad_schedule": "vocab_blocks", "grad_vocab_block": columns, "backward_grad": path}
                       for path in GEMM_PATHS]
    return candidates


def _tuning_working_bytes(shape: TuneShape, params: dict) -> int:
    if params.get("grad_schedule") == "vocab_blocks" and params.get("grad_vocab_block"):
        from flce.backends.cuda.plan import STATS_BYTES_PER_ROW

        return shape.tokens * (int(params["grad_vocab_block"]) * shape.dtype.itemsize + STATS_BYTES_PER_ROW)
    rows = int(params.get("tokens_per_chunk") or shape.tokens)
    return min(rows, shape.tokens) * shape.vocab * shape.dtype.itemsize


def _tuning_heuristic(shape: TuneShape) -> dict:
    """The chunk, launch and forward-path knobs the planner picks with nothing cached (a training
    call). The gradient schedule is left out: the planner picks it per call from the budget."""
    from flce.backends.cuda.choice import DEFAULT_GRAD_GEMM_KERNEL, ws_takes_every_product
    from flce.backends.cuda.configs import LaunchParams, default_gemm_config
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.ops import row_launch
    from flce.backends.cuda.plan import DEFAULT_CHUNK_BUDGET, MAX_BLOCK_V, chunk_rows

    device = describe_device(torch.device(shape.device))
    row_bytes = shape.vocab * shape.dtype.itemsize
    block_v, num_warps = row_launch(shape.vocab, LaunchParams(block_v=MAX_BLOCK_V))
    ws = ws_takes_every_product(device, shape.dtype, shape.hidden, shape.vocab)
    knobs = {"tokens_per_chunk": chunk_rows(shape.tokens, max(1, DEFAULT_CHUNK_BUDGET // row_bytes)),
             "block_v": block_v, "num_warps": num_warps,
             # a plain training call's defaults (choice.py): the warp-specialised statistics GEMM writes each
             # chunk's logits or, for bf16, the kept exponentials
             "forward_logits": FUSED if ws else CUBLAS, "grad_gemm_kernel": DEFAULT_GRAD_GEMM_KERNEL,
             "chunk_grad": EXPONENTIALS if ws and shape.dtype == torch.bfloat16 else LOGITS}
    # The Triton GEMMs' tiles only where they run: where the warp-specialised GEMM takes the statistics, they
    # would be inert keys in the entry.
    return knobs if ws else {**knobs, **default_gemm_config(device, shape.dtype).as_params()}


# The default (plain, in-forward gradient) schedule never keeps logits, so the save limit is
# not worth device time to tune.
register_tuning_space(TuningSpace("cuda", candidates=_tuning_candidates, working_bytes=_tuning_working_bytes,
                                  tunes_logits_save_limit=False, heuristic=_tuning_heuristic,
                                  budget_candidates=_tuning_budget_candidates,
                                  inference_overlays=({"forward_stats": "fused"},
                                                      {"forward_stats": "fused", "stats_kernel": "triton"},
                                                      {"forward_stats": "cublas"})))
