"""The float64 oracle of ``flce.linear_policy_loss``: TRL 1.16.0's ``GRPOTrainer._compute_loss`` restated on
materialised logits, differentiated by autograd.

    from flce.testing.policy_oracle import reference_policy_loss
    expected = reference_policy_loss(hidden, weight, target, advantages, mask=mask, loss_type="dapo", beta=0.04,
                                     ref_logprobs=ref)
    expected.loss.backward()   # float64 gradients of hidden and weight

It follows TRL's code step by step (per-token log-probs, ``coef_1`` / ``coef_2``, the loss type's aggregation,
the entropy bonus, the metrics), written out independently of flce.policy; it takes the packed form too (it pads
it). It materialises [tokens, vocab] in float64: meant for checks at test sizes.
"""

from __future__ import annotations

from typing import Any

import torch

_DEFAULTS: dict[str, Any] = dict(
    old_logprobs=None, ref_logprobs=None, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0,
    importance_sampling_level="token", temperature=1.0, max_completion_length=None, num_items_in_batch=None,
    rollout_is_ratio=None, entropy_weight=0.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    sequence_ids=None, bias=None, ignore_index=-100, logits_dtype=torch.float64,
)


def reference_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          advantages: torch.Tensor, *, mask: torch.Tensor, **options: Any) -> dict[str, Any]:
    """``loss`` (differentiable into the float64 upcasts of hidden, weight and bias), per-token ``logprobs`` and
    ``entropy`` (target's shape, detached), and TRL's metrics ``mean_entropy``, ``mean_kl`` (None without
    reference log-probs), ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio`` (0-d). Options are
    ``flce.linear_policy_loss``'s math keywords, and ``logits_dtype``: float64 (the oracle), or a 16-bit dtype for
    eager PyTorch's materialised formula (logits formed in it, the rest in float32), the bf16 baseline
    docs/design.md measures a kernel's error against."""
    unknown = set(options) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"reference_policy_loss: unknown options {sorted(unknown)}")
    o = {**_DEFAULTS, **options}
    logits_dtype = o["logits_dtype"]
    math = torch.float64 if logits_dtype == torch.float64 else torch.float32
    vocab_rows = hidden.to(logits_dtype).reshape(-1, hidden.shape[-1]) @ weight.to(logits_dtype).T
    if o["bias"] is not None:
        vocab_rows = vocab_rows + o["bias"].to(logits_dtype)
    log_p = torch.log_softmax(vocab_rows.to(math) / o["temperature"], dim=-1)
    flat_target = target.reshape(-1)
    valid = flat_target != o["ignore_index"]
    token_logp = log_p.gather(1, torch.where(valid, flat_target, 0)[:, None]).squeeze(1)
    token_entropy = -(log_p.exp() * log_p).sum(-1)
    per_token = {"logp": token_logp, "entropy": token_entropy,
                 "mask": mask.reshape(-1).to(math) * valid.to(math)}
    for name in ("old_logprobs", "ref_logprobs", "rollout_is_ratio"):
        if o[name] is not None:
            per_token[name] = o[name].reshape(-1).to(math)
    packed = o["sequence_ids"] is not None
    if packed:
        per_token["advantages"] = advantages.reshape(-1).to(math)
        rows = _padded_rows(o["sequence_ids"].reshape(-1))
    else:
        batch, length = target.shape
        advantage = advantages.to(math)
        per_token["advantages"] = (advantage[:, None].expand(batch, length) if advantage.dim() == 1
                                   else advantage).reshape(-1)
        rows = torch.arange(batch * length, device=target.device).reshape(batch, length)
    padded = {name: torch.where(rows >= 0, value[rows.clamp(min=0)], 0.0) for name, value in per_token.items()}
    result = _trl_loss(padded, o, per_sequence_advantages=not packed and advantages.dim() == 1)
    result["logprobs"] = torch.where(valid, token_logp, 0.0).detach().reshape(target.shape)
    result["entropy"] = torch.where(valid, token_entropy, 0.0).detach().reshape(target.shape)
    return result


def _padded_rows(ids: torch.Tensor) -> torch.Tensor:
    """[S, L] row indices of each sequence's tokens in order (-1 past its end), sequences by increasing id."""
    sequences = [torch.nonzero(ids == s).reshape(-1) for s in torch.unique(ids).tolist()]
    length = max(len(s) for s in sequences)
    return torch.stack([torch.cat([s, s.new_full((length - len(s),), -1)]) for s in sequences])


def _trl_loss(x: dict[str, torch.Tensor], o: dict[str, Any], per_sequence_advantages: bool) -> dict[str, Any]:
    """TRL's loss on padded [B, L] tensors (the names of ``_compute_loss`` where they help)."""
    per_token_logps, mask = x["logp"], x["mask"]
    advantages = x["advantages"]
    if per_sequence_advantages:
        advantages = advantages[:, :1]  # (B, 1), as TRL unsqueezes a (B,) tensor
    old_per_token_logps = x.get("old_logprobs", per_token_logps.detach())
    log_ratio = per_token_logps - old_per_token_logps
    if o["importance_sampling_level"] == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = None
    if "ref_logprobs" in x:
        ref = x["ref_logprobs"]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
    loss_type = o["loss_type"]
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=o["epsilon_high"]).detach() * advantages * per_token_logps
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, advantages.new_full((), o["sapo_temperature_pos"]),
                                   o["sapo_temperature_neg"])
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - o["epsilon_low"], 1 + o["epsilon_high"])
        if o["delta"] is not None:
            coef_1 = torch.clamp(coef_1, max=o["delta"])
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if "rollout_is_ratio" in x:
        per_token_loss = per_token_loss * x["rollout_is_ratio"]
    if o["beta"] != 0.0:
        per_token_loss = per_token_loss + o["beta"] * per_token_kl
    batch = per_token_loss.shape[0]
    masked = per_token_loss * mask
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (batch * o["max_completion_length"])
    elif loss_type in ("dapo", "cispo"):
        items = o["num_items_in_batch"]
        normalizer = mask.sum() if items is None else torch.as_tensor(items, dtype=mask.dtype)
        loss = masked.sum() / normalizer.clamp(min=1.0)
    elif loss_type == "luspo":
        loss = masked.sum(-1).mean()
    else:
        raise ValueError(f"loss_type={loss_type!r}")
    entropies = x["entropy"]
    if o["entropy_weight"]:
        loss = loss - o["entropy_weight"] * (entropies * mask).sum() / mask.sum().clamp(min=1.0)

    def global_masked_mean(value: torch.Tensor) -> torch.Tensor:
        if value.shape[1] == 1:  # one value per sequence
            return value.sum() / value.shape[0]
        return (value * mask).sum() / mask.sum().clamp(min=1.0)

    if loss_type == "cispo":
        high = ((coef_1 > o["epsilon_high"]) & (advantages > 0)).to(mask.dtype)
        low = torch.zeros_like(high)
    elif loss_type == "sapo":
        low = high = torch.zeros_like(coef_1)
    else:
        low = ((coef_1 < 1 - o["epsilon_low"]) & (advantages < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + o["epsilon_high"]) & (advantages > 0)).to(mask.dtype)
    with torch.no_grad():
        return {
            "loss": loss,
            "mean_entropy": global_masked_mean(entropies.detach()),
            "mean_kl": None if per_token_kl is None else global_masked_mean(per_token_kl.detach()),
            "clip_ratio_low": global_masked_mean(low),
            "clip_ratio_high": global_masked_mean(high),
            "clip_ratio": global_masked_mean(((low + high) > 0).to(mask.dtype)),
        }
