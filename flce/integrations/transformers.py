"""Hugging Face ``transformers`` adapter: a causal LM's training loss through flce.

    from flce.integrations import transformers as flce_hf
    flce_hf.apply(model)                       # LlamaForCausalLM, Qwen2-, Mistral-, Gemma2ForCausalLM, ...
    out = model(input_ids, labels=labels)      # out.loss as before; out.logits is None
    out.loss.backward()

Unpatched, the model projects every hidden state to a ``[batch, seq, vocab]`` logits tensor
(upcast to fp32 for the loss) and then takes the cross-entropy. Patched, a forward that has
``labels`` and runs with gradients enabled hands the backbone's last hidden states, the LM-head
weight and the labels to flce instead: no logits are stored, and loss and gradients are the
unpatched model's. It follows the model's own loss exactly: labels shifted by one (or
``shift_labels`` when given), ``ignore_index`` (default -100), mean over non-ignored tokens, or
with ``num_items_in_batch`` (gradient accumulation) the sum divided by it, and the final-logit
soft-capping of the config (``final_logit_softcapping``, Gemma 2 and 3) where there is one.

Every other call runs the model's own forward unchanged, so ``model(...).logits`` works when
logits are wanted: without labels (generation, inference) and under ``torch.no_grad()`` (evaluation,
where e.g. ``Trainer`` computes metrics from the logits).

Needs a model whose forward is the usual causal-LM one: ``base_model`` (the backbone, returning
the last hidden states first), ``get_output_embeddings()`` (a linear head), and ``labels`` /
``logits_to_keep`` arguments (transformers >= 4.51; tested with 4.51.3 and 5.23.0 on Llama, Qwen2,
Mistral and Gemma 2).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

import flce
from flce.config import LCEConfig
from flce.errors import InputError, InputTypeError

_PATCHED = "_flce_transformers_patch"
# Options the adapter sets from the model and its loss; the rest (accum_dtype, memory_budget, ...)
# are the caller's. Options that change the math (label_smoothing, lse_square_scale, ...) are
# accepted: the loss is then no longer the unpatched model's, by request.
_FIXED_OPTIONS = ("reduction", "ignore_index", "softcap", "process_group", "return_z_loss",
                  "return_token_accuracy", "return_predicted_tokens", "return_logprobs", "return_entropy")


def apply(model: torch.nn.Module, *, backend: str | None = None, variant: str = "auto",
          **options: Any) -> torch.nn.Module:
    """Compute ``model``'s training loss with flce; returns ``model`` (patched in place).

    ``backend``/``variant`` are those of :func:`flce.get_impl`; ``options`` are further flce
    options (e.g. ``memory_budget``, ``accum_dtype``). Applying twice replaces the first patch.
    """
    fixed = sorted(set(options) & set(_FIXED_OPTIONS))
    if fixed:
        raise InputError(f"options {fixed}: set by the transformers adapter from the model and its loss; remove them")
    LCEConfig(**options)  # validate the option values now, not at the first training step
    _check_supported(model)
    remove(model)
    patch = _Patch(model, backend, variant, options)
    setattr(model, _PATCHED, patch)
    model.forward = types.MethodType(_forward, model)
    return model


def remove(model: torch.nn.Module) -> None:
    """Undo :func:`apply`: the model computes logits and loss with its own code again."""
    patch = getattr(model, _PATCHED, None)
    if patch is not None:
        if patch.instance_forward is not None:
            model.forward = patch.instance_forward  # e.g. accelerate's hooked forward, as it was
        else:
            del model.forward  # the class's forward shows through again
        delattr(model, _PATCHED)


def is_applied(model: torch.nn.Module) -> bool:
    return getattr(model, _PATCHED, None) is not None


def causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    variant: str = "auto",
    **options: Any,
) -> torch.Tensor:
    """transformers' causal-LM loss (``ForCausalLMLoss``) of ``lm_head(hidden_states)``, through flce.

    hidden_states [batch, seq, H]; labels [batch, seq] (shifted here: position i predicts
    labels[i + 1]) or, instead, shift_labels already aligned with the positions. Mean over
    non-ignored tokens, or the sum divided by ``num_items_in_batch`` when given.
    """
    if shift_labels is None:
        if labels is None:
            raise InputError("labels and shift_labels are both None; expected one of them")
        # As transformers does: pad on the right with ignore_index, then drop the first position.
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    weight = lm_head.weight
    bias = getattr(lm_head, "bias", None)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = flce.linear_cross_entropy(
        hidden_states, weight, shift_labels, bias, backend=backend, variant=variant,
        reduction=reduction, ignore_index=ignore_index, softcap=softcap, **options,
    )
    return loss if num_items_in_batch is None else per_item(loss, num_items_in_batch)


def per_item(total: torch.Tensor, num_items_in_batch: torch.Tensor | int) -> torch.Tensor:
    """A summed loss divided by the Trainer's ``num_items_in_batch`` (the tokens counted over the gradient
    accumulation steps; a tensor moved to the loss's device), as transformers' loss functions divide."""
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class _Patch:
    """What the patched forward needs: the forward it replaces, the class forward's signature,
    flce's settings."""

    def __init__(self, model: torch.nn.Module, backend: str | None, variant: str, options: dict[str, Any]) -> None:
        # A forward set on the instance (accelerate's device hooks do that) keeps running when
        # logits are wanted, and comes back on remove().
        self.instance_forward = model.__dict__.get("forward")
        self.forward = model.forward
        self.signature = inspect.signature(type(model).forward)
        self.backend, self.variant, self.options = backend, variant, dict(options)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(text_config, "final_logit_softcapping", None)


def _forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    patch: _Patch = getattr(self, _PATCHED)
    call = _flatten(patch.signature.bind(self, *args, **kwargs))
    call.pop("self")
    # The model computes a loss only when labels are given (shift_labels alone do not ask for one).
    if call.get("labels") is None or not torch.is_grad_enabled():
        return patch.forward(*args, **kwargs)

    labels = call.pop("labels", None)
    logits_to_keep = call.pop("logits_to_keep", 0)
    return_dict = call.pop("return_dict", None)
    # The backbone gets every other argument, loss keywords included, as the model's own forward does.
    outputs = self.base_model(**call)
    hidden_states = _keep_positions(outputs[0], logits_to_keep)
    loss = causal_lm_loss(
        hidden_states, self.get_output_embeddings(), labels,
        num_items_in_batch=call.get("num_items_in_batch"), ignore_index=call.get("ignore_index", -100),
        shift_labels=call.get("shift_labels"), softcap=patch.softcap, backend=patch.backend,
        variant=patch.variant, **patch.options,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The key-value cache's field is `cache` from transformers 5.x (reading or passing the old name
    # `past_key_values` warns on every call), `past_key_values` before: take the name the installed
    # output class declares.
    cache_field = _cache_field(CausalLMOutputWithPast)
    result = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache_field: getattr(outputs, _cache_field(type(outputs)), None)},
    )
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


def _cache_field(output_class: type) -> str:
    """The name under which ``output_class`` (a transformers ModelOutput dataclass) holds the cache."""
    fields = getattr(output_class, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def _flatten(bound: inspect.BoundArguments) -> dict[str, Any]:
    """Named arguments of a call, with the **kwargs entries merged in."""
    call: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        else:
            call[name] = value
    return call


def _keep_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions the model would project to logits (transformers' ``logits_to_keep``)."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    if logits_to_keep.dim() == 1:
        return hidden_states[:, logits_to_keep, :]
    if logits_to_keep.dtype == torch.bool:
        return hidden_states[logits_to_keep]
    return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)


def _check_supported(model: torch.nn.Module) -> None:
    """Fail at apply time, naming what is missing, for models without the causal-LM shape."""
    name = type(model).__name__
    if not hasattr(model, "config") or not hasattr(model, "get_output_embeddings"):
        raise InputTypeError(f"model: expected a transformers PreTrainedModel, got {name}")
    if getattr(model, "base_model", model) is model:
        raise InputTypeError(f"model: {name} is a backbone without an LM head; pass the *ForCausalLM model")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None or head.weight.dim() != 2:
        raise InputTypeError(f"model: {name} has no linear output head (get_output_embeddings() is {head!r})")
    parameters = inspect.signature(type(model).forward).parameters
    missing = [p for p in ("labels", "logits_to_keep") if p not in parameters]
    if missing:
        raise InputTypeError(f"model: {name}.forward has no {missing} argument(s); expected a causal-LM forward")
    loss_type = getattr(model, "loss_type", None)
    if loss_type is not None and loss_type != "ForCausalLM":
        raise InputTypeError(f"model: {name} uses loss_type={loss_type!r}; the adapter reproduces 'ForCausalLM' only")
