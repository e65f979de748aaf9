"""The RL trainers' policy losses through flce's policy loss (flce.integrations.verl.ppo_loss,
flce.integrations.areal.ppo_actor_loss, flce.integrations.trl.GRPOPolicyLossMixin) against the trainers' own
code on the CPU, float64: loss, gradients and metrics.

- verl 0.9.1: its policy losses, agg_loss and kl_penalty themselves (tests/trainer_code.py loads them), on
  materialised log-probs and entropies, combined as its ``ppo_loss`` combines them.
- TRL 1.16.0: ``GRPOTrainer._compute_loss`` itself, run on a stand-in trainer around a tiny Llama, against the
  mixin on the same model (the gradients of every parameter).
- AReaL: not installed (its functions import the whole package); against its ``ppo_actor_loss_fn`` restated here.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from policy_cases import PolicyCase, packed, policy_case
from trainer_code import VerlConfig, trl_compute_loss, verl_ppo_loss

from flce.integrations import areal as flce_areal
from flce.integrations import trl as flce_trl
from flce.integrations import verl as flce_verl

FP64 = dict(rtol=1e-9, atol=1e-11)
TEMPERATURE = 0.7


def _materialised(case: PolicyCase) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(float64 leaves, per-token log-probs, entropies) of materialised logits: the trainers' own input."""
    leaves = [t.detach().double().requires_grad_() for t in case.leaves()]
    logits = leaves[0] @ leaves[1].T + (0 if case.bias is None else leaves[2])
    log_p = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    logprobs = log_p.gather(-1, case.target.clamp(min=0)[..., None]).squeeze(-1)
    return leaves, logprobs, -(log_p.exp() * log_p).sum(-1)


# The trainers compute some metrics in float32 (verl's clip fractions from .float() flags).
METRIC_TOLERANCE = dict(rtol=1e-6, atol=1e-8)


def _close(got: Any, want: Any, what: str, tolerance: dict | None = None) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               **(tolerance or FP64), msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- verl

def _verl_config(mode: str, agg: str, **changes: Any) -> VerlConfig:
    config = VerlConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=agg,
                        loss_scale_factor=None, entropy_coeff=0.01, tau_pos=1.0, tau_neg=1.05, use_kl_loss=True,
                        kl_loss_type="low_var_kl", kl_loss_coef=0.04, policy_loss={"loss_mode": mode})
    config.update(changes)
    config["global_batch_info"] = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                       loss_scale_factor=config["loss_scale_factor"])
    config["global_batch_info"].update(changes.pop("global_batch_info", {}))
    return config


def _verl_check(case: PolicyCase, config: VerlConfig, **call: Any) -> None:
    loss, metrics = flce_verl.ppo_loss(
        config, case.hidden, case.weight, case.target, old_log_prob=case.old_logprobs, advantages=case.advantages,
        response_mask=case.mask, rollout_is_weights=case.rollout_is_ratio, ref_log_prob=case.ref_logprobs,
        temperature=TEMPERATURE, bias=case.bias, **call)
    grads = torch.autograd.grad(loss, case.leaves())
    leaves, logprobs, entropy = _materialised(case)
    want_loss, want_metrics = verl_ppo_loss(
        config, logprobs, entropy if config.entropy_coeff else None, old_log_prob=case.old_logprobs,
        advantages=case.advantages, response_mask=case.mask, rollout_is_weights=case.rollout_is_ratio,
        ref_log_prob=case.ref_logprobs)
    _close(loss, want_loss, "loss")
    for got, want in zip(grads, torch.autograd.grad(want_loss, leaves), strict=True):
        _close(got, want, "gradient")
    assert set(metrics) == set(want_metrics), (sorted(metrics), sorted(want_metrics))
    for name, value in want_metrics.items():
        _close(metrics[name], value, name, METRIC_TOLERANCE)


@pytest.mark.parametrize("agg", flce_verl.LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", flce_verl.POLICY_LOSS_MODES)
def test_verl_policy_loss_modes(mode: str, agg: str, generator: torch.Generator) -> None:
    case = policy_case(generator, per_token_advantages=True, ignored=False, bias=True)
    _verl_check(case, _verl_config(mode, agg))


@pytest.mark.parametrize("kl", ["kl", "abs", "mse", "low_var_kl", "k3+", "low_var_kl+"])
def test_verl_kl_types_with_a_far_reference(kl: str, generator: torch.Generator) -> None:
    """A reference 4 nats off: low_var_kl's clamps of the ratio and of the value (10) both cut in."""
    case = policy_case(generator, per_token_advantages=True, ignored=False, ref_noise=4.0)
    _verl_check(case, _verl_config("vanilla", "token-mean", kl_loss_type=kl))


@pytest.mark.parametrize("changes", [
    {"use_kl_loss": False, "entropy_coeff": 0.0},
    {"loss_scale_factor": 4, "loss_agg_mode": "seq-mean-token-sum-norm"},
    {"global_batch_info": {"dp_size": 2, "batch_num_tokens": 30, "global_batch_size": 7}},
    {"clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio": 0.1},
])
def test_verl_configurations(changes: dict, generator: torch.Generator) -> None:
    case = policy_case(generator, per_token_advantages=True, ignored=False)
    changes = dict(changes)
    _verl_check(case, _verl_config("vanilla", changes.pop("loss_agg_mode", "seq-mean-token-mean"), **changes))


@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_verl_packed_form_equals_padded(mode: str, generator: torch.Generator) -> None:
    """verl's remove-padding layout: the same loss from rows [N] with sequence ids."""
    case = policy_case(generator, per_token_advantages=True, ignored=False)
    config = _verl_config(mode, "seq-mean-token-mean")
    rows = packed(case, generator)
    padded_loss, _ = flce_verl.ppo_loss(
        config, case.hidden, case.weight, case.target, old_log_prob=case.old_logprobs, advantages=case.advantages,
        response_mask=case.mask, rollout_is_weights=case.rollout_is_ratio, ref_log_prob=case.ref_logprobs,
        temperature=TEMPERATURE)
    packed_loss, _ = flce_verl.ppo_loss(
        config, rows.hidden, rows.weight, rows.target, old_log_prob=rows.old_logprobs, advantages=rows.advantages,
        response_mask=rows.mask, rollout_is_weights=rows.rollout_is_ratio, ref_log_prob=rows.ref_logprobs,
        temperature=TEMPERATURE, sequence_ids=rows.sequence_ids)
    _close(packed_loss, padded_loss, "loss")


@pytest.mark.parametrize(("changes", "message"), [
    ({"policy_loss": {"loss_mode": "clip_cov"}}, "loss_mode='clip_cov'"),
    ({"loss_agg_mode": "mean"}, "loss_agg_mode='mean'"),
    ({"clip_ratio_c": 1.0}, "clip_ratio_c=1.0"),
    ({"kl_loss_type": "full"}, "kl_loss_type='full'"),
    ({"global_batch_info": {"dp_size": 2}}, "needs batch_num_tokens"),
])
def test_verl_refuses_what_it_does_not_state(changes: dict, message: str, generator: torch.Generator) -> None:
    case = policy_case(generator, per_token_advantages=True, ignored=False)
    with pytest.raises(ValueError, match=message):
        flce_verl.ppo_loss(_verl_config("vanilla", changes.pop("loss_agg_mode", "token-mean"), **changes),
                           case.hidden, case.weight, case.target, old_log_prob=case.old_logprobs,
                           advantages=case.advantages, response_mask=case.mask, ref_log_prob=case.ref_logprobs)


# --------------------------------------------------------------------------- AReaL

def _areal_ppo_actor_loss(logprobs, proximal, old, advantages, eps_clip, loss_mask, eps_clip_higher, c_clip, cap):
    """AReaL's ppo_actor_loss_fn (areal/utils/functional.py), restated: the clipped ratio to the proximal policy,
    the dual clip, the decoupled behaviour weight, the mean over the loss mask's tokens."""
    count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal), 0)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss1, loss2 = -advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_clip, 1 + high)
    loss = torch.max(loss1, loss2)
    if c_clip is not None:
        loss = torch.min(loss, torch.sign(advantages) * c_clip * advantages)
    weight = (proximal - old).exp()
    keep = loss_mask if cap is None else (weight <= cap) & loss_mask
    loss = loss * torch.where(keep, weight, 0.0)
    return torch.where(loss_mask, loss, 0).sum() / count, {"clip_mask": (loss1.detach() < loss2.detach()) & loss_mask}


@pytest.mark.parametrize("settings", [
    dict(eps_clip=0.2),
    dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0),
    dict(eps_clip=0.2, c_clip=1.5, proximal=True, behav_imp_weight_cap=1.1),
])
def test_areal_ppo_actor_loss(settings: dict, generator: torch.Generator) -> None:
    case = policy_case(generator, per_token_advantages=True, ignored=False, bias=True)
    settings = dict(settings)
    proximal = case.ref_logprobs if settings.pop("proximal", False) else None
    loss, stat = flce_areal.ppo_actor_loss(
        case.hidden, case.weight, case.target, old_logprobs=case.old_logprobs, advantages=case.advantages,
        loss_mask=case.mask, proximal_logprobs=proximal, temperature=TEMPERATURE, bias=case.bias, **settings)
    leaves, logprobs, _ = _materialised(case)
    want, want_stat = _areal_ppo_actor_loss(
        logprobs, case.old_logprobs if proximal is None else proximal, case.old_logprobs, case.advantages,
        settings["eps_clip"], case.mask, settings.get("eps_clip_higher"), settings.get("c_clip"),
        settings.get("behav_imp_weight_cap"))
    _close(loss, want, "loss")
    for got, expected in zip(torch.autograd.grad(loss, case.leaves()), torch.autograd.grad(want, leaves), strict=True):
        _close(got, expected, "gradient")
    assert torch.equal(stat["clip_mask"], want_stat["clip_mask"])


# --------------------------------------------------------------------------- TRL

def _tiny_llama(generator: torch.Generator) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=generator)))
    return transformers.LlamaForCausalLM(config).double()


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def autocast(self):
        return torch.autocast("cpu", enabled=False)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1) if tensor.dim() == 0 else tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _stand_in_trainer(model: torch.nn.Module, loss_type: str, level: str, **args: Any) -> SimpleNamespace:
    """The attributes GRPOTrainer._compute_loss reads, TRL's defaults where the test sets none."""
    trainer = SimpleNamespace(
        model=model, loss_type=loss_type, importance_sampling_level=level, beta=0.04, epsilon_low=0.2,
        epsilon_high=0.28, temperature=TEMPERATURE, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=True, vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=2,
        accelerator=_Accelerator(), max_completion_length=8, aux_loss_enabled=False, _entropy_bonus_enabled=True,
        use_adaptive_entropy=False, entropy_coef=0.01, _metrics={m: defaultdict(list) for m in ("train", "eval")},
        args=SimpleNamespace(delta=1.5 if loss_type not in ("cispo", "sapo") else None, use_bias_correction_kl=False,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, steps_per_generation=2))
    if loss_type == "cispo":
        trainer.epsilon_high = 1.3
    vars(trainer).update(args)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False,
                                      compute_aux_loss=False, **_):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1]
        log_p = torch.log_softmax(logits / trainer.temperature, dim=-1)
        logps = log_p.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        return logps, -(log_p.exp() * log_p).sum(-1) if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    return trainer


def _trl_inputs(generator: torch.Generator, per_token_advantages: bool = False) -> dict[str, torch.Tensor]:
    batch, prompt, completion, vocab = 3, 4, 8, 48
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    completion_mask[0, 5:] = 0  # a short completion, padded
    completion_mask[2, 2] = 0
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    return {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt), generator=generator),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (batch, completion), generator=generator),
        "completion_mask": completion_mask,
        "advantages": randn(batch, completion) if per_token_advantages else randn(batch),
        "old_per_token_logps": -3.9 + 0.2 * randn(batch, completion),
        "ref_per_token_logps": -3.9 + 0.4 * randn(batch, completion),
        "importance_sampling_ratio": torch.rand(batch, completion, generator=generator, dtype=torch.float64) + 0.5,
        "num_items_in_batch": completion_mask.sum() * 2,
    }


@pytest.mark.parametrize(("level", "advantages"), [("token", "per sequence"), ("sequence", "per sequence"),
                                                   ("sequence", "per token")])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo"])
def test_trl_grpo_trainer_loss(loss_type: str, level: str, advantages: str, generator: torch.Generator) -> None:
    """The mixin's step against TRL's _compute_loss on the same tiny Llama: loss, every parameter's gradient and
    the logged metrics (training mode, two accumulation steps, the vLLM correction, delta, beta, the entropy
    bonus; advantages (B,) or, as TRL's subclasses may pass them, (B, T))."""
    compute_loss, _ = trl_compute_loss()
    model = _tiny_llama(generator)
    inputs = _trl_inputs(generator, per_token_advantages=advantages == "per token")
    # old log-probs near the model's own, so that some ratios clip and others do not
    trl_trainer = _stand_in_trainer(model, loss_type, level)
    with torch.no_grad():
        own, _, _ = trl_trainer._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), 8)
    inputs["old_per_token_logps"] = own + 0.2 * torch.randn(own.shape, generator=generator, dtype=own.dtype)
    inputs["ref_per_token_logps"] = own + 0.4 * torch.randn(own.shape, generator=generator, dtype=own.dtype)
    want = compute_loss(trl_trainer, model, inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    want_grads = torch.autograd.grad(want, params)

    flce_trl.add_policy_head(model)
    mixin_trainer = _stand_in_trainer(model, loss_type, level)
    got = flce_trl.GRPOPolicyLossMixin._compute_loss(_bound(mixin_trainer), model, inputs)
    # TRL's sapo rounds its gate temperatures to float32 (torch.where of two Python numbers) whatever the dtype.
    tolerance = METRIC_TOLERANCE if loss_type == "sapo" else None
    _close(got, want, "loss", tolerance)
    for param_grad, want_grad in zip(torch.autograd.grad(got, params), want_grads, strict=True):
        _close(param_grad, want_grad, "parameter gradient", tolerance)
    assert set(mixin_trainer._metrics["train"]) == set(trl_trainer._metrics["train"])
    for name, values in trl_trainer._metrics["train"].items():
        _close(mixin_trainer._metrics["train"][name], values, name, METRIC_TOLERANCE)


def _bound(trainer: SimpleNamespace) -> SimpleNamespace:
    """The stand-in with the mixin's helper methods bound, as a subclass instance would have them."""
    for name in ("_check_flce_supports", "_log_flce_metrics"):
        setattr(trainer, name, getattr(flce_trl.GRPOPolicyLossMixin, name).__get__(trainer))
    return trainer


def test_trl_mixin_refuses_what_it_does_not_state(generator: torch.Generator) -> None:
    model = _tiny_llama(generator)
    flce_trl.add_policy_head(model)
    trainer = _bound(_stand_in_trainer(model, "dapo", "token", top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match="top_entropy_quantile < 1"):
        flce_trl.GRPOPolicyLossMixin._compute_loss(trainer, model, _trl_inputs(generator))


def test_trl_policy_head_keeps_the_original_forward(generator: torch.Generator) -> None:
    model = _tiny_llama(generator)
    ids = torch.randint(0, 48, (2, 5), generator=generator)
    before = model(input_ids=ids).logits
    flce_trl.add_policy_head(model)
    torch.testing.assert_close(model(input_ids=ids).logits, before)
