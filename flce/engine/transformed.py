"""The backward under a function transform: batched gradients (``torch.autograd.grad(...,
is_grads_batched=True)``, ``torch.func.vmap`` over a vjp, ``jacrev``) and ``torch.func.grad``.

There the upstream gradients are wrapped tensors (batched, or tracked by a transform), and the
schedules' kernels cannot take them: they write in place into plain buffers (the saved logits, the
gradients computed in forward) and the CPU's scale check reads grad_output's value, for which a
batched tensor has no rule. This path is out of place and made of torch ops that have batching
rules: each chunk's logits are recomputed, d loss / d u comes from semantics.py's formula, and the
three gradient products follow. Per batch entry it holds a chunk's [n, V] gradient in the statistics
dtype: it is for jacobians and per-sample gradients, not for training steps.
"""

from __future__ import annotations

import torch

from flce.config import LCEConfig
from flce.engine.call import EngineCall, ForwardState, Grads, GradTargets
from flce.engine.plans import TokenChunks
from flce.engine.rows import chunk_logits, logits_dtype, slice_stats
from flce.gradients import GradCoefficients, grad_coefficients, upstream_scales
from flce.inputs import FlatInputs
from flce.semantics import statistics_dtype


def is_transformed(tensor: torch.Tensor | None) -> bool:
    """Whether a tensor is wrapped by a function transform (torch.func) or batched by
    is_grads_batched (which uses the older vmap, whose tensors carry the Batched dispatch key)."""
    if tensor is None:
        return False
    return (torch._C._functorch.is_functorch_wrapped_tensor(tensor)
            or torch._C._functorch.is_legacy_batchedtensor(tensor))


def check_first_order(tensors: tuple[torch.Tensor | None, ...]) -> None:
    """Refuse inputs tracked by two or more torch.func derivative transforms (hessian's inner parts,
    jacrev of jacrev, grad of grad): the outer one would see flce's gradients, computed by its own
    kernels from plain tensors, as constants, and return zeros for the second derivative."""
    functorch = torch._C._functorch
    levels = set()
    for tensor in tensors:
        while tensor is not None and functorch.is_functorch_wrapped_tensor(tensor):
            if functorch.is_gradtrackingtensor(tensor):
                levels.add(functorch.maybe_get_level(tensor))
            tensor = functorch.get_unwrapped(tensor)
    if len(levels) > 1:
        raise RuntimeError(
            f"flce: the inputs are tracked by {len(levels)} nested torch.func derivative transforms, but the "
            "gradients flce computes are first-order only (flce computes them with its own "
            "kernels, which have no derivative themselves): a second derivative (hessian, jacrev of "
            "jacrev, grad of grad) is not supported")


def check_unsharded(call: EngineCall) -> None:
    if call.sharding is not None:
        raise RuntimeError(
            "flce: batched or transformed gradients (is_grads_batched=True, torch.func.vmap / jacrev / grad) "
            "of a vocab-parallel call are not supported: its backward all-reduces grad_hidden in place, and "
            "torch.distributed's collectives have no batching rule")


def scaled(grads: Grads, scale: torch.Tensor) -> Grads:
    """The in-forward gradients times grad_output, out of place (the unscaled ones stay intact)."""
    return tuple(None if g is None else torch.mul(g, scale) for g in grads)


def backward(call: EngineCall, flat: FlatInputs, state: ForwardState, wanted: GradTargets,
             grad_loss: torch.Tensor, grad_logprobs: torch.Tensor | None,
             grad_entropy: torch.Tensor | None) -> Grads:
    """Deferred gradients from forward's row statistics, recomputing every chunk's logits (the kept
    logits, if any, stay untouched for an ordinary backward)."""
    check_unsharded(call)
    cfg, target = call.cfg, flat.target
    assert state.stats is not None
    n_rows, vocab = target.shape[0], flat.weight.shape[0]
    step = call.plan.tokens_per_chunk if isinstance(call.plan, TokenChunks) else n_rows
    sums = GradSums(flat.hidden, flat.weight, flat.bias, wanted)
    for start in range(0, n_rows, max(1, step)):
        rows = slice(start, min(start + max(1, step), n_rows))
        t = target[rows]
        scales = upstream_scales(cfg, state.denoms, grad_loss, rows, t.shape[0], flat.token_weight)
        coeffs = grad_coefficients(
            slice_stats(state.stats, rows), t, cfg, vocab, scales,
            None if grad_logprobs is None else grad_logprobs.reshape(-1)[rows],
            None if grad_entropy is None else grad_entropy.reshape(-1)[rows])
        logits = chunk_logits(flat, rows, flat.hidden.new_empty(t.shape[0], vocab,
                                                                dtype=logits_dtype(flat.weight.dtype, cfg)))
        sums.add(grad_logits(logits, t, cfg, state.stats.lse[rows], coeffs), rows)
    return sums.result()


class GradSums:
    """The gradients of one head (hidden, weight, bias) from its chunks' d loss / d u, out of place: the GEMMs
    take d loss / d u in the weight's dtype, as the kernels write it; the bias sums the math-dtype values."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wanted: GradTargets):
        self.hidden, self.weight, self.bias, self.wanted = hidden, weight, bias, wanted
        self.hidden_rows: list[torch.Tensor] = []
        self.grad_weight: torch.Tensor | None = None
        self.grad_bias: torch.Tensor | None = None

    def add(self, grad_math: torch.Tensor, rows: slice) -> None:
        """A chunk's d loss / d u (in the math dtype) for the hidden rows ``rows``."""
        grad = grad_math.to(self.weight.dtype)
        if self.wanted.hidden:
            self.hidden_rows.append(grad @ self.weight)
        if self.wanted.weight:
            part = grad.transpose(-1, -2) @ self.hidden[rows]
            self.grad_weight = part if self.grad_weight is None else self.grad_weight + part
        if self.wanted.bias:
            part = grad_math.sum(-2)
            self.grad_bias = part if self.grad_bias is None else self.grad_bias + part

    def result(self) -> Grads:
        wanted = self.wanted
        grad_hidden = grad_weight = grad_bias = None
        if wanted.hidden:
            grad_hidden = torch.cat(self.hidden_rows, -2) if self.hidden_rows else torch.zeros_like(self.hidden)
        if wanted.weight:
            grad_weight = torch.zeros_like(self.weight) if self.grad_weight is None else self.grad_weight
        if wanted.bias:
            grad_bias = torch.zeros_like(self.bias) if self.grad_bias is None else self.grad_bias.to(self.bias.dtype)
        return grad_hidden, grad_weight, grad_bias


def grad_logits(logits: torch.Tensor, target: torch.Tensor, cfg: LCEConfig, lse: torch.Tensor,
                coeffs: GradCoefficients) -> torch.Tensor:
    """d loss / d u of one chunk's raw logits u [n, V], out of place: semantics.py's
    p * (a - h (z - lse)) - onehot * d - e * w with z = cap(u) / T, chained through the cap and T."""
    math = statistics_dtype(logits.dtype)
    u = logits.to(math)
    capped = u if cfg.softcap is None else cfg.softcap * torch.tanh(u / cfg.softcap)
    z = capped / cfg.temperature if cfg.temperature != 1.0 else capped
    log_p = z - lse.to(math).unsqueeze(-1)
    p = torch.exp(log_p)

    def col(x: torch.Tensor) -> torch.Tensor:
        return x.to(math).unsqueeze(-1)

    grad = p * col(coeffs.a) if coeffs.h is None else p * (col(coeffs.a) - col(coeffs.h) * log_p)
    columns = torch.arange(u.shape[-1], device=u.device)
    grad = grad - (columns == target.unsqueeze(-1)).to(math) * col(coeffs.d)
    if coeffs.e is not None:
        grad = grad - col(coeffs.e) * (1.0 if cfg.class_weight is None else cfg.class_weight.to(math))
    if cfg.softcap is not None:
        grad = grad * (1.0 - torch.square(capped / cfg.softcap))
    return grad / cfg.temperature if cfg.temperature != 1.0 else grad
