"""TRL drop-in: ``trl.kernels.ChunkedLogProbFunction`` (the fused LM head of GRPO, RLOO, KTO, SFT) through flce.

    import trl.trainer.utils
    from flce.integrations.trl import ChunkedLogProbFunction
    trl.trainer.utils._ChunkedLogProbFunction = ChunkedLogProbFunction   # before building the trainer

TRL (1.16.0) scores a batch with ``add_fused_lm_head``: the patched forward calls
``_ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)``, which projects ``[4096, chunk_size]`` tiles with
cuBLAS and folds them into online-softmax statistics. :class:`ChunkedLogProbFunction` has the same
``apply`` and returns the same five tensors, computed by flce's registry:

- ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None, ``targets`` ``[N]``;
  ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` with
  ``softcap(x) = c * tanh(x / c)`` when ``final_logit_softcapping = c`` is given.
- Returns ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[N]``, None
  where not named in ``outputs`` (``logprobs`` always): ``logprobs = log softmax(z)[target]``,
  ``entropy = -sum_v p_v log p_v`` (both float32, float64 for float64 inputs, differentiable into
  ``hidden``, ``weight`` and ``bias``), ``log_sum_sq_probs = log sum_v p_v**2`` and
  ``mean_logits = mean_v z_v`` (float32 / float64, detached), ``is_top1`` (bool: the target is the
  first index of the largest ``z``).
- Under autocast the projection runs in the autocast dtype, as TRL's. The weight (and bias)
  gradient is accumulated in float32 over token chunks for bf16/fp16 weights, as TRL's is.
- ``chunk_size`` is TRL's vocabulary tile width; flce plans its own chunks and blocks (autotune
  cache or heuristic, ``memory_budget``), so it is checked and otherwise unused.
- ``log_sum_sq_probs`` costs a second, forward-only pass: ``log sum p**2 = logsumexp(2z) -
  2 logsumexp(z) = 2 log p_t(z) - log p_t(2z)``, flce's log-prob at temperature ``T`` and ``T/2``.
- ``mean_logits`` comes from flce's ``return_logit_stats`` (the statistics pass keeps the sum of
  ``z``); the CUDA and Ascend kernels do not keep it yet, so there a call that asks for it runs on
  flce's reference backend (pure PyTorch on the same device; the registry says so once).
- Targets: TRL passes only real token ids (the masked positions are dropped or clamped to 0);
  here ``-100`` gives log-prob 0, entropy 0, ``is_top1`` False and no gradient, any other target
  outside ``[0, V)`` raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

import flce
from flce.config import LCEConfig
from flce.errors import InputError, InputTypeError

# TRL's optional per-token outputs, in the order of its return tuple after the log-probs.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_KNOWN_OUTPUTS = ("log_probs", *OPTIONAL_OUTPUTS)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: Iterable[str] = OPTIONAL_OUTPUTS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """TRL's ``ChunkedLogProbFunction.apply``: ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)``."""
    outputs = tuple(outputs)
    unknown = sorted(set(outputs) - set(_KNOWN_OUTPUTS))
    if unknown:
        raise InputError(f"outputs={outputs!r}: unknown names {unknown}; expected names among {_KNOWN_OUTPUTS}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise InputError(f"chunk_size={chunk_size!r}: expected a positive int")
    hidden, bias, scaled = _fold_logit_scale(hidden, bias, temperature, final_logit_softcapping, logit_scale)
    low_precision = weight.dtype in (torch.float16, torch.bfloat16)
    out = flce.linear_cross_entropy(
        hidden, weight, targets, bias, reduction="none", return_logprobs=True,
        return_entropy="entropy" in outputs, return_token_accuracy="is_top1" in outputs,
        return_logit_stats="mean_logits" in outputs, accum_dtype=torch.float32 if low_precision else None, **scaled,
    )
    log_sum_sq_probs = None
    if "log_sum_sq_probs" in outputs:
        with torch.no_grad():
            at_half = flce.linear_cross_entropy(
                hidden, weight, targets, bias, reduction="none", return_logprobs=True,
                **dict(scaled, temperature=scaled["temperature"] / 2),
            )
        log_sum_sq_probs = 2 * out.logprobs.detach() - at_half.logprobs
    mean_logits = out.logit_stats[..., 2] if "mean_logits" in outputs else None
    is_top1 = out.token_accuracy.bool() if "is_top1" in outputs else None
    return out.logprobs, out.entropy, log_sum_sq_probs, mean_logits, is_top1


class ChunkedLogProbFunction:
    """Stands in for TRL's autograd Function: TRL only calls its ``apply``."""

    apply = staticmethod(chunked_logprobs)


def _fold_logit_scale(
    hidden: torch.Tensor, bias: torch.Tensor | None, temperature: float, softcap: float | None, logit_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float | None]]:
    """flce's (hidden, bias, temperature, softcap) for TRL's ``softcap(s * u) / T``.

    For s > 0 the scale folds into the options exactly: ``c tanh(s u / c) / T = (c/s) tanh(u /
    (c/s)) / (T/s)``. Otherwise (TRL keeps a configured 0 as is) hidden and bias are scaled. A value the
    folding cannot carry is refused naming TRL's argument, not the option it would have become.
    """
    LCEConfig(temperature=temperature, softcap=softcap)  # as given: flce's checks and messages
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) or not math.isfinite(logit_scale):
        raise InputTypeError(f"logit_scale={logit_scale!r}: expected a finite real number")
    if logit_scale > 0:
        folded = {"temperature": temperature / logit_scale,
                  "softcap": None if softcap is None else softcap / logit_scale}
        for name, value in folded.items():
            if value is not None and not 0.0 < value < math.inf:
                given = temperature if name == "temperature" else softcap
                raise InputError(f"logit_scale={logit_scale!r} with {name}={given!r}: {name} / logit_scale = "
                                 f"{value!r}; expected a finite value > 0")
        return hidden, bias, folded
    scaled_bias = None if bias is None else bias * logit_scale
    return hidden * logit_scale, scaled_bias, {"temperature": temperature, "softcap": softcap}
