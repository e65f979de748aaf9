"""Selected-token log-probabilities (``selected_ids``): ``log softmax(z)[ids[..., k]]`` for a few
candidate ids per token, from the statistics pass and one dot product per (token, id).

``selected_logprobs[i, k] = z[i, s_ik] - lse_i``. The call's own log-prob ``z[i, y_i] - lse_i``
(``return_logprobs``, computed by whatever backend runs the call) carries the lse and its gradient
(``-p * g``, the engine's coefficient ``a``); the two logits ``z[i, s_ik]`` and ``z[i, y_i]`` are
dot products of the token's hidden state with one weight row each (:class:`SelectedLogits`), so

    selected_logprobs[i, k] = (z[i, s_ik] - z[i, y_i]) + logprob_i

needs no kernel of any backend to know about the ids, and the one-hot part of the gradient (``g``
at column ``s_ik``) is the dot products' own backward. Cost: ``N (K + 1) H`` multiply-adds, no logits.
The difference of the two dot products and the target logit inside ``logprob_i`` cancel to within
rounding of the GEMM's summation order (``1e-6`` relative in fp32, ``1e-15`` in fp64).

Under vocabulary parallelism each rank computes the dot products of the ids in its shard (0 for
the others) and the forward sums them over the group; backward completes their grad_hidden over the
group, as flce's engine does for its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flce.config import LCEConfig
from flce.errors import InputError, InputTypeError
from flce.inputs import FlatInputs
from flce.semantics import statistics_dtype

# Bytes of gathered weight rows ([rows, K + 1, H] in the math dtype) one step may hold.
_GATHER_BYTES = 64 << 20


def check_selected_ids(ids: Any, token_shape: torch.Size, vocab: int, device: torch.device) -> torch.Tensor:
    """``ids`` as int64 ``[*token_shape, K]`` on ``device``, or a ValueError/TypeError naming it.
    The range [0, V) is checked on the host for CPU tensors; on an accelerator, and while torch.compile traces
    (reading values would break the graph), by a device-side assertion when the call runs (a host check there
    would wait for the device)."""
    if not isinstance(ids, torch.Tensor):
        raise InputTypeError(f"selected_ids: expected an integer tensor [..., K], got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputTypeError(f"selected_ids: expected an integer tensor of token ids, got dtype {ids.dtype}")
    if ids.dim() != len(token_shape) + 1 or ids.shape[:-1] != token_shape:
        raise InputError(f"selected_ids: shape {tuple(ids.shape)}; expected [*target.shape, K] = "
                         f"{(*token_shape, 'K')}")
    if ids.device != device:
        raise InputError(f"selected_ids: on {ids.device}, expected the inputs' device {device}")
    if ids.numel() and (ids.device.type != "cpu" or torch.compiler.is_compiling()):
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"selected_ids: expected ids in [0, V={vocab})")
    elif ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise InputError(f"selected_ids: ids span [{low}, {high}]; expected ids in [0, V={vocab})")
    return ids.long()


def selected_logprobs(flat: FlatInputs, cfg: LCEConfig, ids: torch.Tensor, logprobs: torch.Tensor,
                      vocab_offset: int, rows_per_step: int | None = None) -> torch.Tensor:
    """``[*token_shape, K]`` selected log-probs (0 on ignored tokens) from the call's flat ``[N]``
    log-probs. ``rows_per_step`` fixes the token rows of each dot-product step (batch-invariant
    calls); None sizes steps by memory."""
    n_rows, k = flat.target.shape[0], ids.shape[-1]
    valid = flat.target != cfg.ignore_index
    columns = torch.cat([ids.reshape(n_rows, k), torch.where(valid, flat.target, 0).unsqueeze(1)], dim=1)
    u = SelectedLogits.apply(flat.hidden, flat.weight, flat.bias, columns, vocab_offset, cfg.process_group,
                             rows_per_step)
    z = u if cfg.softcap is None else cfg.softcap * torch.tanh(u / cfg.softcap)
    z = z / cfg.temperature
    picked = (z[:, :k] - z[:, k:]) + logprobs.reshape(n_rows, 1).to(z.dtype)
    return torch.where(valid.unsqueeze(1), picked, 0.0).reshape(*flat.token_shape, k)


class SelectedLogits(torch.autograd.Function):
    """``u[i, j] = hidden[i] . weight[columns[i, j]] + bias[columns[i, j]]`` (global ids; this
    rank's shard only, summed over ``group``), in the statistics dtype."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                columns: torch.Tensor, vocab_offset: int, group: Any, rows_per_step: int | None) -> torch.Tensor:
        local, owned = _local_columns(columns, vocab_offset, weight.shape[0])
        math = statistics_dtype(hidden.dtype)
        u = torch.zeros(columns.shape, dtype=math, device=hidden.device)
        steps = _row_steps(columns, hidden.shape[1], math, rows_per_step)
        if weight.shape[0]:
            for rows in steps:
                u[rows] = torch.einsum("rh,rkh->rk", hidden[rows].to(math), weight[local[rows]].to(math))
            if bias is not None:
                u += bias.to(math)[local]
        u = torch.where(owned, u, 0.0)
        if group is not None:
            dist.all_reduce(u, group=group)
        ctx.save_for_backward(hidden, weight, local, owned)
        ctx.has_bias, ctx.group, ctx.steps = bias is not None, group, steps
        return u

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local, owned = ctx.saved_tensors
        grad = torch.where(owned, grad, 0.0)
        math = grad.dtype
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.zeros(hidden.shape, dtype=math, device=hidden.device)
            if weight.shape[0]:
                for rows in ctx.steps:
                    grad_hidden[rows] = torch.einsum("rk,rkh->rh", grad[rows], weight[local[rows]].to(math))
            if ctx.group is not None:
                dist.all_reduce(grad_hidden, group=ctx.group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=math, device=weight.device)
            for rows in ctx.steps if weight.shape[0] else ():
                per_pair = grad[rows].unsqueeze(-1) * hidden[rows].to(math).unsqueeze(1)  # [r, K, H]
                grad_weight.index_add_(0, local[rows].reshape(-1), per_pair.reshape(-1, hidden.shape[1]))
            grad_weight = grad_weight.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = torch.zeros(weight.shape[0], dtype=math, device=weight.device)
            if weight.shape[0]:
                grad_bias.index_add_(0, local.reshape(-1), grad.reshape(-1))
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _local_columns(columns: torch.Tensor, vocab_offset: int, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = columns - vocab_offset
    owned = (local >= 0) & (local < shard_rows)
    return torch.where(owned, local, 0), owned


def _row_steps(columns: torch.Tensor, hidden_size: int, math: torch.dtype, rows_per_step: int | None) -> list[slice]:
    n_rows, k = columns.shape
    if rows_per_step is None:
        rows_per_step = max(1, _GATHER_BYTES // max(1, k * hidden_size * math.itemsize))
    return [slice(s, min(s + rows_per_step, n_rows)) for s in range(0, n_rows, rows_per_step)]
