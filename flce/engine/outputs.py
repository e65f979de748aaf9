"""The six user outputs of a call, in the order and shapes both autograd paths return them, and the
logit statistics, which only the eager path returns (flce.engine.run refuses them under torch.compile)."""

from __future__ import annotations

import torch
from torch import Tensor

from flce.config import LCEConfig
from flce.engine.call import ForwardState
from flce.outputs import LCEOutput
from flce.semantics import statistics_dtype


def flat_outputs(state: ForwardState, cfg: LCEConfig, hidden: Tensor) -> tuple[Tensor, ...]:
    """(loss, z_loss, token_accuracy, predicted_tokens, logprobs, entropy): per-token ones flat [N],
    each one its own tensor (a fresh empty one where not asked: op outputs may not alias)."""
    out_dtype = statistics_dtype(hidden.dtype)

    def empty(dtype: torch.dtype = out_dtype) -> Tensor:
        return hidden.new_empty(0, dtype=dtype)

    def in_out_dtype(t: Tensor) -> Tensor:
        return t.to(out_dtype) if t.is_floating_point() else t

    ex = state.extras
    return (
        in_out_dtype(state.loss),
        in_out_dtype(state.z_loss) if cfg.return_z_loss else empty(),
        in_out_dtype(ex["token_accuracy"]) if cfg.return_token_accuracy else empty(),
        ex["predicted_tokens"] if cfg.return_predicted_tokens else empty(torch.int64),
        in_out_dtype(ex["logprobs"]) if cfg.return_logprobs else empty(),
        in_out_dtype(ex["entropy"]) if cfg.return_entropy else empty(),
    )


def shape_outputs(outputs: tuple[Tensor, ...], cfg: LCEConfig, token_shape: torch.Size) -> tuple[Tensor, ...]:
    """Per-token outputs (and the reduction="none" loss, z_loss, accuracy) take the target's shape."""
    loss, z_loss, acc, pred, logprobs, entropy = outputs
    per_row = cfg.reduction == "none"

    def shaped(t: Tensor, asked: bool, per_token: bool) -> Tensor:
        return t.reshape(token_shape) if asked and per_token else t

    return (
        shaped(loss, True, per_row),
        shaped(z_loss, cfg.return_z_loss, per_row),
        shaped(acc, cfg.return_token_accuracy, per_row),
        shaped(pred, cfg.return_predicted_tokens, True),
        shaped(logprobs, cfg.return_logprobs, True),
        shaped(entropy, cfg.return_entropy, True),
    )


def logit_stats_output(state: ForwardState, cfg: LCEConfig, hidden: Tensor, token_shape: torch.Size) -> Tensor:
    """(max, min, mean) of z per token, ``[*token_shape, 3]``; an empty tensor where not asked."""
    if not cfg.return_logit_stats:
        return hidden.new_empty(0, dtype=statistics_dtype(hidden.dtype))
    return state.extras["logit_stats"].to(statistics_dtype(hidden.dtype)).reshape(*token_shape, 3)


def as_result(outputs: tuple[Tensor, ...], cfg: LCEConfig, logit_stats: Tensor | None = None) -> Tensor | LCEOutput:
    """The loss, or an LCEOutput when extras were asked."""
    loss, z_loss, acc, pred, logprobs, entropy = outputs
    if not cfg.returns_extras:
        return loss
    return LCEOutput(
        loss=loss,
        z_loss=z_loss if cfg.return_z_loss else None,
        token_accuracy=acc if cfg.return_token_accuracy else None,
        predicted_tokens=pred if cfg.return_predicted_tokens else None,
        logprobs=logprobs if cfg.return_logprobs else None,
        entropy=entropy if cfg.return_entropy else None,
        logit_stats=logit_stats if cfg.return_logit_stats else None,
    )
