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

Beside it, GRPOTrainer's policy loss in one flce call through a patched model (:func:`add_policy_head`,
:class:`GRPOPolicyLossMixin`); the distillation trainers' losses (GKDTrainer's :class:`GKDDistillationLossMixin`,
DistillationTrainer's :func:`chunked_divergence_loss`) are in flce/integrations/trl_distillation.py and importable
from here too.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterable

import torch

import flce
from flce.config import LCEConfig, check_finite_real
from flce.errors import InputError

# The distillation trainers' drop-ins live in their own module; importable from here, as the docs show them.
from flce.integrations.trl_distillation import GKDDistillationLossMixin as GKDDistillationLossMixin
from flce.integrations.trl_distillation import chunked_divergence_loss as chunked_divergence_loss
from flce.policy.api import PolicyCall, TrlSettings
from flce.policy.semantics import clip_flags

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
    check_finite_real("logit_scale", logit_scale)
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


# --------------------------------------------------------------------------- GRPOTrainer's loss

# The inputs a GRPOTrainer batch may carry beside the text: the multimodal ones go through the model's own forward.
_MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                      "mm_token_type_ids", "image_position_ids", "spatial_shapes", "num_tiles", "num_images")
# Logit scalings of some model families that TRL's fused head applies and flce's policy head does not (yet).
_UNHANDLED_SCALINGS = ("output_multiplier", "lm_head_multiplier", "logits_scaling")
_ORIGINAL_FORWARD = "_flce_policy_original_forward"


def add_policy_head(model: torch.nn.Module) -> None:
    """Patch ``model.forward`` (a Hugging Face causal LM) so that ``model(..., flce_policy=head)`` runs the backbone
    and returns ``head(hidden_states, lm_head.weight, lm_head.bias, logit_options)``, the logits never made
    (``logit_options``: flce's temperature-free ``softcap`` and the model's ``logit_scale``); without
    ``flce_policy`` the forward is the original one. Called through the trainer's wrapped model (DDP, FSDP), the
    wrappers see an ordinary forward, as with TRL's own ``add_fused_lm_head``."""
    text_config = model.config.get_text_config()
    unhandled = [name for name in _UNHANDLED_SCALINGS if getattr(text_config, name, None) is not None]
    if unhandled:
        raise ValueError(f"add_policy_head: the model's config sets {unhandled}, a logit scaling flce's policy head "
                         "does not apply; use TRL's own loss for this model")
    scaling = {"softcap": getattr(text_config, "final_logit_softcapping", None),
               "logit_scale": getattr(text_config, "logit_scale", None) or 1.0}
    # Vision-language models of transformers < 5 expose their language backbone as ``model``.
    backbone_name = "base_model" if text_config is model.config else "model"

    @functools.wraps(type(model).forward)
    def forward(self: torch.nn.Module, *args: object, flce_policy: Callable | None = None, **kwargs: object):
        if flce_policy is None:
            return self.__dict__[_ORIGINAL_FORWARD](*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = getattr(self, backbone_name)(*args, **kwargs).last_hidden_state
        head = self.get_output_embeddings()
        return flce_policy(hidden.to(head.weight.device), head.weight, head.bias, scaling)

    # The forward it replaces is kept on the model, not in the closure: a copy of the model (copy.deepcopy, as a
    # reference model is often made) then runs its own forward, not the one of the model it was copied from.
    model.__dict__.setdefault(_ORIGINAL_FORWARD, model.forward)
    model.forward = types.MethodType(forward, model)


class GRPOPolicyLossMixin:
    """TRL's ``GRPOTrainer._compute_loss`` in one flce call: mix in before GRPOTrainer and patch the model first,

        class Trainer(GRPOPolicyLossMixin, trl.GRPOTrainer): ...
        add_policy_head(model); trainer = Trainer(model=model, ...)

    The same loss and metrics as TRL 1.16's (every loss type but vespo, both importance-sampling levels,
    ``delta``, the KL to the reference model, the vLLM importance-sampling correction, the static entropy bonus,
    the gradient-accumulation and process normalisers). Settings flce does not state (top_entropy_quantile < 1,
    off_policy_mask_threshold, use_bias_correction_kl, the adaptive entropy bonus, an MoE aux loss, multimodal
    inputs) raise ``ValueError`` at the first step: leave this mixin out for them."""

    def _compute_loss(self, model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        self._check_flce_supports(inputs)
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = completion_ids.size(1)
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        # TRL divides dapo and cispo by num_items_in_batch / processes (times accumulation / steps per generation in
        # training), the others by the accumulation steps; the entropy bonus always by the accumulation steps.
        items = None
        if self.loss_type in ("dapo", "cispo"):
            items = inputs["num_items_in_batch"]
            scale = self.accelerator.num_processes * (
                self.args.steps_per_generation / accumulation if mode == "train" else 1.0)
        else:
            scale = 1.0 / accumulation
        entropy_weight = self.entropy_coef / accumulation / scale if self._entropy_bonus_enabled else 0.0
        rollout = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            rollout = inputs["importance_sampling_ratio"].expand_as(mask)
        options = dict(
            loss_type=self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            delta=self.args.delta, beta=self.beta, importance_sampling_level=self.importance_sampling_level,
            max_completion_length=self.max_completion_length, entropy_weight=entropy_weight,
            sapo_temperature_pos=self.args.sapo_temperature_pos, sapo_temperature_neg=self.args.sapo_temperature_neg)
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None

        def head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: dict) -> PolicyCall:
            # flce.linear_policy_loss, keeping the per-token tensors the metrics read
            settings = TrlSettings.of(dict(
                options, **_logit_options(self.temperature, scaling["softcap"], scaling["logit_scale"])))
            return settings.call(hidden[:, -keep - 1:-1], weight, completion_ids, inputs["advantages"], mask, old, ref,
                                 rollout, None, bias, items, hidden.device.type, None, None)

        with self.accelerator.autocast():
            call = model(input_ids=input_ids, attention_mask=attention_mask, flce_policy=head)
        self._log_flce_metrics(call, inputs, mask, mode, scale, entropy_weight)
        return call.output.loss * scale

    def _check_flce_supports(self, inputs: dict) -> None:
        unsupported = [name for name, on in (
            ("top_entropy_quantile < 1", self.top_entropy_quantile < 1.0),
            ("off_policy_mask_threshold", self.off_policy_mask_threshold is not None),
            ("use_bias_correction_kl", getattr(self.args, "use_bias_correction_kl", False)),
            ("use_adaptive_entropy", getattr(self, "use_adaptive_entropy", False)),
            ("an MoE aux loss", self.aux_loss_enabled),
            ("multimodal inputs", any(inputs.get(k) is not None for k in _MULTIMODAL_INPUTS)),
        ) if on]
        if unsupported:
            raise ValueError(f"GRPOPolicyLossMixin: flce's policy loss does not state {', '.join(unsupported)}; "
                             "train without the mixin (TRL's own _compute_loss) for them")

    def _log_flce_metrics(self, call: PolicyCall, inputs: dict, mask: torch.Tensor, mode: str, scale: float,
                          entropy_weight: float) -> None:
        """TRL's logged metrics from the call's (with their host synchronisations, as TRL's logging makes)."""
        metrics, accelerator, out = self._metrics[mode], self.accelerator, call.output
        by_sequence = self.importance_sampling_level == "sequence" and inputs["advantages"].dim() == 1

        def global_mean(local_mean: torch.Tensor, per_sequence: bool = False) -> float:
            count = torch.tensor(float(mask.shape[0]), device=mask.device) if per_sequence else mask.sum().float()
            totals = accelerator.reduce(torch.stack([local_mean * count, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            metrics["kl"].append(global_mean(out.mean_kl))
        metrics["entropy"].append(global_mean(out.mean_entropy))
        if self._entropy_bonus_enabled:
            policy = out.loss.detach() + entropy_weight * out.mean_entropy
            policy = policy * scale if self.loss_type in ("dapo", "cispo") else policy
            metrics["policy_loss"].append(accelerator.gather(policy).nanmean().item())
            if mode == "train" and accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            metrics["clip_ratio/low_mean"].append(global_mean(out.clip_ratio_low, by_sequence))
            metrics["clip_ratio/high_mean"].append(global_mean(out.clip_ratio_high, by_sequence))
            metrics["clip_ratio/region_mean"].append(global_mean(out.clip_ratio, by_sequence))
            low, high = _per_sequence_clip_fractions(call, by_sequence)
            metrics["clip_ratio/low_min"].append(_nan_extreme(accelerator.gather(low), torch.min))
            metrics["clip_ratio/high_max"].append(_nan_extreme(accelerator.gather(high), torch.max))
        elif self.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(global_mean(out.clip_ratio_high, by_sequence))


def _logit_options(temperature: float, softcap: float | None, logit_scale: float) -> dict[str, float | None]:
    """flce's (temperature, softcap) for ``softcap(s * u) / T`` (_fold_logit_scale's, for s > 0)."""
    if not logit_scale > 0:
        raise ValueError(f"logit_scale={logit_scale}: flce's policy head folds a positive logit scale only")
    return {"temperature": temperature / logit_scale, "softcap": None if softcap is None else softcap / logit_scale}


@torch.no_grad()
def _per_sequence_clip_fractions(call: PolicyCall, by_sequence: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's fraction of clipped tokens below and above (TRL's clip_ratio/low_min and high_max read
    them; NaN for a sequence without tokens), from the policy's clip flags (flce.policy.semantics) on the call's
    tokens; ``by_sequence``: one ratio and advantage per sequence, its flags its first token's."""
    batch, length = call.output.logprobs.shape
    mask = call.inputs.mask
    low, high = clip_flags(call.output.logprobs.reshape(-1), call.tokens, mask != 0)
    if by_sequence:  # one value per sequence, as TRL's (B, 1)
        return low.reshape(batch, length)[:, 0].float(), high.reshape(batch, length)[:, 0].float()
    counts = mask.reshape(batch, length).sum(-1)
    return tuple((flags.reshape(batch, length).float() * mask.reshape(batch, length)).sum(-1) / counts
                 for flags in (low, high))


def _nan_extreme(values: torch.Tensor, extreme: Callable) -> float:
    """TRL's nanmin / nanmax: the extreme of the values that are not NaN, NaN where all are."""
    kept = values[~torch.isnan(values)]
    return float("nan") if kept.numel() == 0 else extreme(kept).item()
