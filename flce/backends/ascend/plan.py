"""The Ascend backend's planner: always TokenChunks, the chunk size from the memory budget (or the
autotune cache), the logits-save limit from the device's memory. A pure function of the device's and the
call's descriptions (flce.engine.choice), whose record ``python -m flce explain`` prints."""

from __future__ import annotations

import warnings

from flce.autotune.devices import device_name
from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.backends.ascend.ops import (
    DEFAULT_UB_BYTES,
    AscendChunkKernels,
    AscendDeviceProperties,
    block_size,
    device_properties,
    ub_bytes_for_arch,
)
from flce.config import LCEConfig
from flce.engine.call import EngineCall, call_record, logits_kept_for_gradients
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription, MemoryPlan
from flce.engine.memory import MiB, call_budget, call_save_limit, saved_logits_rows, tuned_chunk_rows
from flce.engine.plans import PlanRequest, TokenChunks
from flce.engine.rows import logits_bytes_per_row, logits_dtype
from flce.engine.steps import RowKernelNames, row_kernel_steps
from flce.inputs import FlatInputs

# Without a memory budget one chunk's logits may use this much (as the other backends).
DEFAULT_CHUNK_BUDGET = 256 * MiB

# A square weight this large is no LM head (H <= 16k, V >= 32k in practice): the caller most
# likely passed logits as `hidden` with an identity weight.
LOGITS_LIKE_MIN_VOCAB = 4096
_K = "flce.backends.ascend.kernels."
KERNEL_NAMES = RowKernelNames(plain_loss=_K + "_plain_loss_kernel", plain_grad=_K + "_plain_grad_kernel",
                              row_stats=_K + "_row_stats_kernel", full_grad=_K + "_full_grad_kernel",
                              scale=_K + "_scale_kernel", bias_sums="torch.Tensor.sum", fp32_product="torch.matmul")

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


def plan_chunks(device: DeviceDescription, call: CallDescription, entry: TunedEntry) -> tuple[TokenChunks, MemoryPlan]:
    """Tokens per chunk and the rows whose logits a deferred backward keeps from forward.

    The autotune cache's ``tokens_per_chunk`` and logits-save limit win when it holds them for
    this device and shape; otherwise tokens come from the memory budget and the limit is 1/8 of the
    device's memory, within 1-4 GiB. A given memory_budget bounds both, and without a tuned limit is
    the limit. The kernels overwrite the logits with their gradient, so a chunk needs its logits and
    nothing else of size [n, V].
    """
    cfg = call.cfg
    row_bytes = logits_bytes_per_row(call.vocab, call.dtype, cfg)
    budget, budget_from = call_budget(cfg.memory_budget, DEFAULT_CHUNK_BUDGET, "DEFAULT_CHUNK_BUDGET")
    tokens = tuned_chunk_rows(call.n_rows, row_bytes, (entry.params or {}).get("tokens_per_chunk"), budget)
    save_limit, limit_from = call_save_limit(entry.logits_save_limit_bytes, cfg.memory_budget, device.total_memory)
    saved = saved_logits_rows(call.n_rows, tokens, row_bytes, row_bytes, save_limit)
    memory = MemoryPlan(budget, budget_from, 0 if saved == call.n_rows else tokens * row_bytes, saved * row_bytes,
                        save_limit, limit_from)
    return TokenChunks(tokens_per_chunk=tokens, saved_rows=saved), memory


def properties_of(device: DeviceDescription) -> AscendDeviceProperties:
    """The launchers' figures for a described NPU: its vector cores, the UB of its SoC (910B's by default)."""
    return AscendDeviceProperties(vector_cores=device.multiprocessors or 40,
                                  ub_bytes=ub_bytes_for_arch(device.name) or DEFAULT_UB_BYTES,
                                  total_memory_bytes=device.total_memory, source="described")


def choose(device: DeviceDescription, call: CallDescription, entry: TunedEntry | None = None,
           props: AscendDeviceProperties | None = None) -> CallChoice:
    """The same plan whether gradients follow or not (inference keeps no logits whatever saved_rows says)."""
    if entry is None:
        entry = tuned_entry(device.name, "ascend", call.variant, call.dtype, call.hidden, call.vocab, call.n_rows)
    props = props or properties_of(device)
    plan, memory = plan_chunks(device, call, entry)
    if not logits_kept_for_gradients(call.cfg, call.request):
        # Neither a deferred backward nor a second pass in forward: the plan's saved rows are never kept.
        memory = memory.without_kept_logits(min(plan.tokens_per_chunk, call.n_rows)
                                            * logits_bytes_per_row(call.vocab, call.dtype, call.cfg))

    def launch(kernel: str) -> str:
        block = block_size(kernel, logits_dtype(call.dtype, call.cfg), call.vocab, props.ub_bytes,
                           call.cfg.softcap is not None)
        return (f"BLOCK_V {block} (a {props.ub_bytes >> 10} KiB "
                f"UB), up to {props.vector_cores} programs")

    steps = row_kernel_steps(call, plan, KERNEL_NAMES, launch)
    return call_record("ascend", device, call, entry.source, plan, memory, steps, "flce.backends.ascend.kernels")


def plan_call(flat: FlatInputs, cfg: LCEConfig, variant: str, request: PlanRequest) -> EngineCall:
    warn_if_logits_like(flat)
    props = device_properties(flat.hidden.device)
    device = DeviceDescription(type=flat.hidden.device.type, name=device_name(flat.hidden.device),
                               total_memory=props.total_memory_bytes, multiprocessors=props.vector_cores)
    record = choose(device, CallDescription.of(flat, cfg, variant, request), props=props)
    return EngineCall(kernels=AscendChunkKernels(props), cfg=cfg, plan=record.plan, plain=variant == "plain",
                      token_shape=flat.token_shape, choice=record)
