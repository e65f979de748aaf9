"""The one place that picks a schedule: by the type of the plan a backend's planner chose."""

from __future__ import annotations

import torch

from flce.config import LCEConfig
from flce.engine import all_rows, token_chunks, vocab_blocks
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
from flce.engine.objective import Objective, backward_objective, forward_objective
from flce.engine.plans import AllRows, PlanRequest, TokenChunks, VocabBlocks
from flce.inputs import FlatInputs
from flce.registry import Backend
from flce.semantics import Denominators, denominators, statistics_dtype


def planned_call(backend: Backend, flat: FlatInputs, cfg: LCEConfig, variant: str,
                 request: PlanRequest) -> EngineCall:
    """The backend planner's kernels and plan for a call, checked against the backend's capabilities."""
    call = backend.plan_call(flat, cfg, variant, request)
    check_capabilities(call.plan, backend.capabilities, backend.name)
    return call


def check_capabilities(plan: object, capabilities: frozenset[str], backend: str) -> None:
    """A planner offers a plan only to backends with the capabilities it needs: a plan that asks for
    more is a planner bug, reported before any kernel runs."""
    missing = plan.requires - capabilities
    if missing:
        raise RuntimeError(f"flce: backend {backend!r} planned {plan} but lacks the kernel capabilities "
                           f"{sorted(missing)} (it has {sorted(capabilities)})")


def run_forward(call: EngineCall, flat: FlatInputs, grads_in_forward: GradTargets | None,
                backward_follows: bool) -> ForwardState:
    """Loss and extras; with grads_in_forward (a scalar loss is the only differentiable output and
    gradients follow), the unscaled gradients too; backward_follows=False: inference."""
    dtype = statistics_dtype(flat.weight.dtype)
    # A sharded call's targets are checked against the global vocabulary by the distributed wrapper.
    counts = call.kernels.count_tokens(flat.target, call.cfg.ignore_index, dtype,
                                       None if call.sharding else flat.weight.shape[0])
    denoms = denominators(flat.target, call.cfg, dtype, counts)
    objective = forward_objective(call.cfg, call.vocab(flat.weight.shape[0]), flat, denoms,
                                  precompute=grads_in_forward is not None)
    plan = call.plan
    if isinstance(plan, AllRows):
        assert grads_in_forward is None, "AllRows computes no gradients"
        return all_rows.forward(call, flat, plan, denoms, objective, keep_stats=backward_follows)
    if isinstance(plan, VocabBlocks):
        return vocab_blocks.forward(call, flat, plan, denoms, objective, grads_in_forward=grads_in_forward)
    if grads_in_forward is not None and objective.statistics_first:
        return _statistics_then_gradients(call, flat, plan, denoms, objective, grads_in_forward)
    return token_chunks.forward(call, flat, plan, denoms, objective, grads_in_forward=grads_in_forward,
                                backward_follows=backward_follows)


def _statistics_then_gradients(call: EngineCall, flat: FlatInputs, plan: TokenChunks, denoms: Denominators,
                               objective: Objective, wanted: GradTargets) -> ForwardState:
    """A TokenChunks plan under an objective whose gradients need every row's statistics (a sequence-level
    policy loss): forward as a deferred call does (the statistics, keeping the plan's saved rows of logits),
    then the gradients as its backward makes them, the kept rows from their logits and the others recomputed."""
    state = token_chunks.forward(call, flat, plan, denoms, objective, grads_in_forward=None, backward_follows=True)
    assert state.objective is not None
    state.grads = token_chunks.backward(call, flat, plan, state, wanted, state.objective)
    state.stats = state.objective = None
    return state


def run_backward(call: EngineCall, flat: FlatInputs, state: ForwardState, wanted: GradTargets,
                 grad_loss: torch.Tensor | None, grad_logprobs: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> Grads:
    """Deferred gradients from the state forward left and the upstream gradients."""
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=state.denoms.z_loss.dtype, device=flat.target.device)
    objective = backward_objective(call.cfg, call.vocab(flat.weight.shape[0]), flat, state.denoms, grad_loss,
                                   grad_logprobs, grad_entropy)
    plan = call.plan
    if isinstance(plan, VocabBlocks):
        return vocab_blocks.backward(call, flat, plan, state, wanted, objective)
    assert isinstance(plan, TokenChunks), f"{plan} is a forward-only plan: no backward follows it"
    return token_chunks.backward(call, flat, plan, state, wanted, objective)
