"""The policy loss's public forms: ``flce.linear_policy_loss``, the module ``flce.get_policy_impl`` returns, and
:func:`policy_loss_of_tokens`, which the trainer adapters (flce.integrations) call with the options and
per-token tensors of their own vocabularies.

The call is flce's usual one (the registry's backend, the engine's schedules, vocab parallelism, the compile
path) with a policy objective (flce.engine.objective): each chunk's gradient forms in the forward from its rows'
log-probs and entropies (a sequence level's once every row's are known), so the scalar loss is the call's only
differentiable output. The per-token log-probs and entropies come back detached, with the metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache
from typing import Any, ClassVar, NamedTuple

import torch

from flce.config import LCEConfig, check_finite_real
from flce.distributed.dtensor import localize_inputs
from flce.inputs import prepare_inputs
from flce.module import run_prepared
from flce.policy.checks import FlatPolicyTensors, flatten_policy_tensors
from flce.policy.loss_types import trl_entropy_weights, trl_options, trl_weights
from flce.policy.options import PolicyOptions
from flce.policy.semantics import Number, policy_metrics, sequence_shares
from flce.policy.tokens import PolicyTokens
from flce.registry import HardwareProbe, candidates_for, resolve_device
from flce.semantics import statistics_dtype


class PolicyLossOutput(NamedTuple):
    """A policy loss and what the trainers log beside it. ``loss`` is differentiable into hidden, weight and
    bias; the rest is detached: per-token ``logprobs`` and ``entropy`` (target's shape, 0 where the target is
    ignore_index; ``entropy`` None where not computed) and 0-d means over the counted tokens (clip ratios over
    the sequences at a sequence level with one advantage per sequence, as TRL reports them)."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    mean_entropy: torch.Tensor | None
    mean_kl: torch.Tensor | None  # None without ref_logprobs
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio: torch.Tensor


def linear_policy_loss(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, /, *,
    mask: torch.Tensor, old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
    loss_type: str = "dapo", epsilon_low: float = 0.2, epsilon_high: float = 0.2, delta: float | None = None,
    beta: float = 0.0, importance_sampling_level: str = "token", temperature: float = 1.0,
    max_completion_length: int | None = None, num_items_in_batch: Number | None = None,
    rollout_is_ratio: torch.Tensor | None = None, entropy_weight: float = 0.0, sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05, sequence_ids: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    return_entropy: bool = True, softcap: float | None = None, ignore_index: int = -100, backend: str | None = None,
    memory_budget: int | None = None, process_group: Any = None, accum_dtype: torch.dtype | None = None,
    precision: str = "fast",
) -> PolicyLossOutput:
    """The policy loss of TRL 1.16's GRPOTrainer (and Liger's ``ppo_loss_fn``) on ``hidden @ weight.T + bias`` at
    ``temperature``, without the logits; flce.policy.loss_types states each ``loss_type`` (docs/policy_loss.md).

    Padded form: hidden [B, T, H], target / mask / old_logprobs / ref_logprobs / rollout_is_ratio [B, T],
    advantages [B] or [B, T]. Packed form: hidden [N, H], those [N], ``sequence_ids`` [N] (each token's sequence,
    in [0, N)), advantages [N]. ``mask``: the tokens' weights (0: not counted; bool, integer or floating); a
    target equal to ``ignore_index`` does not count either. ``old_logprobs`` None: the current log-probs,
    detached (ratio 1); ``ref_logprobs``: needed where ``beta`` > 0. ``num_items_in_batch``: dapo's and cispo's
    divisor (a number or a device tensor; default: the mask's sum); ``max_completion_length``: dr_grpo's.
    ``return_entropy``: the entropies computed for the metrics (they are anyway where ``entropy_weight`` is set).
    ``softcap``, ``backend``, ``memory_budget``, ``process_group``, ``accum_dtype``, ``precision``: as
    flce.linear_cross_entropy's.
    """
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    settings = TrlSettings.of(dict(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
        importance_sampling_level=importance_sampling_level, temperature=temperature, softcap=softcap,
        max_completion_length=max_completion_length, entropy_weight=entropy_weight,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        return_entropy=return_entropy, ignore_index=ignore_index, memory_budget=memory_budget,
        process_group=process_group, accum_dtype=accum_dtype, precision=precision))
    return settings.call(hidden, weight, target, advantages, mask, old_logprobs, ref_logprobs, rollout_is_ratio,
                         sequence_ids, bias, num_items_in_batch, hidden.device.type, backend, None).output


@dataclasses.dataclass(frozen=True)
class TrlSettings:
    """A TRL-style call's scalar options, validated: the policy options and the engine's config."""

    loss_type: str
    options: PolicyOptions
    cfg: LCEConfig
    max_completion_length: int | None
    entropy_weight: float

    @staticmethod
    def of(options: dict[str, Any]) -> TrlSettings:
        unknown = set(options) - set(_TRL_DEFAULTS)
        if unknown:
            raise TypeError(f"LinearPolicyLoss() got unexpected options {sorted(unknown)}; valid options: "
                            f"{', '.join(_TRL_DEFAULTS)}")
        o = {**_TRL_DEFAULTS, **options}
        policy = trl_options(o["loss_type"], o["importance_sampling_level"], epsilon_low=o["epsilon_low"],
                             epsilon_high=o["epsilon_high"], delta=o["delta"], beta=o["beta"],
                             sapo_temperature_pos=o["sapo_temperature_pos"],
                             sapo_temperature_neg=o["sapo_temperature_neg"])
        if not isinstance(o["return_entropy"], bool):
            raise TypeError(f"return_entropy={o['return_entropy']!r}: expected a bool")
        check_finite_real("entropy_weight", o["entropy_weight"])
        cfg = policy_config(temperature=o["temperature"], softcap=o["softcap"], ignore_index=o["ignore_index"],
                            memory_budget=o["memory_budget"], process_group=o["process_group"],
                            accum_dtype=o["accum_dtype"], precision=o["precision"],
                            entropy=o["return_entropy"] or o["entropy_weight"] != 0)
        return TrlSettings(o["loss_type"], policy, cfg, o["max_completion_length"], float(o["entropy_weight"]))

    def call(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
             rollout_is_ratio: torch.Tensor | None, sequence_ids: torch.Tensor | None, bias: torch.Tensor | None,
             num_items_in_batch: Number | None, device_type: str, backend: str | None,
             probe: HardwareProbe | None) -> PolicyCall:
        """The loss with the per-token tensors it was computed from (its ``output`` is linear_policy_loss's)."""
        def weights(flat: FlatPolicyTensors) -> TokenWeights:
            return TokenWeights(trl_weights(self.loss_type, flat.mask, flat.layout,
                                            num_items_in_batch=num_items_in_batch,
                                            max_completion_length=self.max_completion_length),
                                trl_entropy_weights(flat.mask, self.entropy_weight))

        tensors = PolicyInputs(advantages, mask, old_logprobs, ref_logprobs, rollout_is_ratio, sequence_ids)
        return policy_loss_of_tokens(hidden, weight, target, bias, tensors, self.cfg, self.options, weights,
                                     device_type=device_type, backend=backend, probe=probe)


_TRL_DEFAULTS: dict[str, Any] = dict(
    loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, delta=None, beta=0.0, importance_sampling_level="token",
    temperature=1.0, softcap=None, max_completion_length=None, entropy_weight=0.0, sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, return_entropy=True, ignore_index=-100, memory_budget=None, process_group=None,
    accum_dtype=None, precision="fast",
)


def policy_config(*, temperature: float = 1.0, softcap: float | None = None, ignore_index: int = -100,
                  memory_budget: int | None = None, process_group: Any = None, accum_dtype: torch.dtype | None = None,
                  precision: str = "fast", entropy: bool = True) -> LCEConfig:
    """The engine's options for a policy call: the rows' log-probs (and entropies) as detached extras, its loss a
    sum of the objective's row terms (flce.engine.objective), checked as any call's options are."""
    return LCEConfig(ignore_index=ignore_index, reduction="sum", temperature=temperature, softcap=softcap,
                     memory_budget=memory_budget, process_group=process_group, accum_dtype=accum_dtype,
                     precision=precision, return_logprobs=True, return_entropy=entropy, detach_extras=True)


class PolicyInputs(NamedTuple):
    """A call's per-token policy tensors as the user passed them (flce.policy.checks flattens them)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_is_ratio: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None


class TokenWeights(NamedTuple):
    """Each token's weights [N] in a front-end's aggregation: of the policy term, of the entropy (None: no entropy
    term) and of the KL (None: the policy term's)."""

    policy: torch.Tensor
    entropy: torch.Tensor | None = None
    kl: torch.Tensor | None = None


class PolicyCall(NamedTuple):
    """A policy call's result with what it was computed from (the trainer adapters' metrics read them)."""

    output: PolicyLossOutput
    tokens: PolicyTokens
    inputs: FlatPolicyTensors


def policy_loss_of_tokens(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    tensors: PolicyInputs, cfg: LCEConfig, options: PolicyOptions,
    weights: Callable[[FlatPolicyTensors], TokenWeights], *, device_type: str, backend: str | None = None,
    probe: HardwareProbe | None = None,
) -> PolicyCall:
    """One policy call: ``cfg`` from :func:`policy_config`, ``options`` the loss's, ``weights`` (the flattened
    tensors -> each token's weights) the front-end's aggregation."""
    if options.beta and tensors.ref_logprobs is None:
        raise ValueError(f"beta={options.beta} but ref_logprobs=None: the KL penalty needs the reference policy's "
                         "log-probs")
    hidden, weight, target, bias, cfg = localize_inputs(hidden, weight, target, bias, cfg)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    flat_tensors = flatten_policy_tensors(
        target, tensors.advantages, tensors.mask, old_logprobs=tensors.old_logprobs,
        ref_logprobs=tensors.ref_logprobs, rollout_is_ratio=tensors.rollout_is_ratio,
        sequence_ids=tensors.sequence_ids, ignore_index=cfg.ignore_index, dtype=statistics_dtype(flat.hidden.dtype))
    token_weights = weights(flat_tensors)
    if token_weights.entropy is not None and not cfg.return_entropy:
        cfg = cfg.replace(return_entropy=True)
    sequences = options.ratio_per_sequence
    layout = flat_tensors.layout
    tokens = PolicyTokens(
        options=options, advantage=flat_tensors.advantage, weight=token_weights.policy, old=flat_tensors.old,
        ref=flat_tensors.ref, rollout=flat_tensors.rollout, entropy_weight=token_weights.entropy,
        kl_weight=token_weights.kl, sequence=layout.ids if sequences else None,
        sequence_share=sequence_shares(flat_tensors.mask, layout) if sequences else None,
        sequence_length=layout.length if sequences else None)
    out = run_prepared(dataclasses.replace(flat, policy=tokens), cfg, "full", device_type, backend, probe)
    entropy = out.entropy if cfg.return_entropy else None
    metrics = policy_metrics(out.logprobs.reshape(-1), None if entropy is None else entropy.reshape(-1), tokens,
                             flat_tensors.mask, sequences and flat_tensors.per_sequence_advantages)
    return PolicyCall(PolicyLossOutput(out.loss, out.logprobs, entropy, *metrics), tokens, flat_tensors)


class LinearPolicyLoss(torch.nn.Module):
    """:func:`linear_policy_loss` as a module: the constructor takes its options (``loss_type``, ``epsilon_low``,
    ``epsilon_high``, ``delta``, ``beta``, ``importance_sampling_level``, ``temperature``,
    ``max_completion_length``, ``entropy_weight``, ``sapo_temperature_pos`` / ``_neg``, ``return_entropy``,
    ``softcap`` (as flce.linear_cross_entropy's),
    ``ignore_index``, ``memory_budget``, ``process_group``, ``accum_dtype``, ``precision``), ``forward`` the
    tensors. Subclasses made by :func:`get_policy_impl` fix the device type and backend."""

    device_type: ClassVar[str] = "cpu"
    backend_name: ClassVar[str | None] = None
    probe: ClassVar[HardwareProbe | None] = None

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.settings = TrlSettings.of(options)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, *,
                mask: torch.Tensor, old_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, rollout_is_ratio: torch.Tensor | None = None,
                sequence_ids: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                num_items_in_batch: Number | None = None) -> PolicyLossOutput:
        return self.settings.call(hidden, weight, target, advantages, mask, old_logprobs, ref_logprobs,
                                  rollout_is_ratio, sequence_ids, bias, num_items_in_batch, self.device_type,
                                  self.backend_name, self.probe).output

    def __reduce_ex__(self, protocol: int) -> tuple:
        """get_policy_impl's classes are made at run time: rebuilt from what they were made of (as get_impl's)."""
        cls = type(self)
        reduced = super().__reduce_ex__(protocol)
        if cls is LinearPolicyLoss or not isinstance(reduced, tuple):
            return reduced
        return (_new_policy_instance, (cls.device_type, cls.backend_name, cls.probe), *reduced[2:])


def get_policy_impl(device: str | torch.device | torch.Tensor | None = None, *, backend: str | None = None,
                    probe: HardwareProbe | None = None) -> type[LinearPolicyLoss]:
    """The policy-loss module class for ``device`` (None: the current accelerator, else the CPU); ``backend`` as
    :func:`flce.get_impl`'s (reference, cuda, ascend; else ``FLCE_BACKEND``, else the best available)."""
    device_type = resolve_device(device).type
    candidates_for(device_type, backend, probe)
    return _policy_class(device_type, backend, probe)


@cache
def _policy_class(device_type: str, backend: str | None, probe: HardwareProbe | None) -> type[LinearPolicyLoss]:
    name = f"LinearPolicyLoss_{device_type}_{backend or 'auto'}"
    attrs = {"device_type": device_type, "backend_name": backend, "probe": probe, "__module__": __name__}
    return type(name, (LinearPolicyLoss,), attrs)


def _new_policy_instance(device_type: str, backend: str | None, probe: HardwareProbe | None) -> LinearPolicyLoss:
    cls = _policy_class(device_type, backend, probe)
    return cls.__new__(cls)
