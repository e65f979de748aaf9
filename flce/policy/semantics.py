"""The policy losses of the GRPO/PPO family as functions of each token's log-prob and entropy: the one formula the
engine, the reference backend and the metrics share (the float64 oracle, flce.testing.policy_oracle, restates it
on materialised logits, by autograd).

The loss is a sum over the call's tokens t,

    loss = sum_t  w_t rho_t P_t  +  v_t beta K_t  +  e_t H_t

with ``w_t`` the aggregation weight (the mask and the loss type's normalisation, :func:`aggregation_weights`),
``v_t`` the KL's (``w_t`` but where a trainer aggregates the two differently, as verl's sapo),
``rho_t`` the rollout correction, ``P_t`` the policy term of the importance ratio r (options.py's ``term``),
``K_t`` the KL estimator of log-probs against the reference policy's, ``H_t`` the entropy and ``e_t`` its
weight (-entropy_weight times its aggregation). With logp_t the token's log-prob and old_t the old policy's
(logp_t detached where there is none), the ratio's log is ``logp_t - old_t`` (token level), its sequence's
masked mean (sequence level, differentiated through the mean), or that mean as the value with ``logp_t`` as
the gradient's path (sequence_token level), clamped to [log_ratio_min, log_ratio_max] where set.

Every term is a function of the token's own log-prob, or of its sequence's: ``d loss / d logp_t`` and
``d loss / d H_t`` are known once those are, and flce's gradient formula (flce.semantics) takes them as the
per-row scales of ``-logp`` and of the entropy. Derivatives follow torch's conventions at the kinks, so that
they are the gradients autograd gives the same formula: a clamp passes the gradient at its bounds, a minimum of
two equal values splits it in halves, |x| has derivative 0 at 0.

Matched against TRL 1.16.0's ``GRPOTrainer._compute_loss`` (loss types grpo, bnpo, dr_grpo, dapo, cispo, luspo,
sapo; token and sequence importance sampling; ``delta``; the k3 KL with beta; the vLLM importance-sampling
correction; the entropy bonus; its clip-ratio, KL and entropy metrics) and Liger-Kernel's ``ppo_loss_fn``
(the same losses; Liger reports one clip fraction, the region's, over the tokens at both levels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flce.policy.options import PolicyOptions
from flce.policy.tokens import PolicyTokens

Number = float | int | torch.Tensor

# Aggregations of the per-token terms, by what each divides: "token_mean" a token count, "token_sum" nothing,
# "seq_mean_token_mean" each sequence's count and the number of sequences, "seq_mean_token_sum" the number of
# sequences, "seq_mean_token_sum_norm" that and a horizon (verl's loss_agg_mode names, with underscores).
AGGREGATIONS = ("token_mean", "token_sum", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


class SequenceLayout(NamedTuple):
    """Which rows form each sequence: ``length`` consecutive rows each (the padded form), or by ``ids`` (packed:
    a sequence index per row, any order, each < the number of rows)."""

    ids: torch.Tensor | None
    length: int | None

    @staticmethod
    def of(tokens: PolicyTokens) -> SequenceLayout:
        return SequenceLayout(tokens.sequence, tokens.sequence_length)

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's sequence sum of ``x`` [N]: by a reshape in the padded form (deterministic), by index_add."""
        if self.length is not None:
            rows = x.reshape(-1, self.length)
            return rows.sum(-1, keepdim=True).expand_as(rows).reshape(-1)
        assert self.ids is not None, "a sequence reduction needs the sequences' layout"
        return torch.zeros_like(x).index_add_(0, self.ids, x)[self.ids]

    def count(self, like: torch.Tensor, nonempty: torch.Tensor | None = None) -> torch.Tensor:
        """The number of sequences, a 0-d tensor of ``like``'s dtype (packed: the distinct ids present); with
        ``nonempty`` [N], of those whose sum of it is > 0 (verl counts the sequences with a token in the mask)."""
        if nonempty is not None:
            if self.length is not None:
                return (nonempty.reshape(-1, self.length).sum(-1) > 0).sum().to(like.dtype)
            return (torch.zeros_like(like).index_add_(0, self.ids, nonempty.to(like.dtype)) > 0).sum().to(like.dtype)
        if self.length is not None:
            return torch.full((), like.shape[0] // max(1, self.length), dtype=like.dtype, device=like.device)
        assert self.ids is not None
        present = torch.zeros_like(like).index_add_(0, self.ids, torch.ones_like(like))
        return (present > 0).sum().to(like.dtype)


def aggregation_weights(mask: torch.Tensor, layout: SequenceLayout, aggregation: str, *,
                        token_divisor: Number | None = None, sequence_divisor: Number | None = None,
                        horizon: Number | None = None) -> torch.Tensor:
    """Each token's weight ``w_t`` [N] in ``aggregation`` (AGGREGATIONS) of a per-token term, ``mask`` [N] the
    tokens' weights (0 where they do not count). Divisors left None are the batch's own: the mask's sum (at least
    1), the number of sequences; ``horizon`` (seq_mean_token_sum_norm) has no default."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: expected one of {AGGREGATIONS}")
    if aggregation == "token_sum":
        return mask
    if aggregation == "token_mean":
        return mask / (mask.sum().clamp(min=1.0) if token_divisor is None else token_divisor)
    sequences = layout.count(mask) if sequence_divisor is None else sequence_divisor
    if aggregation == "seq_mean_token_mean":
        return mask / (layout.sums(mask).clamp(min=1.0) * sequences)
    if aggregation == "seq_mean_token_sum":
        return mask / sequences
    if horizon is None:
        raise ValueError("horizon=None: the seq_mean_token_sum_norm aggregation divides by a horizon (TRL's "
                         "max_completion_length, verl's loss_scale_factor)")
    return mask / (sequences * horizon)


def sequence_shares(mask: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Each token's weight in its sequence's mean log ratio: mask / max(the sequence's mask sum, 1)."""
    return mask / layout.sums(mask).clamp(min=1.0)


class TermRows(NamedTuple):
    """A per-token term's value, its derivative along the ratio's log and its direct derivative in logp."""

    value: torch.Tensor
    d_log_ratio: torch.Tensor
    d_logprob: torch.Tensor | float


def policy_term(ratio: torch.Tensor, advantage: torch.Tensor, logprob: torch.Tensor,
                options: PolicyOptions) -> TermRows:
    """P(r) of options.py's ``term``, with d P / d log r (chain through r = exp(log r)) and d P / d logp."""
    low, high = options.ratio_low, options.ratio_high
    if options.term == "cispo":
        weight = torch.clamp(ratio, low, high)  # detached: no gradient along the ratio
        return TermRows(-weight * advantage * logprob, torch.zeros_like(ratio), -weight * advantage)
    if options.term == "pg":
        return TermRows(-advantage * logprob, torch.zeros_like(ratio), -advantage)
    if options.term == "sapo":
        # A 0-d tensor of the advantages' dtype: torch.where of two numbers would be float32.
        tau = torch.where(advantage > 0, advantage.new_full((), options.sapo_tau_pos), options.sapo_tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0))
        return TermRows(-gate * (4.0 / tau) * advantage, -4.0 * advantage * gate * (1.0 - gate) * ratio, 0.0)
    capped = ratio if options.delta is None else torch.clamp(ratio, max=options.delta)
    unclipped, clipped = capped * advantage, torch.clamp(ratio, low, high) * advantage
    # -min(a, b): the smaller branch takes the gradient, both halves of it where they tie (torch.minimum's rule).
    share = torch.where(unclipped < clipped, 1.0, torch.where(unclipped == clipped, 0.5, 0.0))
    through = advantage * ratio
    d_unclipped = through if options.delta is None else torch.where(ratio <= options.delta, through, 0.0)
    d_clipped = torch.where((ratio >= low) & (ratio <= high), through, 0.0)
    return TermRows(-torch.minimum(unclipped, clipped), -(share * d_unclipped + (1.0 - share) * d_clipped), 0.0)


def kl_term(logprob: torch.Tensor, ref: torch.Tensor, options: PolicyOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, d K / d logp) of options.py's ``kl`` estimator; with kl_straight_through, k2's gradient."""
    diff = logprob - ref
    kind = options.kl
    if kind == "k1":
        value, grad = diff, torch.ones_like(diff)
    elif kind == "k2":
        value, grad = 0.5 * diff.square(), diff
    elif kind == "abs":
        value, grad = diff.abs(), torch.sign(diff)
    elif kind == "k3":
        exp = torch.exp(-diff)
        value, grad = exp + diff - 1.0, 1.0 - exp
    else:  # low_var_kl: clamps of the argument and of the value, each passing the gradient inside its bounds
        arg = torch.clamp(-diff, -20.0, 20.0)
        exp = torch.exp(arg)
        unclamped = exp - arg - 1.0
        value = torch.clamp(unclamped, -10.0, 10.0)
        inside = (-diff >= -20.0) & (-diff <= 20.0) & (unclamped >= -10.0) & (unclamped <= 10.0)
        grad = torch.where(inside, 1.0 - exp, 0.0)
    return value, (diff if options.kl_straight_through else grad)


class LogRatio(NamedTuple):
    """The importance ratio's log per token as the term sees it (clamped), and where the clamp passes gradient."""

    value: torch.Tensor
    passes: torch.Tensor | bool


def log_ratio(logprob: torch.Tensor, tokens: PolicyTokens, live: torch.Tensor) -> LogRatio:
    """The ratio's log at options.py's ``level`` (sequence levels: each row its sequence's), clamped."""
    options = tokens.options
    own = torch.zeros_like(logprob) if tokens.old is None else torch.where(live, logprob - tokens.old, 0.0)
    if options.ratio_per_sequence:
        own = SequenceLayout.of(tokens).sums(own * tokens.sequence_share)
    low, high = options.log_ratio_min, options.log_ratio_max
    if low is None and high is None:
        return LogRatio(own, True)
    passes = torch.ones_like(own, dtype=torch.bool)
    if low is not None:
        passes = passes & (own >= low)
    if high is not None:
        passes = passes & (own <= high)
    return LogRatio(torch.clamp(own, low, high), passes)


class PolicyRows(NamedTuple):
    """Per row: its share of the loss (they sum to it), d loss / d logp, and d loss / d entropy (None: no term)."""

    loss: torch.Tensor
    grad_logprob: torch.Tensor
    grad_entropy: torch.Tensor | None


def policy_rows(logprob: torch.Tensor, entropy: torch.Tensor | None, tokens: PolicyTokens) -> PolicyRows:
    """The module docstring's loss and its derivatives, row by row. ``tokens`` are the rows' (a sequence level
    needs all of the call's rows); ``logprob`` must be finite where the row counts (0 elsewhere will do)."""
    options = tokens.options
    weight = tokens.weight
    live = weight != 0
    ratio_log = log_ratio(logprob, tokens, live)
    term = policy_term(torch.exp(ratio_log.value), tokens.advantage, logprob, options)
    rollout = 1.0 if tokens.rollout is None else tokens.rollout
    value = rollout * term.value
    along_ratio = torch.where(live, weight * rollout * term.d_log_ratio, 0.0)
    if options.level == "sequence":
        # d log r_s / d logp_t = share_t: the sequence's whole d loss / d log r_s reaches each of its tokens.
        along_ratio = SequenceLayout.of(tokens).sums(along_ratio) * tokens.sequence_share
    if ratio_log.passes is not True:
        along_ratio = torch.where(ratio_log.passes, along_ratio, 0.0)
    grad = along_ratio + weight * rollout * term.d_logprob
    loss = weight * value
    if options.beta:
        kl, kl_grad = kl_term(logprob, tokens.ref, options)
        kl_weight = weight if tokens.kl_weight is None else tokens.kl_weight
        loss = loss + kl_weight * options.beta * kl
        grad = grad + kl_weight * options.beta * kl_grad
    if tokens.entropy_weight is not None:
        loss = loss + tokens.entropy_weight * entropy
    # Selected, not multiplied: a masked row's old or reference log-prob may be anything (inf included).
    return PolicyRows(torch.where(live, loss, 0.0), torch.where(live, grad, 0.0), tokens.entropy_weight)


def clip_flags(logprob: torch.Tensor, tokens: PolicyTokens, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, whether its ratio was clipped below (advantage < 0) and above (advantage > 0), as TRL flags them
    (the ratio after delta's cap); cispo: above its cap; sapo and pg: never."""
    options = tokens.options
    ratio = torch.exp(log_ratio(logprob, tokens, live).value)
    advantage = tokens.advantage
    never = torch.zeros_like(ratio, dtype=torch.bool)
    if options.term == "clip":
        capped = ratio if options.delta is None else torch.clamp(ratio, max=options.delta)
        return (capped < options.ratio_low) & (advantage < 0), (capped > options.ratio_high) & (advantage > 0)
    if options.term == "cispo":
        return never, (ratio > options.ratio_high) & (advantage > 0)
    return never, never


class PolicyMetrics(NamedTuple):
    """What the trainers log beside the loss, 0-d detached tensors (None where the call has none)."""

    mean_entropy: torch.Tensor | None
    mean_kl: torch.Tensor | None
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio: torch.Tensor


@torch.no_grad()
def policy_metrics(logprob: torch.Tensor, entropy: torch.Tensor | None, tokens: PolicyTokens, mask: torch.Tensor,
                   by_sequence: bool) -> PolicyMetrics:
    """TRL's metrics: entropy and KL as means over ``mask`` [N] (the tokens' weights); the fraction of tokens
    whose ratio was clipped below (advantage < 0) and above (advantage > 0), over the mask, or with
    ``by_sequence`` (a sequence level with one advantage per sequence) over the sequences. cispo: the fraction
    above its cap; sapo: 0."""
    options = tokens.options
    mask = mask.to(logprob.dtype)
    counted = mask.sum().clamp(min=1.0)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask != 0, x * mask, 0.0).sum() / counted

    low, high = clip_flags(logprob, tokens, mask != 0)
    if by_sequence:
        # Each sequence's flags are its rows' (one ratio, one advantage): a row weighs 1 / (its sequence's rows
        # times the number of sequences).
        layout = SequenceLayout.of(tokens)
        per_sequence = 1.0 / (layout.sums(torch.ones_like(logprob)) * layout.count(logprob))

        def fraction(flags: torch.Tensor) -> torch.Tensor:
            return (flags.to(logprob.dtype) * per_sequence).sum()
    else:
        def fraction(flags: torch.Tensor) -> torch.Tensor:
            return mean(flags.to(logprob.dtype))

    kl = None
    if tokens.ref is not None:
        kl = mean(kl_term(logprob, tokens.ref, options)[0])
    return PolicyMetrics(None if entropy is None else mean(entropy), kl, fraction(low), fraction(high),
                         fraction(low | high))
