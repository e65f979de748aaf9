"""Inputs and checks the policy-loss tests share: random batches whose old and reference log-probs lie near the
policy's own (so that some ratios clip and others do not), every option set, and the comparison of a call
with the float64 oracle (flce.testing.policy_oracle)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

import flce
from flce.testing.policy_oracle import reference_policy_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo")
LEVELS = ("token", "sequence")


@dataclass
class PolicyCase:
    """One batch: padded [B, T] (or packed [N] with ``sequence_ids``) per-token tensors, leaves requiring grad."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    rollout_is_ratio: torch.Tensor
    sequence_ids: torch.Tensor | None = None

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.hidden, self.weight, self.bias) if t is not None)

    def tensors(self, *, old: bool = True, ref: bool = True, rollout: bool = True) -> dict[str, Any]:
        """The per-token keywords of flce.linear_policy_loss."""
        out: dict[str, Any] = {"mask": self.mask, "bias": self.bias}
        if old:
            out["old_logprobs"] = self.old_logprobs
        if ref:
            out["ref_logprobs"] = self.ref_logprobs
        if rollout:
            out["rollout_is_ratio"] = self.rollout_is_ratio
        if self.sequence_ids is not None:
            out["sequence_ids"] = self.sequence_ids
        return out

    def to(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> PolicyCase:
        """A copy on ``device``: fresh leaves in ``dtype``, the per-token tensors in float32 or wider (as a
        trainer's log-probs and advantages are), the same values."""
        values = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                values[f.name] = None
                continue
            leaf = f.name in ("hidden", "weight", "bias")
            kind = (dtype if leaf else torch.promote_types(dtype, torch.float32)) if t.is_floating_point() else t.dtype
            moved = t.detach().to(device=device, dtype=kind)
            values[f.name] = moved.requires_grad_() if leaf else moved
        return PolicyCase(**values)


def policy_case(generator: torch.Generator, *, batch: int = 3, length: int = 7, hidden_size: int = 12,
                vocab: int = 37, bias: bool = False, per_token_advantages: bool = False,
                dtype: torch.dtype = torch.float64, temperature: float = 0.7, ignored: bool = True,
                ref_noise: float = 0.3) -> PolicyCase:
    """A padded batch: logits of std ~2, about a fifth of the tokens masked and (``ignored``) one target per
    sequence ignore_index, old / reference log-probs the policy's own at ``temperature`` plus noise of 0.15 /
    ``ref_noise``."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    hidden = randn(batch, length, hidden_size)
    weight = randn(vocab, hidden_size) * (2.0 / hidden_size**0.5)
    b = randn(vocab) * 0.5 if bias else None
    target = torch.randint(0, vocab, (batch, length), generator=generator)
    if ignored:
        target[torch.arange(batch), torch.randint(0, length, (batch,), generator=generator)] = -100
    mask = torch.rand(batch, length, generator=generator) > 0.2
    logits = hidden @ weight.T + (0 if b is None else b)
    own = torch.log_softmax(logits / temperature, -1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    advantages = randn(batch, length) if per_token_advantages else randn(batch)
    case = PolicyCase(hidden, weight, b, target, advantages, mask, own + 0.15 * randn(batch, length),
                      own + ref_noise * randn(batch, length), torch.rand(batch, length, generator=generator) + 0.5)
    return case.to(dtype)


def packed(case: PolicyCase, generator: torch.Generator) -> PolicyCase:
    """The same tokens packed [N]: the rows of all sequences shuffled together (nothing in the loss depends on
    where a sequence's tokens lie), sequence ids a random relabelling in [0, N), one advantage per token."""
    batch, length = case.target.shape
    rows = torch.randperm(batch * length, generator=generator)
    labels = torch.randperm(batch * length, generator=generator)[:batch]
    advantages = case.advantages if case.advantages.dim() == 2 else case.advantages[:, None].expand(batch, length)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(batch * length, *t.shape[2:])[rows]

    bias = None if case.bias is None else case.bias.detach().clone().requires_grad_()
    return PolicyCase(flat(case.hidden).requires_grad_(), case.weight.detach().clone().requires_grad_(), bias,
                      flat(case.target), flat(advantages), flat(case.mask), flat(case.old_logprobs),
                      flat(case.ref_logprobs), flat(case.rollout_is_ratio), labels[rows // length])


def full_options(loss_type: str, level: str, **extra: Any) -> dict[str, Any]:
    """Every option at once: temperature, two-sided clip with delta, the k3 KL, the entropy bonus, the
    horizon and item count."""
    options = dict(loss_type=loss_type, importance_sampling_level=level, temperature=0.7, epsilon_low=0.2,
                   epsilon_high=0.28, beta=0.04, entropy_weight=0.01, max_completion_length=9)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.3
    if loss_type not in ("cispo", "sapo"):
        options["delta"] = 1.5
    if loss_type in ("dapo", "cispo"):
        options["num_items_in_batch"] = 11.0
    options.update(extra)
    return options


ORACLE_KEYS = ("mean_entropy", "mean_kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio", "logprobs", "entropy")


def check_against_oracle(case: PolicyCase, options: dict[str, Any], *, rtol: float, atol: float,
                         tensors: dict[str, Any] | None = None, **call: Any) -> flce.PolicyLossOutput:
    """flce.linear_policy_loss's loss, gradients and metrics against the float64 oracle's on the same inputs."""
    tensors = case.tensors() if tensors is None else tensors
    out = flce.linear_policy_loss(case.hidden, case.weight, case.target, case.advantages, **tensors, **options,
                                  **call)
    grads = torch.autograd.grad(out.loss, case.leaves())
    fresh = [t.detach().double().requires_grad_() for t in case.leaves()]
    oracle_tensors = {k: (v.detach().double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                      for k, v in tensors.items() if k != "bias"}
    if case.bias is not None:
        oracle_tensors["bias"] = fresh[2]
    oracle_options = {k: v for k, v in options.items() if k in ORACLE_OPTIONS}
    want = reference_policy_loss(fresh[0], fresh[1], case.target, case.advantages.double(), **oracle_tensors,
                                 **oracle_options)
    want_grads = torch.autograd.grad(want["loss"], fresh)

    def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        # An element of a gradient product is a sum over the tokens; its rounding follows the terms' size, not the
        # sum's, so where terms cancel the element's own size understates it: the absolute floor is rtol of the
        # tensor's largest element (an H200's fp32 weight gradient erred by 1.2e-6 at an element of 5.8e-5 whose
        # tensor holds elements of 1.28e-2: 1e-4 of that scale).
        floor = max(atol, rtol * float(expected.detach().abs().max())) if expected.numel() else atol
        torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=floor,
                                   msg=lambda m: f"{what}: {m}")

    close(out.loss, want["loss"], "loss")
    for name, g, w in zip(("grad hidden", "grad weight", "grad bias"), grads, want_grads, strict=False):
        close(g, w, name)
    without_entropy = options.get("return_entropy") is False and not options.get("entropy_weight")
    for key in ORACLE_KEYS:
        got, expected = getattr(out, key), want[key]
        if without_entropy and key in ("entropy", "mean_entropy"):
            assert got is None, f"{key}: {got}, though return_entropy=False"
            continue
        if expected is None or got is None:
            assert got is None and expected is None, f"{key}: {got} against {expected}"
            continue
        close(got, expected, key)
    return out


ORACLE_OPTIONS = ("loss_type", "epsilon_low", "epsilon_high", "delta", "beta", "importance_sampling_level",
                   "temperature", "max_completion_length", "num_items_in_batch", "entropy_weight",
                   "sapo_temperature_pos", "sapo_temperature_neg", "ignore_index")
