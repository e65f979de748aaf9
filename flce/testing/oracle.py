"""The float64 oracle: docs/design.md's contract materialised, the obvious way.

:func:`reference_loss` builds the whole ``[tokens, vocab]`` logits in float64 and calls torch's own
``cross_entropy`` for the cross-entropy part, so any backend (flce's, or a kernel of your own) can
be checked against it::

    from flce.testing import reference_loss
    expected = reference_loss(hidden, weight, target, ignore_index=-100, reduction="mean")
    loss = flce.linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(loss.double(), expected.loss)

It is slow and takes tokens x vocab x 8 bytes: meant for checks at test sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flce.config import LCEConfig, option_names
from flce.errors import InputTypeError
from flce.outputs import LCEOutput

# Options that change the math; flce's other options (memory_budget, precision, batch_invariant, return_*, ...)
# only change how or what is computed, so the oracle accepts and ignores them.
_MATH_OPTIONS = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                 "class_weight", "temperature", "token_scaling", "entropy_weight", "token_weights")
_IGNORED_OPTIONS = tuple(name for name in option_names() if name not in _MATH_OPTIONS)


def reference_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options: Any,
) -> LCEOutput:
    """docs/design.md's contract, materialised in float64.

    Returns an LCEOutput with every field filled whatever the ``return_*`` options say:
    loss (reduced), z_loss (reduced like the loss), token_accuracy (reduced like the loss),
    predicted_tokens, logprobs and entropy (per token, target's shape). loss, logprobs and
    entropy are differentiable with respect to the inputs (which are upcast to float64
    inside, so float64 leaves give float64 gradients). ``token_weights`` (the call's keyword,
    target's shape) multiplies each token's cross-entropy term. The options are flce's, checked as flce
    checks them; those that do not change the math are accepted and ignored.
    """
    unknown = set(options) - set(_MATH_OPTIONS) - set(_IGNORED_OPTIONS)
    if unknown:
        raise InputTypeError(f"reference_loss: unknown options {sorted(unknown)}")
    # flce's own checks, with its messages: a value flce refuses (temperature=0, say) is refused here too.
    config_names = option_names()
    LCEConfig(**{name: value for name, value in options.items() if name in config_names})
    ignore_index = options.get("ignore_index", -100)
    reduction = options.get("reduction", "mean")
    label_smoothing = options.get("label_smoothing", 0.0)
    lse_square_scale = options.get("lse_square_scale", 0.0)
    softcap = options.get("softcap")
    class_weight = options.get("class_weight")
    temperature = options.get("temperature", 1.0)
    token_scaling = options.get("token_scaling", False)
    entropy_weight = options.get("entropy_weight", 0.0)
    token_weights = options.get("token_weights")

    vocab, hidden_size = weight.shape
    x = hidden.double().reshape(-1, hidden_size)
    t = target.reshape(-1).long()
    u = x @ weight.double().T
    if bias is not None:
        u = u + bias.double()
    z = softcap * torch.tanh(u / softcap) if softcap is not None else u
    z = z / temperature
    cw = None if class_weight is None else class_weight.double()

    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0)
    lse = torch.logsumexp(z, dim=-1) if z.shape[0] else z.new_zeros(0)
    target_z = z.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    nll = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction="none")
    ce = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    # torch's weighted mean divides the smoothing part and the rest by the weight sum separately (which
    # matters where that sum is 0): keep them apart.
    smoothing = ce - (1.0 - label_smoothing) * nll
    if token_scaling:
        scale = torch.exp(target_z - lse).detach()
        ce, smoothing = ce * scale, smoothing * scale
    if token_weights is not None:
        weights = token_weights.double().reshape(-1)
        ce, smoothing = ce * weights, smoothing * weights
    ce = torch.where(valid, ce, 0.0)
    smoothing = torch.where(valid, smoothing, 0.0)
    zl = torch.where(valid, lse_square_scale * lse.square(), 0.0)
    log_p = z - lse.unsqueeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    # The entropy term: -entropy_weight * entropy per token, its mean over the counted tokens as the z-loss's.
    bonus = torch.where(valid, -entropy_weight * entropy, 0.0)

    count = valid.sum().double()
    ce_denominator = count if cw is None else torch.where(valid, cw[safe_t], 0.0).sum()
    if reduction == "none":
        loss, z_loss = ce + zl + bonus, zl
    elif reduction == "sum":
        loss, z_loss = ce.sum() + zl.sum() + bonus.sum(), zl.sum()
    else:  # "mean": LCEConfig above refused any other reduction
        z_loss = _mean(zl.sum(), count, count)
        rest = ce.sum() - smoothing.sum()
        loss = (_mean(rest, ce_denominator, count) + _mean(smoothing.sum(), ce_denominator, count) + z_loss
                + _mean(bonus.sum(), count, count))

    argmax = z.argmax(dim=-1) if z.shape[0] else t.new_zeros(0)
    correct = ((argmax == t) & valid).double()
    accuracy = {"none": correct, "sum": correct.sum(), "mean": _mean(correct.sum(), count, count)}[reduction]
    shape = target.shape
    per_token = reduction == "none"
    return LCEOutput(
        loss=loss.reshape(shape) if per_token else loss,
        z_loss=(z_loss.reshape(shape) if per_token else z_loss).detach(),
        token_accuracy=accuracy.reshape(shape) if per_token else accuracy,
        predicted_tokens=torch.where(valid, argmax, -1).reshape(shape),
        logprobs=torch.where(valid, target_z - lse, 0.0).reshape(shape),
        entropy=torch.where(valid, entropy, 0.0).reshape(shape),
    )


def _mean(total: torch.Tensor, denominator: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """total / denominator as torch divides (a class-weight sum may be negative, zero or NaN), and 0 with
    zero gradient when no token was counted."""
    counted = count > 0
    return torch.where(counted, total / torch.where(counted, denominator, 1.0), 0.0)
