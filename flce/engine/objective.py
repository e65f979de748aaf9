"""What a call differentiates, as the schedules see it: per row, the scales of ``-logp`` and of the entropy in
the loss (flce.gradients.UpstreamScales), hence the gradient coefficients, and the rows' loss terms.

A schedule asks an objective for a row range's scales right after the range's statistics and before its
gradient kernel; the kernels consume them and never know which loss they serve. Two objectives exist:

* :class:`CrossEntropyObjective`: the cross-entropy call's loss (token weights, entropy term, z-loss, class
  weights) under its upstream gradients. Its scales do not depend on the statistics, so the in-forward path
  computes them once for all rows, as before (the plain path's cost is unchanged);
* :class:`PolicyObjective`: a policy loss (flce.policy.semantics), whose scales are functions of each row's
  log-prob and entropy: of the row's own at token level, of its sequence's at a sequence level
  (``statistics_first``: the schedule takes every row's statistics before any gradient). Its terms and scales
  come from one pass of the formula over the rows, :meth:`PolicyObjective.with_statistics`.

A schedule hands an objective a row range's statistics (``with_statistics``) before it asks for the range's
scales, coefficients or terms; the cross-entropy's needs none of it and stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from flce.config import LCEConfig
from flce.gradients import GradCoefficients, UpstreamScales, grad_coefficients, upstream_scales
from flce.inputs import FlatInputs
from flce.policy.semantics import policy_rows
from flce.policy.tokens import PolicyTokens
from flce.semantics import Denominators, RowStats, RowTerms, row_terms


@dataclass(frozen=True)
class CrossEntropyObjective:
    """The cross-entropy loss under ``grad_loss`` (its output's upstream gradient) and, in a deferred backward,
    the upstream gradients of the returned log-probs and entropy. ``precomputed``: the scales of all rows, made
    once where they serve every chunk (in forward, grad_loss 1)."""

    cfg: LCEConfig
    vocab: int
    denoms: Denominators
    token_weight: torch.Tensor | None
    grad_loss: torch.Tensor
    grad_logprobs: torch.Tensor | None = None
    grad_entropy: torch.Tensor | None = None
    precomputed: UpstreamScales | None = None

    statistics_first = False
    scales_need_statistics = False

    def with_statistics(self, stats: RowStats, rows: slice = slice(None)) -> CrossEntropyObjective:
        return self

    def scales(self, stats: RowStats | None, rows: slice, n_rows: int) -> UpstreamScales:
        if self.precomputed is not None:
            return self.precomputed.rows(rows)
        return upstream_scales(self.cfg, self.denoms, self.grad_loss, rows, n_rows, self.token_weight)

    def coefficients(self, stats: RowStats, target: torch.Tensor, rows: slice) -> GradCoefficients:
        return grad_coefficients(
            stats, target, self.cfg, self.vocab, self.scales(stats, rows, target.shape[0]),
            None if self.grad_logprobs is None else self.grad_logprobs.reshape(-1)[rows],
            None if self.grad_entropy is None else self.grad_entropy.reshape(-1)[rows])

    def terms(self, stats: RowStats, target: torch.Tensor) -> RowTerms:
        return row_terms(stats, target, self.cfg, self.vocab, self.token_weight)


class KnownRows(NamedTuple):
    """A policy loss's terms and gradient scales of a row range, made together from the range's statistics."""

    rows: slice  # the call's rows they are: slice(None) for every row, else one token chunk's
    loss: torch.Tensor
    scales: UpstreamScales


@dataclass(frozen=True)
class PolicyObjective:
    """A policy loss over the rows' log-probs and entropies (flce.policy.semantics.policy_rows), grad_output 1.
    ``known``: the rows whose terms and scales :meth:`with_statistics` made, in one pass of the formula: every
    row once all statistics are known (a sequence level's gradients need them all), or, in forward at token
    level, one chunk's."""

    cfg: LCEConfig
    vocab: int
    tokens: PolicyTokens
    known: KnownRows | None = None

    scales_need_statistics = True

    @property
    def statistics_first(self) -> bool:
        return self.tokens.options.ratio_per_sequence

    def with_statistics(self, stats: RowStats, rows: slice = slice(None)) -> PolicyObjective:
        """The objective knowing ``rows`` (``stats`` are theirs): their terms and scales made."""
        every_row = rows == slice(None)
        assert every_row or not self.statistics_first, "a sequence level's rows need every row's statistics"
        tokens = self.tokens if every_row else self.tokens.rows(rows)
        valid = tokens.weight != 0
        logprobs = torch.where(valid, stats.target_z - stats.lse, 0.0)
        made = policy_rows(logprobs, stats.entropy, tokens)
        # The loss's d / d logp is the scale of -logp (the cross-entropy term) negated; nothing reads the z-loss's.
        ce = -made.grad_logprob
        return replace(self, known=KnownRows(rows, made.loss, UpstreamScales(ce, ce, made.grad_entropy)))

    def scales(self, stats: RowStats | None, rows: slice, n_rows: int) -> UpstreamScales:
        known = self._known()
        if rows == known.rows:
            return known.scales
        assert known.rows == slice(None), f"the scales of rows {rows}, but the objective knows {known.rows} only"
        return known.scales.rows(rows)

    def coefficients(self, stats: RowStats, target: torch.Tensor, rows: slice) -> GradCoefficients:
        return grad_coefficients(stats, target, self.cfg, self.vocab, self.scales(stats, rows, target.shape[0]),
                                 None, None)

    def terms(self, stats: RowStats, target: torch.Tensor) -> RowTerms:
        """The known rows' terms (``target``: those rows')."""
        loss = self._known().loss
        assert loss.shape == target.shape, f"terms of {tuple(target.shape)} rows; known: {tuple(loss.shape)}"
        return RowTerms(loss, None, target != self.cfg.ignore_index)

    def _known(self) -> KnownRows:
        assert self.known is not None, ("a policy objective's terms and scales follow its rows' statistics: "
                                        "with_statistics first")
        return self.known


Objective = CrossEntropyObjective | PolicyObjective


def forward_objective(call_cfg: LCEConfig, vocab: int, flat: FlatInputs, denoms: Denominators,
                      precompute: bool) -> Objective:
    """The objective a forward differentiates (grad_output 1): the policy loss where the call carries one, else
    the cross-entropy's, its scales made once for all rows with ``precompute`` (gradients in forward)."""
    if flat.policy is not None:
        return PolicyObjective(call_cfg, vocab, flat.policy)
    one = torch.ones((), dtype=denoms.z_loss.dtype, device=flat.target.device)
    n_rows = flat.target.shape[0]
    precomputed = (upstream_scales(call_cfg, denoms, one, slice(0, n_rows), n_rows, flat.token_weight)
                   if precompute else None)
    return CrossEntropyObjective(call_cfg, vocab, denoms, flat.token_weight, one, precomputed=precomputed)


def backward_objective(call_cfg: LCEConfig, vocab: int, flat: FlatInputs, denoms: Denominators,
                       grad_loss: torch.Tensor, grad_logprobs: torch.Tensor | None,
                       grad_entropy: torch.Tensor | None) -> CrossEntropyObjective:
    """The cross-entropy's objective in a deferred backward, under its upstream gradients."""
    return CrossEntropyObjective(call_cfg, vocab, denoms, flat.token_weight, grad_loss, grad_logprobs, grad_entropy)


def needs_statistics_first(flat: FlatInputs) -> bool:
    """Whether the call's gradients need every row's statistics before any (a policy loss at a sequence level):
    what a planner's PlanRequest says (``statistics_first``)."""
    return flat.policy is not None and flat.policy.options.ratio_per_sequence
