"""One call as the engine runs it: the backend's kernels and plan, what to differentiate, and the
state forward leaves for backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flce.config import LCEConfig
from flce.engine.choice import CallChoice, CallDescription, DeviceDescription, MemoryPlan, Step
from flce.engine.objective import Objective
from flce.engine.plans import Plan, PlanRequest
from flce.semantics import Denominators, PartialRowStats, RowStats

StatsCombiner = Callable[[PartialRowStats], PartialRowStats]


@dataclass(frozen=True)
class Sharding:
    """Vocabulary sharding of a tensor-parallel call: this rank's slice, the combine step, and
    the reduction that completes grad_hidden (each rank's covers its shard only). The schedules start
    that reduction once grad_hidden's last rows are written, so that it runs beside the last weight-gradient
    product, and wait for it before they return grad_hidden (rows.GradAccumulator); ``start_grad_hidden_reduce``
    returns the wait. Gradients formed in forward are reduced there, before backward scales them by grad_output:
    the same grad_output on every rank, as each rank holds the same loss."""

    vocab_offset: int
    global_vocab: int
    combine: StatsCombiner
    start_grad_hidden_reduce: Callable[[torch.Tensor], Callable[[], None]]


@dataclass(frozen=True)
class EngineCall:
    """Everything about a call that is not a tensor autograd must track. ``kernels`` implement
    flce.engine.kernels.RowKernels and the capabilities the plan requires; ``choice`` is the planner's
    record of the decision (flce.engine.choice: the plan, its memory, each step's kernel and why)."""

    kernels: object
    cfg: LCEConfig
    plan: Plan
    plain: bool
    token_shape: torch.Size
    sharding: Sharding | None = None
    choice: CallChoice | None = None

    def with_plan(self, plan: Plan) -> EngineCall:
        """The call with ``plan`` instead of the planner's (an engine path's adjustment), in its record too."""
        return replace(self, plan=plan, choice=None if self.choice is None else self.choice.with_plan(plan))

    @property
    def vocab_offset(self) -> int:
        return self.sharding.vocab_offset if self.sharding else 0

    def vocab(self, local_vocab: int) -> int:
        """The vocabulary size the loss is defined over (the global one when sharded)."""
        return self.sharding.global_vocab if self.sharding else local_vocab

    def combined(self, partial: PartialRowStats) -> PartialRowStats:
        """Statistics over the whole vocabulary (all ranks' shards when sharded)."""
        return self.sharding.combine(partial) if self.sharding else partial


@dataclass(frozen=True)
class GradTargets:
    """Which gradients to produce (inputs that do not require grad are skipped)."""

    hidden: bool
    weight: bool
    bias: bool

    @property
    def any(self) -> bool:
        return self.hidden or self.weight or self.bias


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass
class ForwardState:
    """The outputs of forward, and what backward needs: the row statistics of all rows (deferred
    schedules), the logits of the leading rows a TokenChunks plan kept, or the unscaled gradients
    that an in-forward schedule computed."""

    loss: torch.Tensor | None
    z_loss: torch.Tensor | None
    extras: dict
    denoms: Denominators
    stats: RowStats | None = None
    saved_logits: torch.Tensor | None = None
    # Where the kept rows hold exponentials instead of logits (a statistics-first objective's, TokenChunks
    # chunk_grad "exponentials"): their gradient at a unit upstream scale is saved_row_scale[:, None] * them.
    saved_row_scale: torch.Tensor | None = None
    grads: Grads | None = None
    # Forward's objective knowing every row's statistics, kept with them: a statistics-first objective's gradients
    # in forward take their scales from it (flce.engine.schedule); a deferred backward makes its own.
    objective: Objective | None = None

    def for_backward(self) -> ForwardState:
        """What backward reads, without the outputs forward returned. An autograd Function's output
        kept on its ctx is a reference cycle (output -> grad_fn -> ctx -> output), which Python frees
        only when its cycle collector runs: until then it would hold the whole state, the kept logits
        or the in-forward gradients, beyond the step that made them."""
        return replace(self, loss=None, z_loss=None, extras={})


def grads_in_forward_allowed(cfg: LCEConfig) -> bool:
    """The in-forward schedules need a scalar loss as the only differentiable output: log-probs or entropy
    returned differentiable (their upstream gradients arrive in backward only) keep the gradients in backward,
    ``detach_extras=True`` returns them detached."""
    return cfg.reduction != "none" and (cfg.detach_extras or not (cfg.return_logprobs or cfg.return_entropy))


def logits_kept_for_gradients(cfg: LCEConfig, request: PlanRequest) -> bool:
    """Whether a plan's saved rows of logits are kept: a deferred backward follows, or forward takes every row's
    statistics before the gradients (``request.statistics_first``) and turns the kept logits into them."""
    return request.training and (request.statistics_first or not grads_in_forward_allowed(cfg))


def gradient_timing(cfg: LCEConfig, training: bool, statistics_first: bool = False) -> str:
    """When a call's gradients are computed, and why: explain's ``gradients:`` line (every engine path decides
    by :func:`grads_in_forward_allowed`)."""
    if not training:
        return "none (no gradient follows)"
    if grads_in_forward_allowed(cfg) and statistics_first:
        return ("in forward, after every row's statistics (a sequence-level ratio needs its whole sequence's "
                "log-probs); backward scales them by grad_output")
    if grads_in_forward_allowed(cfg):
        return "in forward (the scalar loss is the only differentiable output; backward scales them by grad_output)"
    if cfg.reduction == "none":
        return "in backward (reduction='none': each token's upstream gradient arrives in backward)"
    return ("in backward (log-probs or entropy returned differentiable: their upstream gradients arrive in backward; "
            "detach_extras=True returns them detached and computes the gradients in forward)")


def call_record(backend: str, device: DeviceDescription, call: CallDescription, cache: str, plan: Plan,
                memory: MemoryPlan, steps: list[Step], kernel_package: str) -> CallChoice:
    """A planner's record of its decision for ``call`` on ``device`` (every backend's planner makes it here)."""
    training = call.request.training
    return CallChoice(backend=backend, device=device.text(), inputs=call.text(), cache=cache, plan=plan,
                      gradients=gradient_timing(call.cfg, training, call.request.statistics_first), memory=memory,
                      steps=tuple(steps),
                      kernel_package=kernel_package, n_rows=call.n_rows, training=training,
                      in_forward=training and grads_in_forward_allowed(call.cfg),
                      statistics_first=training and call.request.statistics_first)
