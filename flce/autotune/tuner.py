"""The tuner: times each candidate of a backend's tuning space against its heuristic, per shape.

For every (dtype, H, V, tokens, variant) it measures, with fresh random inputs:

* the floor: the three GEMMs of a forward+backward (``x @ W.T``, ``G @ W``, ``G.T @ x``);
* the heuristic: the backend's planner with nothing cached (the baseline);
* every candidate the backend's :class:`~flce.autotune.spaces.TuningSpace` for the shape's loss lists (with
  ``--memory-budget``, also those it sizes to the budget), skipping (and
  counting) those over the memory budget, those that fail or run out of memory, and those whose
  loss or hidden gradient disagree with the heuristic's;
* with the winner, the deferred schedule with the logits kept versus recomputed, which sets the
  entry's logits-save limit.

Times are medians of forward+backward calls, from device events on accelerators (the L2 cache
emptied before each call) and ``time.perf_counter`` on the CPU, on the benchmark tools' inputs for
the shape (both from :mod:`flce.testing.measure`). Every time is checked before it is used: it may
not be below half the floor (else it is measured again, and discarded if it stays so), and its
repeats should agree (else it is measured again and the steadiest attempt kept). A candidate that
beats the heuristic, kept logits that beat recomputing them, and a forward-only overlay that beats
the space's first, must do so again in a second, interleaved measurement, so one noisy run neither
picks a candidate or an overlay nor sets the logits-save limit (an inconclusive keep-versus-recompute
leaves the limit to the planner). The heuristic is kept unless
a candidate beats it by more than the noise margin, so a tuned entry is never slower than the
heuristic as measured; a kept heuristic is stored as the knob values it chose (the space's
``heuristic``), so the entry states what ran.

Every configuration runs as a user's call would, without ``memory_budget`` (so the heuristic
measured is the one dispatch uses); the budget only decides which configurations may be chosen.
It is ``--memory-budget`` when given, else the default logits-save limit
``max(1 GiB, min(4 GiB, total memory / 8))`` or the heuristic's own working memory if that is
larger, so a tuned entry never needs much more memory than the heuristic unless asked to.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch

from flce.autotune.devices import device_name, dtype_name
from flce.autotune.lookup import override_params
from flce.autotune.measurement import (
    Run,
    Skip,
    check_agreement,
    params_text,
    round4,
    size_text,
    versions,
)
from flce.autotune.progress import Progress
from flce.autotune.requests import Params, ShapeResult, TuneRequest
from flce.autotune.schema import Entry, Scalar
from flce.autotune.spaces import TuneShape, tunable_backends, tuning_spaces
from flce.autotune.workload import (
    MAX_REPEAT_SPREAD,
    MEASURE_ATTEMPTS,
    Floors,
    Workload,
    WorkloadInputs,
    make_inputs,
    release_memory,
    time_call,
)
from flce.engine.memory import MiB, default_logits_save_limit

# A candidate must beat the heuristic by this fraction to replace it; same for keeping logits.
NOISE_MARGIN = 0.02
# Plausibility of a measurement. A forward+backward cannot take less than this fraction of the
# three GEMMs it contains (a GEMM faster than cuBLAS's is at most a few tens of percent faster);
# below it the timing is wrong (a concurrent process, a clock that skipped), not the kernel fast.
MIN_FLOOR_RATIO = 0.5


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """``backend``, or the backend dispatch picks for the device, once it is known to have a tuning space."""
    from flce.registry import candidates_for

    if backend is None:
        candidates = candidates_for(device.type)
        if not candidates.backends:
            raise ValueError(f"device={device}: no available backend serves it")
        backend = candidates.backends[0].name
    else:
        candidates_for(device.type, backend)  # raises with the reason when it cannot run here
    if backend not in tunable_backends():
        raise ValueError(f"backend={backend!r} has no tuning space registered (tunable: {tunable_backends()}); "
                         "register one with flce.autotune.register_tuning_space or pass --backend")
    return backend


class Tuner:
    """Runs a :class:`TuneRequest`; ``on_result`` sees each shape as soon as it is measured (the CLI
    saves it then, so an interrupted run keeps what it finished)."""

    def __init__(self, request: TuneRequest, progress: Progress | None = None,
                 on_result: Callable[[ShapeResult], None] | None = None):
        self.request = request
        self.backend = resolve_backend(request.device, request.backend)
        self.spaces = tuning_spaces(self.backend, request.variants)  # by loss kind; each shape reads its own
        self.progress = progress or Progress(enabled=False)
        self.on_result = on_result
        self.warmup, self.repeats = request.timing()
        self._versions = versions()
        self._device_name = device_name(request.device)
        self.results: list[ShapeResult] = []  # filled as shapes finish, also when run() is interrupted
        self.floors = Floors(self.warmup, self.repeats)

    def shapes(self) -> list[TuneShape]:
        r = self.request
        return [TuneShape(r.device, dtype, h, v, t, variant)
                for dtype in r.dtypes for h in r.hiddens for v in r.vocabs for t in r.tokens for variant in r.variants]

    def run(self) -> list[ShapeResult]:
        plans = [(shape, self._candidates(shape)) for shape in self.shapes()]
        # per loss kind: floor, heuristic, keep/recompute, forward-only overlays
        steps = {k: 2 + 2 * s.tunes_logits_save_limit + len(s.inference_overlays) for k, s in self.spaces.items()}
        self.progress.start(sum(len(c) + steps[shape.kind] for shape, c in plans))
        self.results = []
        try:
            for shape, candidates in plans:
                result = self._tune_shape(shape, candidates)
                self.results.append(result)
                if self.on_result is not None:
                    self.on_result(result)
        finally:
            self.progress.close()
        return self.results

    def _candidates(self, shape: TuneShape) -> list[Params]:
        """The space's candidates, and with --memory-budget those it sizes to the budget (in order,
        without repeats)."""
        space = self.spaces[shape.kind]
        candidates = list(space.candidates(shape, self.request.quick))
        budget = self.request.memory_budget
        if budget is not None and space.budget_candidates is not None:
            candidates += [p for p in space.budget_candidates(shape, budget) if p not in candidates]
        return candidates

    # One shape -------------------------------------------------------------------------------

    def _tune_shape(self, shape: TuneShape, candidates: list[Params]) -> ShapeResult:
        result = ShapeResult(shape=shape, backend=self.backend)
        label = f"{dtype_name(shape.dtype)} H={shape.hidden} V={shape.vocab} T={shape.tokens} {shape.variant}"
        space = self.spaces[shape.kind]
        after_heuristic = len(candidates) + (2 if space.tunes_logits_save_limit else 0)
        try:
            inputs = make_inputs(shape, self.request.seed)  # Skip: the shape's inputs do not fit in memory
            self.progress.step(f"{label}: floor")
            result.floor_ms = self.floors.of(shape, inputs)
            self.progress.step(f"{label}: heuristic")
            baseline = self._run(shape, inputs, None, deferred=False, budget=None)
        except Skip as skip:
            result.skipped[f"heuristic {skip.reason}"] += 1
            result.first_error = result.first_error or f"heuristic: {skip.detail or skip.reason}"
            self.progress.advance(after_heuristic)
            return result
        result.heuristic_ms = baseline.ms
        result.heuristic_params = self._heuristic_params(shape)
        budget = self._budget(shape, baseline)
        heuristic_fits = baseline.working_bytes is None or baseline.working_bytes <= budget

        best_params: Params | None = None
        best = baseline if heuristic_fits else None
        for params in candidates:
            self.progress.step(f"{label}: {params_text(params)}")
            result.tried += 1
            try:
                run = self._run(shape, inputs, params, deferred=False, budget=budget, reference=baseline)
            except Skip as skip:
                result.skipped[skip.reason] += 1
                if skip.detail and result.first_error is None:
                    result.first_error = f"{params_text(params)}: {skip.detail}"
                continue
            # A heuristic that fits keeps its place unless beaten by more than the noise margin.
            beats_heuristic = not heuristic_fits or run.ms < baseline.ms * (1 - NOISE_MARGIN)
            if best is None or (run.ms < best.ms and beats_heuristic):
                best, best_params = run, params
        if best is None:
            result.first_error = result.first_error or (
                f"neither the heuristic ({size_text(baseline.working_bytes)}) nor any candidate fits the memory "
                f"budget of {size_text(budget)}")
            self.progress.advance(2 if space.tunes_logits_save_limit else 0)
            return result
        if best_params is not None and heuristic_fits:
            best, baseline = self._confirm_winner(shape, inputs, best_params, baseline, budget, result)
            best_params = None if best is baseline else best_params
            result.heuristic_ms = baseline.ms
        result.best_ms = best.ms
        result.peak_mib = None if best.working_bytes is None else best.working_bytes / MiB
        result.peak_kind = best.peak_kind

        limit, save_ms, recompute_ms = None, None, None
        if space.tunes_logits_save_limit:
            limit, save_ms, recompute_ms = self._logits_save_limit(shape, inputs, best_params, best, budget, label,
                                                                   result)
        overlay, inference_ms = self._inference_overlay(shape, inputs, best_params, label, result)
        result.floor_ms = self.floors.of(shape, inputs)  # lower where a time below half of it re-measured it
        measured: dict[str, Scalar] = {
            "ms": round4(best.ms), "heuristic_ms": round4(baseline.ms), "floor_ms": round4(result.floor_ms),
            "speedup": round4(baseline.ms / best.ms), "peak_mib": round4(result.peak_mib),
            "peak": result.peak_kind, "chosen": "heuristic" if best_params is None else "candidate",
            "candidates": result.tried, "skipped": sum(result.skipped.values()),
            "keep_logits_ms": round4(save_ms), "recompute_logits_ms": round4(recompute_ms),
            **{f"inference_ms_{name}": round4(ms) for name, ms in inference_ms},
            "memory_budget_bytes": budget, "budget_from": "argument" if self.request.memory_budget else "default",
            "repeats": self.repeats,
            **self._versions,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        result.entry = Entry(
            device=self._device_name, backend=self.backend, variant=shape.variant,
            dtype=dtype_name(shape.dtype), hidden=shape.hidden, vocab=shape.vocab, tokens=shape.tokens,
            # A winning heuristic is stored as the knobs it chose, so the entry states what ran.
            params={**(best_params or result.heuristic_params or {}), **overlay}, logits_save_limit_bytes=limit,
            measured={k: v for k, v in measured.items() if v is not None},
        )
        return result

    def _confirm_winner(self, shape: TuneShape, inputs: WorkloadInputs, params: Params, baseline: Run, budget: int,
                        result: ShapeResult) -> tuple[Run, Run]:
        """Time the heuristic and the winning candidate once more, in turn; keep the candidate only if it wins
        by the noise margin again. Returns (chosen, heuristic) runs of that one round, stored side by side."""
        try:
            again_heuristic = self._run(shape, inputs, None, deferred=False, budget=None)
            again = self._run(shape, inputs, params, deferred=False, budget=budget, reference=baseline)
        except Skip as skip:
            result.skipped[f"confirmation {skip.reason}"] += 1
            return baseline, baseline
        if again.ms < again_heuristic.ms * (1 - NOISE_MARGIN):
            return again, again_heuristic
        result.skipped["win not confirmed"] += 1
        return baseline, baseline

    def _budget(self, shape: TuneShape, heuristic: Run) -> int:
        """--memory-budget, else the default logits-save limit or the heuristic's working memory."""
        if self.request.memory_budget is not None:
            return self.request.memory_budget
        return max(default_logits_save_limit(shape.device), heuristic.working_bytes or 0)

    def _logits_save_limit(
        self, shape: TuneShape, inputs: WorkloadInputs, params: Params | None, chosen: Run, budget: int, label: str,
        result: ShapeResult,
    ) -> tuple[int | None, float | None, float | None]:
        """Time the deferred schedule keeping forward's logits and recomputing them. Keeping wins
        only when it is faster by the noise margin and the logits fit the budget; the limit then
        admits this shape's logits, else it is 0 (always recompute)."""
        logits_bytes = shape.tokens * shape.vocab * shape.dtype.itemsize
        working = chosen.working_bytes or 0
        self.progress.step(f"{label}: recompute logits")
        try:
            recompute = self._run(shape, inputs, params, deferred=True, budget=None, limit=0)
        except Skip as skip:
            result.skipped[f"recompute {skip.reason}"] += 1
            self.progress.advance(1)
            return None, None, None
        self.progress.step(f"{label}: keep logits")
        if logits_bytes + working > budget:
            result.skipped["keep logits over budget"] += 1
            return 0, None, recompute.ms
        try:
            keep = self._run(shape, inputs, params, deferred=True, budget=None, limit=logits_bytes)
        except Skip as skip:
            result.skipped[f"keep logits {skip.reason}"] += 1
            return 0, None, recompute.ms
        keep_wins = keep.ms < recompute.ms * (1 - NOISE_MARGIN)
        # A second, interleaved round: the limit moves away from the planner's default only when both
        # rounds agree, so one noisy run cannot set it (to 0, or to keeping logits that do not pay).
        try:
            recompute_again = self._run(shape, inputs, params, deferred=True, budget=None, limit=0)
            keep_again = self._run(shape, inputs, params, deferred=True, budget=None, limit=logits_bytes)
        except Skip as skip:
            result.skipped[f"logits confirmation {skip.reason}"] += 1
            return None, keep.ms, recompute.ms
        if keep_wins != (keep_again.ms < recompute_again.ms * (1 - NOISE_MARGIN)):
            result.skipped["logits-save limit inconclusive"] += 1
            return None, keep.ms, recompute.ms
        if not keep_wins:
            return 0, keep.ms, recompute.ms
        # Logits this size or a little larger (the bucket's neighbours) are kept; the budget still holds.
        return min(max(default_logits_save_limit(shape.device), logits_bytes), budget - working), keep.ms, recompute.ms

    def _inference_overlay(
        self, shape: TuneShape, inputs: WorkloadInputs, params: Params | None, label: str, result: ShapeResult,
    ) -> tuple[Params, list[tuple[str, float]]]:
        """Time a forward-only call (no gradient) with each of the space's inference overlays on top
        of the chosen params; the first overlay stands unless another beats it by the noise margin in
        this round and again in a second round that times the two in turn. Returns the overlay and the
        times to store (the confirmation round's under "confirm ...")."""
        timed: list[tuple[Params, float]] = []
        for overlay in self.spaces[shape.kind].inference_overlays:
            self.progress.step(f"{label}: forward only {params_text(overlay)}")
            ms = self._forward_only_ms(shape, inputs, params, overlay, result)
            if ms is not None:
                timed.append((overlay, ms))
        if not timed:
            return {}, []
        first, first_ms = timed[0]
        best_overlay, best_ms = first, first_ms
        for overlay, ms in timed[1:]:
            if ms < best_ms * (1 - NOISE_MARGIN):
                best_overlay, best_ms = overlay, ms
        stored = [(params_text(o), ms) for o, ms in timed]
        if best_overlay is first:
            return dict(first), stored
        # One round once picked a path 5% slower on the same GPU (docs/design-notes.md): it must win again.
        first_again = self._forward_only_ms(shape, inputs, params, first, result)
        best_again = self._forward_only_ms(shape, inputs, params, best_overlay, result)
        if first_again is None or best_again is None:
            result.skipped["forward-only confirmation failed"] += 1
            return dict(first), stored
        stored += [(f"confirm {params_text(first)}", first_again), (f"confirm {params_text(best_overlay)}", best_again)]
        if best_again < first_again * (1 - NOISE_MARGIN):
            return dict(best_overlay), stored
        result.skipped["forward-only win not confirmed"] += 1
        return dict(first), stored

    def _forward_only_ms(self, shape: TuneShape, inputs: WorkloadInputs, params: Params | None, overlay: Params,
                         result: ShapeResult) -> float | None:
        """A forward-only call's time with ``overlay`` on top of ``params``; None (counted, the first error
        kept) where the path fails here, as a failing candidate is skipped."""
        try:
            workload = Workload(shape, inputs, self.backend, deferred=True)
            with override_params({**(params or {}), **overlay}, backend=self.backend), torch.no_grad():
                ms, _, _ = time_call(workload.forward, shape.device, self.warmup, self.repeats)
        except Exception as exc:  # a path that fails to compile here is skipped, as candidates are
            release_memory(shape.device)
            result.skipped["forward only failed"] += 1
            result.first_error = result.first_error or f"forward only {params_text(overlay)}: {exc}"[:300]
            return None
        return ms

    # Measurements ----------------------------------------------------------------------------

    def _run(self, shape: TuneShape, inputs: WorkloadInputs, params: Params | None, *, deferred: bool,
             budget: int | None, limit: int | None = None, reference: Run | None = None) -> Run:
        """Time one configuration; raises Skip (with the reason) instead of failing. ``budget``
        skips it when its estimated or measured working memory is larger."""
        bytes_of = self.spaces[shape.kind].working_bytes  # the space's estimate of a configuration's memory
        estimate = None if bytes_of is None else bytes_of(shape, params or self._heuristic_params(shape) or {})
        if budget is not None and estimate is not None and estimate > budget:
            raise Skip("over budget")
        try:
            workload = Workload(shape, inputs, self.backend, deferred)
            with override_params(params, limit, backend=self.backend):
                loss, grad_hidden = workload.values()  # also the first (compiling) call
                ms, peak = self._checked_time(workload, shape, inputs)
        except torch.OutOfMemoryError:
            release_memory(shape.device)
            raise Skip("out of memory") from None
        except Skip:
            raise
        except Exception as exc:  # a candidate that fails to compile or launch is skipped, not fatal
            release_memory(shape.device)
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise Skip("failed", f"{type(exc).__name__}: {first_line}") from None
        working, kind = estimate, "estimated" if estimate is not None else "unknown"
        if peak is not None:
            working, kind = max(0, peak), "measured"
        if budget is not None and working is not None and working > budget:
            raise Skip("over budget")
        if reference is not None:
            check_agreement(shape.dtype, reference, loss, grad_hidden)
        return Run(ms=ms, working_bytes=working, peak_kind=kind, loss=loss,
                    grad_hidden=grad_hidden if reference is None else None)

    def _checked_time(self, workload: Workload, shape: TuneShape, inputs: WorkloadInputs) -> tuple[float, int | None]:
        """_time, measured again (up to MEASURE_ATTEMPTS times) while it is below MIN_FLOOR_RATIO x
        the floor or its repeats disagree. Of the plausible attempts the steadiest is kept (noise
        alone discards nothing: the confirmation rounds guard the decisions); raises Skip when no
        attempt is plausible."""
        plausible: list[tuple[float, float, int | None]] = []
        problem = ""
        floor = self.floors.of(shape, inputs)
        for _ in range(MEASURE_ATTEMPTS):
            ms, peak, spread = time_call(workload, shape.device, self.warmup, self.repeats, reset=inputs.clear_grads)
            if floor and ms < MIN_FLOOR_RATIO * floor:
                # Either time may be the wrong one; noise only ever adds time, so the floor is
                # measured again too and the smaller floor kept.
                floor = self.floors.measure_again(shape, inputs)
            if floor and ms < MIN_FLOOR_RATIO * floor:
                problem = f"{ms:.4g} ms is {ms / floor:.2f}x the floor of {floor:.4g} ms (at least {MIN_FLOOR_RATIO}x)"
                continue
            plausible.append((spread, ms, peak))
            if spread <= MAX_REPEAT_SPREAD:
                break
        if not plausible:
            raise Skip("implausible timing", f"{problem}, {MEASURE_ATTEMPTS} times")
        _, ms, peak = min(plausible, key=lambda attempt: attempt[0])
        return ms, peak

    def _heuristic_params(self, shape: TuneShape) -> Params | None:
        """The knobs the backend's planner picks without the cache, when its space says."""
        heuristic = self.spaces[shape.kind].heuristic
        if heuristic is None:
            return None
        with override_params(None, backend=self.backend):
            return dict(heuristic(shape))
