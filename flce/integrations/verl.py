"""verl drop-in: ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` through flce.

    from flce.integrations.verl import linear_cross_entropy
    log_probs, entropy = linear_cross_entropy(hidden_states, lm_head.weight, labels, temperature, "none")

verl (0.9.1) computes the PPO actor's per-token log-probabilities and entropy with a Triton
kernel that needs CUDA, contiguous inputs and a hidden size that is a multiple of 128; its
Hugging Face models call it from ``forward_with_triton_backend`` and its Megatron models from
``model_forward_fused``. This function has the same signature and returns the same tensors,
computed by flce's registry (so on the CPU, CUDA, Ascend, any hidden size, any strides):

- ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (or this rank's vocabulary shard), ``labels``
  ``[...]`` with one global token id per position of ``hidden``.
- Returns ``(logprobs, entropy)``, both 1-D ``[N]`` with ``N`` the number of tokens (hidden's
  leading dimensions flattened, as verl's kernel returns them), float32 (float64 for float64
  inputs, which verl's kernel does not take). ``logprobs[i] = log softmax(z_i)[labels[i]]`` and
  ``entropy[i] = -sum_v p_iv log p_iv`` with ``z = hidden @ weight.T / temperature``.
- ``reduction``: ``"none"`` gives per-token log-probs; ``"sum"`` / ``"mean"`` give their sum /
  mean over the ``N`` tokens as a 0-d tensor, as verl's kernel does; ``entropy`` stays per token.
  Case-insensitive, as verl's.
- Gradients flow from both outputs, with any upstream gradient, into ``hidden`` and ``weight``
  (in their dtypes).
- ``dist_process_group`` (tensor parallelism): ``weight`` is this rank's contiguous vocabulary
  shard, shards in rank order; ``labels`` hold global ids. ``logprobs`` and ``entropy`` are the
  full-vocabulary values on every rank, and ``weight``'s gradient is this rank's rows of the full
  gradient. ``hidden``'s gradient differs per rank from verl's but sums to the same: verl's
  kernel returns this rank's partial gradient (its shard's contribution) and leaves the sum over
  the group to the caller (``gather_from_sequence_parallel_region`` before the call, whose
  backward reduce-scatters); flce completes the gradient itself (one all-reduce of ``N x H``),
  so this function hands every rank ``1 / world_size`` of it and the caller's sum is the full
  gradient, as with verl's kernel.
- Labels: verl's kernel leaves a label outside ``[0, V)`` undefined (its callers roll
  ``input_ids``, so every label is a token). Here ``-100`` gives log-prob 0, entropy 0 and no
  gradient; any other out-of-range label raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import flce
from flce.errors import InputError
from flce.policy.api import PolicyCall, PolicyInputs, TokenWeights, policy_config, policy_loss_of_tokens
from flce.policy.checks import FlatPolicyTensors
from flce.policy.options import PolicyOptions
from flce.policy.semantics import aggregation_weights, kl_term, log_ratio, policy_rows

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy``: ``(logprobs, entropy)`` of ``hidden @ weight.T / temperature``."""
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise InputError(f"reduction={reduction!r}: expected one of {_REDUCTIONS} (any case)")
    world_size = 1 if dist_process_group is None else dist.get_world_size(dist_process_group)
    if world_size > 1:
        hidden = _ShareGrad.apply(hidden, world_size)
    out = flce.linear_cross_entropy(
        hidden, weight, labels, reduction="none", temperature=temperature, process_group=dist_process_group,
        return_logprobs=True, return_entropy=True,
    )
    logprobs, entropy = out.logprobs.reshape(-1), out.entropy.reshape(-1)
    if reduction.lower() == "sum":
        logprobs = logprobs.sum()
    elif reduction.lower() == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``world_size``: flce's grad_hidden is
    complete on every rank, and verl's callers sum it over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, world_size: int) -> torch.Tensor:
        ctx.world_size = world_size
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.world_size, None



# --------------------------------------------------------------------------- the PPO actor's loss

# verl's policy loss modes (verl.trainer.ppo.core_algos, 0.9.1) that flce's policy loss states exactly.
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo", "gpg")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl's kl_loss_type names -> flce's estimators (a "+" suffix: the value from it, k2's gradient).
KL_LOSS_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl",
                 "k3": "low_var_kl"}
# verl clamps the log ratio to [-20, 20] before exp (vanilla, cispo, sapo); its GSPO clamps the combined log
# ratio above at 10.
_LOG_RATIO_BOUND = 20.0
_GSPO_LOG_RATIO_MAX = 10.0


def ppo_loss(
    config: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, old_log_prob: torch.Tensor,
    advantages: torch.Tensor, response_mask: torch.Tensor, rollout_is_weights: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None, temperature: float = 1.0, bias: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None, dist_process_group: dist.ProcessGroup | None = None,
    memory_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """verl's PPO actor loss (``verl.workers.utils.losses.ppo_loss``: the policy loss of
    ``config.policy_loss.loss_mode``, minus ``entropy_coeff`` times the aggregated entropy, plus ``kl_loss_coef``
    times the aggregated ``kl_loss_type`` KL when ``use_kl_loss``) from the LM head's input, in one flce call.

    ``config``: verl's ActorConfig (or any object with its fields: clip_ratio, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, loss_agg_mode, loss_scale_factor, entropy_coeff, tau_pos, tau_neg, use_kl_loss, kl_loss_type,
    kl_loss_coef, policy_loss.loss_mode, global_batch_info). ``hidden`` [bs, response_length, H] and
    ``labels``, ``old_log_prob``, ``advantages``, ``response_mask`` (and ``rollout_is_weights``,
    ``ref_log_prob``) [bs, response_length]; or the packed form, [N, H] and [N] with ``sequence_ids`` [N].
    Returns ``(loss, metrics)``: verl's metric names, 0-d detached tensors (verl's loss functions call .item(),
    a host synchronisation each; these leave that to the caller), ``kl_coef`` a float.

    What differs from verl's code: an empty batch gives 0 where verl's token-mean divides 0 by 0; the rest is
    verl's arithmetic (its log-ratio clamps, dual clip and sequence counts included)."""
    mode = _field(_field(config, "policy_loss", {}), "loss_mode", "vanilla")
    if mode not in POLICY_LOSS_MODES:
        raise ValueError(f"config.policy_loss.loss_mode={mode!r}: flce states verl's {POLICY_LOSS_MODES}; the "
                         "others (clip_cov, kl_cov, geo_mean, dppo_*, dro, bypass_mode) run through verl's own code")
    agg_mode = _field(config, "loss_agg_mode", "token-mean")
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"config.loss_agg_mode={agg_mode!r}: expected one of {LOSS_AGG_MODES}")
    options = _policy_options(config, mode)
    entropy_coeff = float(_field(config, "entropy_coeff", 0.0))
    batch = _batch_info(config)

    def weights(flat: FlatPolicyTensors) -> TokenWeights:
        aggregated = _aggregation(agg_mode, flat, batch)
        # verl's sapo aggregates its policy term by sequence whatever loss_agg_mode says (the KL and entropy not).
        policy = _aggregation("seq-mean-token-mean", flat, batch) if mode == "sapo" else aggregated
        return TokenWeights(policy, None if entropy_coeff == 0 else -entropy_coeff * aggregated, aggregated)

    cfg = policy_config(temperature=temperature, memory_budget=memory_budget, process_group=dist_process_group,
                        entropy=entropy_coeff != 0)
    tensors = PolicyInputs(advantages, response_mask, None if mode == "gpg" else old_log_prob,
                           ref_log_prob if options.beta else None, rollout_is_weights, sequence_ids)
    call = policy_loss_of_tokens(hidden, weight, labels, bias, tensors, cfg, options, weights,
                                 device_type=hidden.device.type)
    metrics = _metrics(mode, call, entropy_coeff)
    return call.output.loss, metrics


def _field(obj: Any, name: str, default: Any) -> Any:
    """A config field from an object or a mapping (verl's configs are both)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _batch_info(config: Any) -> dict[str, Any]:
    """verl's global_batch_info (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor), defaulted."""
    info = dict(_field(config, "global_batch_info", None) or {})
    info.setdefault("dp_size", 1)
    info.setdefault("loss_scale_factor", _field(config, "loss_scale_factor", None))
    return info


def _policy_options(config: Any, mode: str) -> PolicyOptions:
    clip = _field(config, "clip_ratio", 0.2)
    low = _field(config, "clip_ratio_low", None)
    high = _field(config, "clip_ratio_high", None)
    low, high = clip if low is None else low, clip if high is None else high
    kl: dict[str, Any] = {}
    if _field(config, "use_kl_loss", False):
        kind = _field(config, "kl_loss_type", "low_var_kl")
        if kind.removesuffix("+") not in KL_LOSS_TYPES:
            raise ValueError(f"config.kl_loss_type={kind!r}: expected one of {tuple(KL_LOSS_TYPES)}, optionally "
                             "with a '+' (k2's gradient)")
        kl = dict(beta=float(_field(config, "kl_loss_coef", 0.001)), kl=KL_LOSS_TYPES[kind.removesuffix("+")],
                  kl_straight_through=kind.endswith("+"))
    bounds = dict(ratio_low=1.0 - float(low), ratio_high=1.0 + float(high))
    clamp = dict(log_ratio_min=-_LOG_RATIO_BOUND, log_ratio_max=_LOG_RATIO_BOUND)
    if mode == "vanilla":
        dual_clip = float(_field(config, "clip_ratio_c", 3.0))
        if not dual_clip > 1.0:
            raise ValueError(f"config.clip_ratio_c={dual_clip}: the dual clip's lower bound must exceed 1 (verl)")
        return PolicyOptions(term="clip", delta=dual_clip, **bounds, **clamp, **kl)
    if mode == "gspo":
        return PolicyOptions(term="clip", level="sequence_token", log_ratio_max=_GSPO_LOG_RATIO_MAX, **bounds, **kl)
    if mode == "cispo":
        return PolicyOptions(term="cispo", **bounds, **clamp, **kl)
    if mode == "sapo":
        return PolicyOptions(term="sapo", sapo_tau_pos=float(_field(config, "tau_pos", 1.0)),
                             sapo_tau_neg=float(_field(config, "tau_neg", 1.05)), **clamp, **kl)
    return PolicyOptions(term="pg", ratio_low=None, ratio_high=None, **kl)


def _aggregation(mode: str, flat: FlatPolicyTensors, batch: dict[str, Any]) -> torch.Tensor:
    """Each token's weight in verl's ``agg_loss(loss_mat, loss_mask, mode, **global_batch_info)``: flce's
    aggregation of the same name (flce.policy.semantics) over verl's counts, times ``dp_size``."""
    mask, layout, dp_size = flat.mask, flat.layout, batch["dp_size"]
    needed = "batch_num_tokens" if mode == "token-mean" else None if mode == "token-sum" else "global_batch_size"
    if dp_size > 1 and needed and batch.get(needed) is None:
        raise ValueError(f"config.global_batch_info: {mode} with dp_size={dp_size} needs {needed} (verl's "
                         "agg_loss)")
    sequences = horizon = None
    if mode.startswith("seq-mean"):
        # verl counts the sequences with a token in the mask, where global_batch_size does not say.
        sequences = batch.get("global_batch_size")
        if sequences is None:
            sequences = layout.count(mask, nonempty=mask)
    if mode == "seq-mean-token-sum-norm":
        horizon = batch.get("loss_scale_factor") or layout.length
        if horizon is None:
            raise ValueError("seq-mean-token-sum-norm in the packed form: set config.loss_scale_factor (verl's "
                             "horizon is the padded response length)")
    # Where flce divides by at least 1 verl does not: its token-mean divides an empty batch's 0 by 0, its
    # seq-mean-token-mean each sequence's token count + 1e-8 (which its float32 sum of a bool mask rounds away).
    weights = aggregation_weights(mask, layout, mode.replace("-", "_"), token_divisor=batch.get("batch_num_tokens"),
                                  sequence_divisor=sequences, horizon=horizon)
    return weights * dp_size


@torch.no_grad()
def _metrics(mode: str, call: PolicyCall, entropy_coeff: float) -> dict[str, torch.Tensor | float]:
    """verl's metrics of the loss, from the call's detached log-probs and entropies and its per-token tensors."""
    tokens, flat = call.tokens, call.inputs
    options = tokens.options
    logprob = call.output.logprobs.reshape(-1)
    mask = flat.mask

    def masked_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(mask != 0, values * mask, 0.0).sum() / (mask.sum() + 1e-8)

    metrics: dict[str, torch.Tensor | float] = {}
    policy_only = replace(tokens, options=replace(options, beta=0.0), entropy_weight=None)
    metrics["actor/pg_loss"] = policy_rows(logprob, None, policy_only).loss.sum()
    if mode != "gpg":
        own = torch.where(mask != 0, logprob - tokens.old, 0.0)
        advantage = flat.advantage
        zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
        if mode == "gspo":
            ratio = torch.exp(log_ratio(logprob, tokens, mask != 0).value)
            metrics["actor/ppo_kl"] = masked_mean(-own)
        else:
            clamped = own.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
            ratio = torch.exp(clamped)
            metrics["actor/ppo_kl"] = masked_mean(-clamped)
        clipped = torch.clamp(ratio, options.ratio_low, options.ratio_high)
        if mode in ("vanilla", "gspo"):
            unclipped_loss, clipped_loss = -advantage * ratio, -advantage * clipped
            metrics["actor/pg_clipfrac"] = masked_mean((clipped_loss > unclipped_loss).to(ratio.dtype))
            lower = zero
            if mode == "vanilla":
                worst = torch.maximum(unclipped_loss, clipped_loss)
                lower = masked_mean(((worst > -advantage * options.delta) & (advantage < 0)).to(ratio.dtype))
            metrics["actor/pg_clipfrac_lower"] = lower
        elif mode == "cispo":
            metrics["actor/pg_clipfrac"] = masked_mean((ratio != clipped).to(ratio.dtype))
            metrics["actor/pg_clipfrac_lower"] = zero
        else:
            metrics["actor/pg_clipfrac"] = metrics["actor/pg_clipfrac_lower"] = zero
    # loss_agg_mode's weights: the KL's in ppo_loss's weights() (the policy term's differ for sapo).
    aggregated = tokens.kl_weight
    if call.output.entropy is not None and entropy_coeff:
        metrics["actor/entropy_loss"] = (aggregated * call.output.entropy.reshape(-1)).sum()
    if options.beta:
        kl = kl_term(logprob, tokens.ref, options)[0]
        metrics["kl_loss"] = torch.where(mask != 0, aggregated * kl, 0.0).sum()
        metrics["kl_coef"] = options.beta
    return metrics
