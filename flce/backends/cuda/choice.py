"""The one place the CUDA backend decides what a call runs: (device, dtype, shape, options, autotune entry)
in, one record out. The record (flce.engine.choice.CallChoice) names the schedule, its sizes and memory,
and per step the kernel functions and why; :class:`~flce.backends.cuda.configs.KernelChoice` is what the
launchers are told: per role the kernel family (cuda/families) and those that take its place. Both are pure
functions of descriptions (no tensor, no driver): ``python -m flce explain`` makes the same choice on a machine
without the GPU.

Each role's family comes from, in order: the autotune cache's knob for the shape (``cache entry``; where the
family named there does not fit the call, or failed to compile here, the families its fallback chain names), else
the heuristic (``heuristic``: the first registered family that fits the call and that the heuristic takes); the
schedule and sizes come from cuda/plan.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from flce.autotune.lookup import TunedEntry, tuned_entry
from flce.autotune.schema import DISTILLATION_VARIANT
from flce.backends.cuda import plan as sizes
from flce.backends.cuda import steps
from flce.backends.cuda.configs import LaunchParams, LaunchSettings, default_gemm_config
from flce.backends.cuda.families import KernelChoice, families_for, family_named
from flce.backends.cuda.families.family import (
    CHUNK_LOGITS,
    EXPONENTIALS,
    GRADIENT,
    OPTIONAL_ROLES,
    PRODUCTS,
    ROLES,
    STATISTICS,
    KernelFamily,
)
from flce.config import LCEConfig
from flce.distillation.semantics import head_config, per_head_unfit, student_reads_teacher
from flce.engine.call import call_record
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription
from flce.engine.distillation.call import DistillDescription
from flce.engine.distillation.steps import gradient_timing
from flce.engine.plans import CUBLAS, FUSED, LOGITS

# The knob that names each role's family in an autotune entry (its value: a family name, or "fused" / "cublas"
# for the plans' path knobs; "triton" names both Triton families: triton_gemm.py).
ROLE_KNOBS = {STATISTICS: "stats_kernel", CHUNK_LOGITS: "logits_kernel", EXPONENTIALS: "chunk_grad",
              PRODUCTS: "grad_gemm_kernel", GRADIENT: "backward_grad"}
# The plans' path knobs ("fused" or "cublas") of the roles that have one.
_PATH_KNOBS = {STATISTICS: "forward_stats", CHUNK_LOGITS: "forward_logits", GRADIENT: "backward_grad"}


@dataclass(frozen=True)
class RolePick:
    """A role's families (the chosen one first, then its fit fallbacks; none: the role does not run) and why."""

    chain: tuple[KernelFamily, ...]
    reason: str


def choose(device: DeviceDescription, call: CallDescription, entry: TunedEntry,
           failed: Mapping[tuple[str, str], str] | None = None) -> tuple[CallChoice, KernelChoice]:
    """The record of what a call of this description runs on this device, and the launchers' instructions.
    ``failed``: (family, compile key) -> error of kernels that failed to compile here (cuda/fallback.py)."""
    failed = failed or {}
    tuned = sizes.tuned_knobs(entry)
    settings = LaunchSettings(
        launch=tuned.launch or LaunchParams(block_v=sizes.MAX_BLOCK_V), gemm=_gemm_config(device, call, tuned),
        fallback_scan_block=sizes.fallback_scan_block(call.n_rows, call.dtype.itemsize),
        launch_source="cache entry: block_v, num_warps" if tuned.launch else
        f"heuristic: up to {sizes.MAX_BLOCK_V} columns a block, 8 warps from 2048 columns",
        gemm_source="cache entry: gemm_*" if tuned.gemm else "heuristic: default_gemm_config")
    picks: dict[str, RolePick] = {}
    for role in ROLES:  # CHUNK_LOGITS before EXPONENTIALS: the heuristic keeps exponentials beside that family
        picks[role] = _pick(role, device, call, tuned, settings, failed, picks)
    kernels = KernelChoice(chains={role: pick.chain for role, pick in picks.items()}, settings=settings)
    plan, memory = sizes.schedule(device, call, tuned, kernels)
    reasons = {role: pick.reason for role, pick in picks.items()}
    record = call_record("cuda", device, call, tuned.source, plan, memory,
                         steps.of_plan(device, call, plan, kernels, reasons), "flce.backends.cuda")
    return record, kernels


def choose_distillation(device: DeviceDescription, desc: DistillDescription, entry: TunedEntry,
                        failed: Mapping[tuple[str, str], str] | None = None) -> tuple[CallChoice, KernelChoice]:
    """The same choice for a linear distillation call: cuBLAS writes both heads' logits, the pair row kernels
    (distill_kernels.py) take the passes over them with the cache's blocks and rows in flight, the gradient products
    take their role's family as cross-entropy's do (a family the teacher's head does not fit is passed over where the
    teacher takes a gradient), and cuda/plan.py sizes the chunks."""
    failed = failed or {}
    tuned = sizes.tuned_knobs(entry)
    call = _products_call(desc, desc.student_hidden)
    settings = LaunchSettings(
        launch=tuned.launch or LaunchParams(block_v=sizes.MAX_BLOCK_V), gemm=_gemm_config(device, call, tuned),
        fallback_scan_block=sizes.fallback_scan_block(call.n_rows, call.dtype.itemsize),
        rows_in_flight=tuned.rows_in_flight, pair_registers=tuned.pair_registers or sizes.PAIR_REGISTERS,
        launch_source="cache entry: block_v, num_warps" if tuned.launch else
        f"heuristic: up to {sizes.MAX_BLOCK_V} columns a block, 8 warps from 2048 columns")
    pick = _pick(PRODUCTS, device, call, tuned, settings, failed, {})
    if desc.request.training and desc.cfg.teacher_grad:
        pick = _teacher_fit(pick, device, _products_call(desc, desc.teacher_hidden), PRODUCTS)
    logits = _distillation_logits(device, desc, tuned, settings, failed)
    chains = {PRODUCTS: pick.chain}
    stats_in_gemm = bool(logits.chain) and logits.chain[0].fused
    if stats_in_gemm:
        chains[CHUNK_LOGITS] = logits.chain
    kernels = KernelChoice(chains=chains, settings=settings)
    plan, memory = sizes.distillation_schedule(desc, tuned, stats_in_gemm)
    record = CallChoice(backend="cuda", device=device.text(), inputs=desc.text(), cache=tuned.source, plan=plan,
                        gradients=gradient_timing(desc), memory=memory,
                        steps=steps.of_distillation(device, desc, plan, kernels, call, pick.reason,
                                                    _head_call(desc, desc.student_hidden), logits.reason),
                        kernel_package="flce.backends.cuda", n_rows=desc.n_rows, training=desc.request.training,
                        in_forward=desc.grads_in_forward)
    return record, kernels


def _teacher_fit(pick: RolePick, device: DeviceDescription, teacher_call: CallDescription, of_role: str) -> RolePick:
    """``pick`` without the families the teacher's head does not fit (the student's head chose them)."""
    unfit = {f.name: f.unfit(device, teacher_call, of_role) for f in pick.chain}
    kept = tuple(f for f in pick.chain if unfit[f.name] is None)
    if kept[:1] == pick.chain[:1]:
        return pick
    return RolePick(kept, f"{pick.reason}; the teacher's head: {pick.chain[0].name}: {unfit[pick.chain[0].name]}; "
                          f"so {kept[0].name if kept else 'none'}")


def _distillation_logits(device: DeviceDescription, desc: DistillDescription, tuned: sizes.TunedKnobs,
                         settings: LaunchSettings, failed: Mapping[tuple[str, str], str]) -> RolePick:
    """Who writes both heads' chunk logits: the family cross-entropy's choice gives a chunk's logits (CHUNK_LOGITS,
    the cache's forward_logits / logits_kernel, else the heuristic) where the loss's statistics come from each
    head alone and both heads fit it, its epilogue making each head's statistics; else cuBLAS (no chain)."""
    why = per_head_unfit(desc.cfg, desc.grads_in_forward and not desc.cfg.teacher_grad, reads_teacher=True)
    if why is None and student_reads_teacher(desc.cfg) and _asked(CHUNK_LOGITS, tuned, settings) is None:
        # H200, 8192 x 4096 x 4096/8192 x 128256 bf16: 1.113x / 1.090x the floor against 1.110x / 1.105x, the
        # student's GEMM 1.89 ms against 1.68 with the entropy's sum (it spills; docs/distillation.md).
        why = ("reverse_kl: the student's GEMM reading the teacher's logits measured level with this at teacher H "
               "4096 (flce-autotune times it: forward_logits=fused)")
    if why is not None:
        return RolePick((), f"cuBLAS and the pair kernels' statistics pass: {why}")
    pick = _teacher_fit(_pick(CHUNK_LOGITS, device, _head_call(desc, desc.student_hidden), tuned, settings, failed,
                              {}), device, _head_call(desc, desc.teacher_hidden), CHUNK_LOGITS)
    if not student_reads_teacher(desc.cfg):
        return pick
    # Its fallbacks too: a family that cannot read the teacher's tile cannot take the student's statistics.
    readers = tuple(f for f in pick.chain if f.reads_other_logits)
    if not readers:  # (only fused families read a second head)
        why = f"{pick.chain[0].name if pick.chain else 'no family'} reads no teacher's logits in its epilogue"
        return RolePick((), f"cuBLAS and the pair kernels' statistics pass: {pick.reason}; {why}")
    return RolePick(readers, pick.reason + "; the student's epilogue reads the teacher's logits for E_q[s - t]")


def distillation_entry_for(device: DeviceDescription, desc: DistillDescription) -> TunedEntry:
    return tuned_entry(device.name, "cuda", DISTILLATION_VARIANT, desc.dtype, desc.student_hidden, desc.vocab,
                       desc.n_rows)


def _head_call(desc: DistillDescription, hidden: int) -> CallDescription:
    """A head's chunk logits and softmax statistics as the families read a call (semantics.head_config's options)."""
    return replace(_products_call(desc, hidden), cfg=head_config(desc.cfg))


def _products_call(desc: DistillDescription, hidden: int) -> CallDescription:
    """A head's gradient products as the families read a call: its sizes, dtype and operands' alignment."""
    return CallDescription(n_rows=desc.n_rows, hidden=hidden, vocab=desc.vocab, dtype=desc.dtype,
                           bias=desc.student_bias, rows_aligned=desc.rows_aligned, cfg=LCEConfig(), variant="plain",
                           request=desc.request)


def explain(device: DeviceDescription, call: CallDescription) -> CallChoice:
    """The record for a described call (``Backend.choose``): the autotune cache looked up by the device's
    name, no kernel failed."""
    return choose(device, call, entry_for(device, call))[0]


def entry_for(device: DeviceDescription, call: CallDescription) -> TunedEntry:
    return tuned_entry(device.name, "cuda", call.variant, call.dtype, call.hidden, call.vocab, call.n_rows)


def _asked(role: str, tuned: sizes.TunedKnobs, settings: LaunchSettings) -> tuple[str | None, str] | None:
    """What the cache entry asks of ``role``: (a family name, "fused" for the first fused family that fits, or None
    for no family; the knobs it read), or None where it asks nothing."""
    path = {STATISTICS: tuned.forward_stats, CHUNK_LOGITS: tuned.forward_logits, GRADIENT: tuned.backward_grad}
    kernel = {STATISTICS: tuned.stats_kernel, CHUNK_LOGITS: tuned.logits_kernel,
              PRODUCTS: tuned.grad_gemm_kernel}
    if role == EXPONENTIALS:
        if tuned.chunk_grad is None:
            return None
        if tuned.chunk_grad == LOGITS:
            return None, "cache entry: chunk_grad=logits"
        asked = _asked(CHUNK_LOGITS, tuned, settings)
        if asked is None or asked[0] == CUBLAS:
            return FUSED, "cache entry: chunk_grad=exponentials"
        return asked[0], f"cache entry: chunk_grad=exponentials, {asked[1].removeprefix('cache entry: ')}"
    if path.get(role) == CUBLAS:
        return CUBLAS, f"cache entry: {_PATH_KNOBS[role]}=cublas"
    if kernel.get(role):
        name = kernel[role]
        if name == "triton":  # the Triton GEMM: with TMA where it fits, unless the entry's tiles turn TMA off
            name = "triton_tma" if settings.gemm.tma else "triton"
        return name, f"cache entry: {ROLE_KNOBS[role]}={kernel[role]}"
    if path.get(role) == FUSED:
        return FUSED, f"cache entry: {_PATH_KNOBS[role]}=fused"
    return None


def _pick(role: str, device: DeviceDescription, call: CallDescription, tuned: sizes.TunedKnobs,
          settings: LaunchSettings, failed: Mapping[tuple[str, str], str], picks: Mapping[str, RolePick]) -> RolePick:
    def unusable(family: KernelFamily) -> str | None:
        """Why ``family`` cannot take the role here: it does not fit, or its kernel failed to compile earlier."""
        why = family.unfit(device, call, role)
        error = failed.get((family.name, family.compile_key(role, settings)))
        return why or (f"fallback: it failed to compile here earlier ({error})" if error else None)

    def chain_from(first: KernelFamily, notes: list[str]) -> tuple[KernelFamily, ...]:
        """``first`` (or, where it is unusable, the first usable family down its fallback chain) and the usable
        families after it."""
        chain, family = [], first
        while True:
            if role in family.roles:
                why = unusable(family)
                if why is None:
                    chain.append(family)
                elif not chain:
                    notes.append(f"{family.name}: {why}")
            if family.fallback is None:
                return tuple(chain)
            family = family_named(family.fallback)

    asked = _asked(role, tuned, settings)
    notes: list[str] = []
    chain: tuple[KernelFamily, ...] = ()
    if asked is not None and asked[0] is None:
        return RolePick((), asked[1])
    if asked is not None and asked[0] != FUSED:
        source = asked[1]
        chain = chain_from(family_named(asked[0]), notes)
    else:
        # The heuristic, or a cache entry's "fused": the first registered family that can take the role (and, for
        # the heuristic, that it takes), then that family's fallback chain.
        source = "heuristic" if asked is None else asked[1]
        for family in _heuristic_candidates(role, picks) if asked is None else families_for(role):
            if asked is not None and not family.fused:
                continue
            why = unusable(family) or (family.unpreferred(device, call, role) if asked is None else None)
            if why is None:
                chain = chain_from(family, notes)
                break
            notes.append(f"{family.name}: {why}")
    if not chain and (asked is not None or role not in OPTIONAL_ROLES):
        # Nothing asked for fits: the last registered family (cuBLAS and the row kernels: it fits every call).
        chain = chain_from(families_for(role)[-1], notes)
    taken = chain[0].name if chain else "none"
    if asked is not None and not notes:
        return RolePick(chain, source)
    passed_over = f"; passed over: {'; '.join(notes)}" if notes else ""
    return RolePick(chain, f"{source}: {taken}{passed_over}" if asked is None else f"{source}{passed_over}; so {taken}")


def _heuristic_candidates(role: str, picks: Mapping[str, RolePick]) -> tuple[KernelFamily, ...]:
    """The families the heuristic considers for ``role``, in order. Kept exponentials only beside the family that
    writes the chunk's logits (one multiply a logit in its epilogue instead of a pass over the logits)."""
    if role == EXPONENTIALS:
        logits = picks[CHUNK_LOGITS].chain
        return logits[:1] if logits and EXPONENTIALS in logits[0].roles else ()
    return families_for(role)


def _gemm_config(device: DeviceDescription, call: CallDescription, tuned: sizes.TunedKnobs):
    """The Triton GEMMs' tiles (tuned, else the default), with the gradient GEMM's persistent form where its TMA
    stores can write the gradient rows (16-byte aligned)."""
    base = tuned.gemm or default_gemm_config(device, call.dtype)
    return replace(base, persistent=base.persistent and (call.vocab * call.dtype.itemsize) % 16 == 0)

