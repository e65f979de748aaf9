"""A policy loss's per-token tensors, flattened to the call's rows [N] in the statistics dtype, with its scalar
settings: what the engine's policy objective (flce.engine.objective) reads beside each chunk's row statistics.

Everything here is known before any logit is: the advantages, the old and reference log-probs, the rollout
correction, and the aggregation (which token weighs how much in the loss, :func:`flce.policy.semantics.
aggregation_weights`). What the loss needs from the logits is each row's log-prob and entropy alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flce.policy.options import PolicyOptions


@dataclass(frozen=True)
class PolicyTokens:
    """The rows' per-token inputs of a policy loss (module docstring). Rows whose ``weight`` and
    ``entropy_weight`` are 0 take no part in the loss (masked, ignored)."""

    options: PolicyOptions
    advantage: torch.Tensor  # [N]
    weight: torch.Tensor  # [N]: d loss / d (the token's policy term + beta * its KL), the aggregation and mask
    old: torch.Tensor | None = None  # [N] the old policy's log-probs; None: the current ones, detached (ratio 1)
    ref: torch.Tensor | None = None  # [N] the reference policy's log-probs (the KL term)
    rollout: torch.Tensor | None = None  # [N] the rollout correction, multiplying the policy term
    entropy_weight: torch.Tensor | None = None  # [N] d loss / d entropy; None: no entropy term
    kl_weight: torch.Tensor | None = None  # [N] the KL term's aggregation weight; None: ``weight``
    # The sequence levels: each token's sequence index and its weight in its sequence's mean log ratio
    # (mask / max(tokens counted in the sequence, 1)); ``sequence_length``: every sequence is that many consecutive
    # rows (the padded form, summed by a reshape), else None (the packed form, summed by index).
    sequence: torch.Tensor | None = None  # [N] int64
    sequence_share: torch.Tensor | None = None  # [N]
    sequence_length: int | None = None

    def rows(self, rows: slice) -> PolicyTokens:
        """The tokens of a row range (token level only: a sequence level needs all rows at once)."""
        return replace(self, **{name: None if t is None else t[rows] for name, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The per-token tensors by field name, in field order."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    @staticmethod
    def from_tensors(options: PolicyOptions, tensors: dict[str, torch.Tensor | None],
                     sequence_length: int | None) -> PolicyTokens:
        """The inverse of :meth:`tensors` (the compile path's op rebuilds the record from its arguments)."""
        return PolicyTokens(options=options, sequence_length=sequence_length, **tensors)


TENSOR_FIELDS = ("advantage", "weight", "old", "ref", "rollout", "entropy_weight", "kl_weight", "sequence",
                 "sequence_share")
