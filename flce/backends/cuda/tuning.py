"""The CUDA backend's tuning spaces (flce-autotune), one per loss. Cross-entropy's: chunk rows x the forwards each
kernel family offers (its tuning candidates), x the gradient products' families where more than one fits; under a
memory budget the two lean schedules at the largest size that fits. Linear distillation's (variant
"distillation"): chunk rows x its row kernels' blocks and passes x the products' families; under a budget the
largest token chunk that fits. Each heuristic is the kernel choice's own (choice.py), read back as knobs."""

from __future__ import annotations

import torch

from flce.autotune.spaces import DISTILLATION, TuneShape, TuningSpace, chunk_candidates, register_tuning_space
from flce.engine.choice import DeviceDescription
from flce.engine.distillation.call import DistillDescription, pair_logits_bytes_per_row
from flce.engine.plans import GEMM_PATHS

# The space is registered when the backend is (at `import flce`); what it reads from the launchers
# and the planner, which import triton, is imported when the tuner first asks.


def _device_and_products(shape: TuneShape) -> tuple[DeviceDescription, list[str]]:
    """The shape's device description and the names of the families that fit its gradient products."""
    from flce.backends.cuda import families
    from flce.backends.cuda.families.family import PRODUCTS, tuning_call
    from flce.backends.cuda.hardware import describe_device

    device = describe_device(torch.device(shape.device))
    call = tuning_call(shape)
    return device, [family.name for family in families.families_for(PRODUCTS)
                    if family.unfit(device, call, PRODUCTS) is None]


def _tuning_candidates(shape: TuneShape, quick: bool) -> list[dict]:
    """Chunk rows x every family's forward candidates (cuBLAS + the row kernel per row-kernel launch, the fused
    Triton GEMM per tile configuration, on Hopper the warp-specialised GEMM writing the logits or the kept
    exponentials), each forward with every family that fits the gradient products (grad_gemm_kernel)."""
    from flce.backends.cuda import families

    device, products = _device_and_products(shape)
    forwards = [knobs for family in families.FAMILIES for knobs in family.tuning_candidates(device, shape, quick)]
    if len(products) > 1:
        forwards = [dict(knobs, grad_gemm_kernel=name) for knobs in forwards for name in products]
    rows = chunk_candidates(shape.tokens, quick, smallest=512)
    return [{"tokens_per_chunk": n, **forward} for n in rows for forward in forwards]


def _distillation_candidates(shape: TuneShape, quick: bool) -> list[dict]:
    """Chunk rows x the pair row kernels' blocks x forward's passes in one kernel (all rows in flight, or one, two or
    four a multiprocessor: fewer rows in flight keep more of a row in L2 between its sweeps; all rows without the
    register cap too) or one kernel each (and the chunk logits by cuBLAS once), x the gradient products' families
    that fit."""
    from flce.backends.cuda.plan import PAIR_REGISTERS_RANGE

    device, products = _device_and_products(shape)
    sms = device.multiprocessors
    launches = [(4096, 8)] if quick else [(4096, 8), (4096, 16), (2048, 8), (2048, 4)]
    in_flight = [None] if quick or not sms else [None, sms, 2 * sms, 4 * sms]
    passes = [{"pair_passes": "fused", **({"rows_in_flight": r} if r else {})} for r in in_flight]
    if not quick:
        passes.append({"pair_passes": "fused", "pair_registers": PAIR_REGISTERS_RANGE[1]})
    passes.append({"pair_passes": "separate"})
    forwards = [{"block_v": block_v, "num_warps": warps, **p} for block_v, warps in launches for p in passes]
    # The chunk logits from cuBLAS and a statistics pass, beside the heuristic's family (on Hopper the
    # warp-specialised GEMM making the statistics in its epilogue), at the first launch with every row in flight.
    forwards.append({**forwards[0], "forward_logits": "cublas"})
    if len(products) > 1:
        forwards = [dict(knobs, grad_gemm_kernel=name) for knobs in forwards for name in products]
    rows = chunk_candidates(shape.tokens, quick, smallest=256)
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


def _distillation_budget_candidates(shape: TuneShape, budget: int) -> list[dict]:
    """Under an explicit budget, token chunks only: the largest that fits both heads' logits."""
    from flce.backends.cuda.plan import chunk_rows

    rows = chunk_rows(shape.tokens, budget // pair_logits_bytes_per_row(shape.vocab, shape.dtype))
    return [{"tokens_per_chunk": rows}] if 0 < rows < shape.tokens else []


def _tuning_working_bytes(shape: TuneShape, params: dict) -> int:
    if params.get("grad_schedule") == "vocab_blocks" and params.get("grad_vocab_block"):
        from flce.backends.cuda.plan import STATS_BYTES_PER_ROW

        return shape.tokens * (int(params["grad_vocab_block"]) * shape.dtype.itemsize + STATS_BYTES_PER_ROW)
    rows = int(params.get("tokens_per_chunk") or shape.tokens)
    return min(rows, shape.tokens) * shape.vocab * shape.dtype.itemsize


def _distillation_working_bytes(shape: TuneShape, params: dict) -> int:
    # Both heads' logits of a chunk, the kernels' only [n, V] memory.
    rows = int(params.get("tokens_per_chunk") or shape.tokens)
    return min(rows, shape.tokens) * pair_logits_bytes_per_row(shape.vocab, shape.dtype)


def _tuning_heuristic(shape: TuneShape) -> dict:
    """The knobs the kernel choice takes for a plain training call with nothing cached (choice.py), so a winning
    heuristic's entry states what ran: the chunk, the row kernels' launch, each role's family, what a chunk's
    gradient is made from, and the Triton GEMMs' tiles where a Triton family runs. The gradient schedule is left
    out: the planner picks it per call from the budget."""
    from flce.autotune.lookup import TunedEntry
    from flce.backends.cuda.choice import choose
    from flce.backends.cuda.families.family import CHUNK_LOGITS, EXPONENTIALS, PRODUCTS, tuning_call
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.row_ops import row_launch
    from flce.engine.plans import EXPONENTIALS as KEPT_EXPONENTIALS
    from flce.engine.plans import TokenChunks

    device = describe_device(torch.device(shape.device))
    record, kernels = choose(device, tuning_call(shape), TunedEntry(None, None, "none"))
    plan = record.plan
    assert isinstance(plan, TokenChunks), plan
    block_v, num_warps = row_launch(shape.vocab, kernels.settings.launch)
    knobs = {"tokens_per_chunk": plan.tokens_per_chunk, "block_v": block_v, "num_warps": num_warps,
             "forward_logits": plan.forward_logits, "grad_gemm_kernel": kernels.family(PRODUCTS).name,
             "chunk_grad": plan.chunk_grad}
    # The Triton GEMMs' tiles only where a family that reads them runs in the call: elsewhere they would be inert
    # keys in the entry.
    running = (kernels.family(EXPONENTIALS if plan.chunk_grad == KEPT_EXPONENTIALS else CHUNK_LOGITS),
               kernels.family(PRODUCTS))
    if any(family.uses_gemm_tiles for family in running):
        knobs.update(kernels.settings.gemm.as_params())
    return knobs


def _distillation_heuristic(shape: TuneShape) -> dict:
    """The knobs the distillation kernel choice takes for a training call with nothing cached: the chunk, the row
    kernels' launch, whether forward's passes are one kernel, and the gradient products' family."""
    from flce.autotune.lookup import TunedEntry
    from flce.backends.cuda.choice import choose_distillation
    from flce.backends.cuda.families.family import CHUNK_LOGITS, PRODUCTS
    from flce.backends.cuda.hardware import describe_device
    from flce.backends.cuda.row_ops import row_launch

    desc = DistillDescription.tuned(shape.tokens, shape.hidden, shape.vocab, shape.dtype)
    record, kernels = choose_distillation(describe_device(torch.device(shape.device)), desc,
                                          TunedEntry(None, None, "none"))
    block_v, num_warps = row_launch(shape.vocab, kernels.settings.launch)
    return {"tokens_per_chunk": record.plan.tokens_per_chunk, "block_v": block_v, "num_warps": num_warps,
            "pair_passes": "fused" if record.plan.fused_passes else "separate",
            **({"forward_logits": "fused", "logits_kernel": kernels.family(CHUNK_LOGITS).name.removesuffix("_tma")}
               if record.plan.stats_in_gemm else {"forward_logits": "cublas"}),
            "grad_gemm_kernel": kernels.family(PRODUCTS).name}


# The default (plain, in-forward gradient) schedule never keeps logits, so the save limit is
# not worth device time to tune.
register_tuning_space(TuningSpace("cuda", candidates=_tuning_candidates, working_bytes=_tuning_working_bytes,
                                  tunes_logits_save_limit=False, heuristic=_tuning_heuristic,
                                  budget_candidates=_tuning_budget_candidates,
                                  inference_overlays=({"forward_stats": "fused"},
                                                      {"forward_stats": "fused", "stats_kernel": "triton"},
                                                      {"forward_stats": "cublas"})))
# Distillation's planner keeps no logits, and its calls have no forward-only statistics path to choose.
register_tuning_space(TuningSpace("cuda", kind=DISTILLATION, candidates=_distillation_candidates,
                                  working_bytes=_distillation_working_bytes, tunes_logits_save_limit=False,
                                  heuristic=_distillation_heuristic, budget_candidates=_distillation_budget_candidates))
