"""AReaL drop-in: ``linear_cross_entropy_logprobs_entropy`` and ``linear_cross_entropy_logprobs`` through flce.

    from flce.integrations.areal import linear_cross_entropy_logprobs_entropy
    logprobs, entropy, max_logits = linear_cross_entropy_logprobs_entropy(
        hidden, weight, labels, temperature=T, tp_group=tp_group, return_max_logits=True)

AReaL's fused linear cross-entropy (its pull request 1322, ``areal.models.kernel``; not in the
1.0.4 release on PyPI) computes the Megatron actor's per-token log-probabilities and entropy from
the LM head's captured hidden states and weight (``MegatronEngineConfig.use_fused_linear_ce``),
with a vendored Triton kernel on CUDA and a materialised fallback elsewhere. These functions have
the same signatures and return the same tensors, computed by flce's registry:

- ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (or this rank's vocabulary shard), ``labels``
  ``[...]``, global token ids.
- Returns ``(logprobs, entropy)`` shaped like ``labels``, float32 (float64 for float64 inputs;
  AReaL computes in float32 whatever the inputs), with ``z = hidden @ weight.T / temperature``:
  ``logprobs = log softmax(z)[labels]``, ``entropy = -sum_v p_v log p_v``. Gradients flow from
  both, with any upstream gradient, into ``hidden`` and ``weight``.
- ``return_max_logits=True`` adds a third tensor, shaped like ``labels``, float32, detached: the
  per-token max of the raw (pre-temperature) logits ``hidden @ weight.T``, over the whole
  vocabulary under tensor parallelism, as AReaL's telemetry (``vocab_max_logits``) reads it
  (float64 for float64 inputs).
- ``tp_group`` (tensor parallelism): ``weight`` is this rank's contiguous vocabulary shard, shards
  in rank order; the outputs are the full-vocabulary values on every rank; ``hidden``'s gradient
  is the full gradient on every rank (AReaL's kernel all-reduces it over the group in backward,
  and so does flce), ``weight``'s is this rank's rows of the full gradient.
- Labels: AReaL's functions take every label as a token id (its engine rolls ``input_ids``);
  here ``-100`` gives log-prob 0, entropy 0, max logit 0 and no gradient, any other label outside
  ``[0, V)`` raises ``ValueError``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flce
from flce.distributed.shards import vocab_shard
from flce.policy.api import PolicyCall, PolicyInputs, TokenWeights, policy_config, policy_loss_of_tokens
from flce.policy.checks import FlatPolicyTensors
from flce.policy.options import PolicyOptions

# Tokens per step of the max-logit dot products: [rows, H] gathered weight rows in fp32 at a time.
_DOT_ROWS = 2048


def linear_cross_entropy_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AReaL's ``(logprobs, entropy)``, and the raw max logits third when ``return_max_logits``."""
    out = flce.linear_cross_entropy(
        hidden, weight, labels, reduction="none", temperature=temperature, process_group=tp_group,
        return_logprobs=True, return_entropy=True, return_predicted_tokens=return_max_logits,
    )
    logprobs, entropy = out.logprobs.reshape(labels.shape), out.entropy.reshape(labels.shape)
    if not return_max_logits:
        return logprobs, entropy
    return logprobs, entropy, _raw_max_logits(hidden, weight, out.predicted_tokens, tp_group).reshape(labels.shape)


def linear_cross_entropy_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """AReaL's log-probs-only form: the first output of :func:`linear_cross_entropy_logprobs_entropy`."""
    out = flce.linear_cross_entropy(
        hidden, weight, labels, reduction="none", temperature=temperature, process_group=tp_group,
        return_logprobs=True,
    )
    return out.logprobs.reshape(labels.shape)


@torch.no_grad()
def _raw_max_logits(hidden: torch.Tensor, weight: torch.Tensor, argmax: torch.Tensor,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """``hidden @ weight.T`` at each token's argmax (flce's predicted token, a global id; -1
    where the label is ignored, giving 0): one dot product per token, on the rank whose shard
    holds the argmax, then a max over the group. Temperature > 0 does not move the argmax.

    Not flce's ``return_logit_stats``, whose max is the same number: the CUDA and Ascend kernels do
    not keep the logit min and sum yet, so that option runs the call on the reference backend, and
    AReaL asks for the max logits on every call; the argmax is kept by every backend's kernels."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    argmax = argmax.reshape(-1)
    shard_start, shard_size = 0, weight.shape[0]
    if group is not None and dist.get_world_size(group) > 1:
        shard_start = vocab_shard(group, weight).offset
    local = argmax - shard_start
    on_this_rank = (local >= 0) & (local < shard_size)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    dots = flat_hidden.new_zeros(flat_hidden.shape[0], dtype=dtype)
    if shard_size:
        local = local.clamp(0, shard_size - 1)
        for start in range(0, dots.shape[0], _DOT_ROWS):  # bounds the gathered rows' temporary
            rows = slice(start, start + _DOT_ROWS)
            dots[rows] = torch.einsum("nh,nh->n", flat_hidden[rows].to(dtype), weight[local[rows]].to(dtype))
    max_logits = torch.where(on_this_rank, dots, float("-inf"))
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=group)
    return torch.where(argmax >= 0, max_logits, 0.0)


# --------------------------------------------------------------------------- the PPO actor's loss

def ppo_actor_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, old_logprobs: torch.Tensor,
    advantages: torch.Tensor, loss_mask: torch.Tensor, eps_clip: float, eps_clip_higher: float | None = None,
    c_clip: float | None = None, proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None, temperature: float = 1.0, tp_group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None, memory_budget: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's PPO actor loss (``areal.utils.functional.ppo_actor_loss_fn``, what its ``grpo_loss_fn`` calls
    without SAPO or M2PO) from the LM head's input, in one flce call: the clipped ratio to the proximal policy
    (``proximal_logprobs``; the old one where None) with ``eps_clip`` / ``eps_clip_higher``, the dual clip
    ``c_clip``, times the decoupled behaviour weight exp(proximal - old) (tokens above ``behav_imp_weight_cap``
    weigh 0), averaged over the tokens of ``loss_mask``.

    ``hidden`` [..., H] with the per-token tensors shaped like ``labels`` (padded [bs, seqlen]; or packed [N] with
    ``sequence_ids``). Returns ``(loss, stat)`` with AReaL's stat names, per-token and detached: loss,
    importance_weight, approx_kl, clip_mask, dual_clip_mask, behave_imp_weight, behave_approx_kl, behave_mask."""
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip={c_clip}: expected None or a value > 1 (AReaL's dual clip)")
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    options = PolicyOptions(term="clip", ratio_low=1.0 - float(eps_clip), ratio_high=1.0 + float(high),
                            delta=None if c_clip is None else float(c_clip))
    proximal = old_logprobs if proximal_logprobs is None else proximal_logprobs
    mask = loss_mask.bool()
    with torch.no_grad():
        behaviour_kl = proximal.double() - old_logprobs.double()
        behaviour_weight = behaviour_kl.exp()
        behaviour_mask = mask if behav_imp_weight_cap is None else (behaviour_weight <= behav_imp_weight_cap) & mask
        behaviour_weight = torch.where(behaviour_mask, behaviour_weight, 0.0).to(old_logprobs.dtype)

    def weights(flat: FlatPolicyTensors) -> TokenWeights:
        return TokenWeights(flat.mask / flat.mask.sum().clamp(min=1.0))

    cfg = policy_config(temperature=temperature, memory_budget=memory_budget, process_group=tp_group, entropy=False)
    tensors = PolicyInputs(advantages, mask, proximal, None, behaviour_weight, sequence_ids)
    call = policy_loss_of_tokens(hidden, weight, labels, bias, tensors, cfg, options, weights,
                                 device_type=hidden.device.type)
    return call.output.loss, _ppo_stat(call, advantages, mask, proximal, options, behaviour_weight, behaviour_kl,
                                       behaviour_mask)


@torch.no_grad()
def _ppo_stat(call: PolicyCall, advantages: torch.Tensor, mask: torch.Tensor, proximal: torch.Tensor,
              options: PolicyOptions, behaviour_weight: torch.Tensor, behaviour_kl: torch.Tensor,
              behaviour_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """AReaL's per-token statistics of the loss, from the call's detached log-probs."""
    logprobs = call.output.logprobs
    ratio = torch.where(mask, torch.exp(logprobs - proximal), 0.0)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, options.ratio_low, options.ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if options.delta is not None:
        bound = torch.sign(advantages) * options.delta * advantages
        dual = bound < loss
        loss = torch.minimum(loss, bound)
    return {"loss": loss * behaviour_weight, "importance_weight": ratio, "approx_kl": logprobs - proximal,
            "clip_mask": (unclipped < clipped) & mask, "dual_clip_mask": dual & mask,
            "behave_imp_weight": behaviour_weight, "behave_approx_kl": torch.where(behaviour_mask, behaviour_kl, 0.0),
            "behave_mask": behaviour_mask}
