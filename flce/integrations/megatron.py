"""Megatron-core adapter: a GPTModel's LM head and vocab-parallel cross-entropy through flce.

    from flce.integrations import megatron as flce_megatron
    flce_megatron.apply(model)            # model: a megatron.core GPTModel, possibly wrapped (DDP, Float16Module)
    loss = model(input_ids, position_ids, attention_mask, labels=labels)   # [b, s] per-token loss, as before

Unpatched, the last pipeline stage computes ``logits = output_layer(hidden)`` ([s, b, V/tp] per
rank) and then Megatron's vocab-parallel cross-entropy. Patched, it hands ``hidden``, this rank's
``[V/tp, H]`` head weight and the labels to flce with ``process_group`` = the head's tensor-parallel
group: no logits are stored, and the loss and gradients are those of the unpatched model. Any
tensor-parallel size works; with sequence parallelism the hidden states are gathered along the
sequence first (forward all-gather; backward keeps this rank's slice of the already complete grad).
Calls without labels (inference, logits wanted) run Megatron's own code unchanged.

For RL (per-token log-probs and entropy of the sampled tokens, with a temperature), megatron-core's
``output_processor`` hook (0.19) takes :func:`output_processor`, no patch needed:

    process = flce_megatron.output_processor(temperature=0.7, return_logprobs=True, return_entropy=True)
    out = model(input_ids, position_ids, attention_mask, labels=labels, output_processor=process)
    out.logprobs, out.entropy     # [b, s] each, differentiable, as Megatron-LM's RL path computes them

Checked at patch time, failing loudly: the model is a megatron-core GPTModel with a
``_postprocess(hidden_states=..., labels=...)`` step (megatron-core 0.13 and later), no
multi-token prediction, no deferred embedding wgrad, and a head whose input-grad all-reduce is
not disabled (flce performs that all-reduce itself).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import flce
from flce.config import LCEConfig
from flce.errors import InputError, InputTypeError

_PATCHED = "_flce_megatron_head"
# Options fixed by the adapter: Megatron's GPTModel returns an unreduced per-token loss, nothing else.
_FIXED_OPTIONS = ("reduction", "process_group", "return_z_loss", "return_token_accuracy",
                  "return_predicted_tokens", "return_logprobs", "return_entropy")


def apply(model: torch.nn.Module, *, backend: str | None = None, variant: str = "auto",
          **options: Any) -> torch.nn.Module:
    """Route ``model``'s LM-head projection and cross-entropy through flce; returns ``model``.

    ``model`` is a megatron-core ``GPTModel`` or a wrapper of one reachable through ``.module``
    attributes (DistributedDataParallel, Float16Module). On a pipeline stage without the LM head
    there is nothing to do and the model is returned unchanged. ``backend``/``variant`` are those of
    :func:`flce.get_impl`; ``options`` are flce options that keep a per-token loss (e.g.
    ``label_smoothing``, ``lse_square_scale``, ``softcap``, ``memory_budget``, ``accum_dtype``).
    Applying twice replaces the first patch.
    """
    gpt = _find_gpt_model(model)
    if not gpt.post_process:
        return model
    fixed = sorted(set(options) & set(_FIXED_OPTIONS))
    if fixed:
        raise InputError(f"options {fixed}: set by the Megatron adapter (per-token loss, the head's "
                         "tensor-parallel group); remove them")
    LCEConfig(reduction="none", **options)  # validate the option values now, not at the first step
    original = _check_supported(gpt)
    head = _FlceHead(gpt.output_layer, backend, variant, dict(options, reduction="none"))

    def postprocess(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = original.signature.bind(self, *args, **kwargs)
        call = bound.arguments
        inference = call.get("inference_context") is not None and not self.training
        if (call.get("labels") is None or call.get("mtp_in_postprocess") or inference
                or call.get("output_processor") is not None):
            return original.function(self, *args, **kwargs)
        return head.outputs(call["hidden_states"], _head_weight(self), call["labels"])

    remove(gpt)
    gpt._postprocess = types.MethodType(postprocess, gpt)
    setattr(gpt, _PATCHED, head)
    return model


def remove(model: torch.nn.Module) -> None:
    """Undo :func:`apply`: the model computes its logits and loss with Megatron's code again."""
    gpt = _find_gpt_model(model)
    if getattr(gpt, _PATCHED, None) is not None:
        del gpt._postprocess  # the instance attribute; the class's method shows through again
        delattr(gpt, _PATCHED)


def is_applied(model: torch.nn.Module) -> bool:
    return getattr(_find_gpt_model(model), _PATCHED, None) is not None


class _Original:
    """The class's _postprocess and its signature, bound once at patch time."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self.signature = inspect.signature(function)


class _FlceHead:
    """flce over one ColumnParallelLinear head: gather the sequence (sequence parallelism), then flce
    with the head's tensor-parallel group; per-token results come back [b, s], as Megatron's are."""

    def __init__(self, output_layer: torch.nn.Module, backend: str | None, variant: str,
                 options: dict[str, Any]) -> None:
        self.output_layer = output_layer
        self.backend, self.variant, self.options = backend, variant, dict(options)
        group = output_layer.tp_group
        self.group = group if dist.get_world_size(group=group) > 1 else None
        self._loss_fns: dict[torch.device, torch.nn.Module] = {}

    def loss_fn(self, device: torch.device) -> torch.nn.Module:
        if device not in self._loss_fns:
            impl = flce.get_impl(device, backend=self.backend, variant=self.variant)
            self._loss_fns[device] = impl(process_group=self.group, **self.options)
        return self._loss_fns[device]

    def outputs(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Any:
        """From hidden states [s, b, H] (or [s/tp, b, H] with sequence parallelism), this rank's
        [V/tp, H] weight and labels [b, s]: the per-token loss [b, s], or an LCEOutput of [b, s] fields."""
        layer = self.output_layer
        if layer.sequence_parallel and self.group is not None:
            hidden_states = gather_sequence_shards(hidden_states, self.group)
        bias = layer.bias if layer.bias is not None and not layer.skip_bias_add else None
        target = labels.transpose(0, 1)  # [s, b], the hidden states' token order
        out = self.loss_fn(hidden_states.device)(hidden_states, weight, target, bias)
        if isinstance(out, torch.Tensor):
            return out.transpose(0, 1).contiguous()
        return flce.LCEOutput(*(None if t is None or t.dim() < 2 else t.transpose(0, 1).contiguous() for t in out))


def _head_weight(gpt: torch.nn.Module) -> torch.Tensor:
    """The [V/tp, H] head weight this rank holds, as Megatron's own _postprocess picks it."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def output_processor(*, backend: str | None = None, variant: str = "auto", **options: Any) -> Callable[..., Any]:
    """A megatron-core ``output_processor`` (``model(..., labels=labels, output_processor=...)``,
    megatron-core 0.19) that runs flce on the head instead of the logits and the loss.

    ``options`` are flce options with a per-token result (``reduction`` is "none"): typically
    ``temperature`` and ``return_logprobs`` / ``return_entropy`` for RL. The model's forward then
    returns the per-token loss [b, s], or (with a ``return_*`` option) an :class:`flce.LCEOutput`
    whose per-token fields are [b, s]. Sequence parallelism, tied embeddings and the head's bias are
    handled as in :func:`apply`; MuP logit scaling is refused.
    """
    if "reduction" in options or "process_group" in options:
        raise InputError("options reduction / process_group: set by the Megatron adapter (per-token results, "
                         "the head's tensor-parallel group); remove them")
    options = dict(options, reduction="none")
    LCEConfig(**options)  # validate the option values now, not at the first step
    heads: dict[int, _FlceHead] = {}

    def process(*, hidden_states: torch.Tensor, output_layer: torch.nn.Module, output_weight: torch.Tensor | None,
                labels: torch.Tensor | None, config: Any = None, **_context: Any) -> Any:
        if labels is None:
            raise InputError("labels=None: flce's output_processor computes per-token results of the labels; "
                             "call the model without output_processor for logits")
        if getattr(config, "use_mup", False):
            raise NotImplementedError("use_mup=True: Megatron scales the logits (MuP); flce does not apply it")
        head = heads.get(id(output_layer))
        if head is None or head.output_layer is not output_layer:
            head = heads[id(output_layer)] = _FlceHead(output_layer, backend, variant, options)
        weight = output_weight if output_weight is not None else output_layer.weight
        return head.outputs(hidden_states, weight, labels)

    return process


class _GatherSequenceShards(torch.autograd.Function):
    """Forward: all-gather the [s/tp, ...] shards along dim 0. Backward: this rank's slice.

    The slice is the whole backward because flce returns grad_hidden already summed over the
    tensor-parallel ranks (Megatron's own gather would reduce-scatter instead).
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: Any) -> torch.Tensor:
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        start = dist.get_rank(group=group) * shard.shape[0]
        ctx.rows = slice(start, start + shard.shape[0])
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rows].contiguous(), None


def gather_sequence_shards(shard: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel hidden states [s/tp, b, H] -> [s, b, H] for a loss that all-reduces grad_hidden."""
    return _GatherSequenceShards.apply(shard, group)


def _find_gpt_model(model: torch.nn.Module) -> torch.nn.Module:
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as exc:
        raise ImportError(
            "flce.integrations.megatron needs megatron-core (pip install megatron-core, or from a flce "
            f"checkout pip install -e '.[megatron]'): {exc}"
        ) from None
    inner, seen = model, []
    while not isinstance(inner, GPTModel):
        seen.append(type(inner).__name__)
        if not isinstance(getattr(inner, "module", None), torch.nn.Module):
            raise InputTypeError(
                f"model: expected a megatron.core GPTModel or a wrapper of one (.module), got "
                f"{' -> '.join(seen)}"
            )
        inner = inner.module
    return inner


def _check_supported(gpt: torch.nn.Module) -> _Original:
    """Refuse, at patch time, every setting the adapter would get wrong."""
    function = getattr(type(gpt), "_postprocess", None)
    if function is None:
        raise NotImplementedError(
            f"megatron-core {_megatron_version()}: GPTModel has no _postprocess step (added in 0.13); "
            "upgrade megatron-core to use flce.integrations.megatron"
        )
    original = _Original(function)
    missing = {"hidden_states", "labels"} - set(original.signature.parameters)
    if missing:
        raise NotImplementedError(
            f"megatron-core {_megatron_version()}: GPTModel._postprocess has no parameters {sorted(missing)}; "
            "this adapter was written against megatron-core 0.16"
        )
    config = gpt.config
    if getattr(config, "mtp_num_layers", None):
        raise NotImplementedError(
            f"mtp_num_layers={config.mtp_num_layers}: multi-token prediction heads are not routed through flce"
        )
    if getattr(config, "use_mup", False):
        raise NotImplementedError("use_mup=True: Megatron scales the logits (MuP); flce does not apply it")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(
            "defer_embedding_wgrad_compute=True: flce computes the head's weight gradient in its own "
            "backward; turn the deferral off"
        )
    layer = gpt.output_layer
    if getattr(layer, "disable_grad_reduce", False) or getattr(layer, "explicit_expert_comm", False):
        raise NotImplementedError(
            "output_layer reduces its input gradient elsewhere (disable_grad_reduce / expert comm); flce "
            "all-reduces grad_hidden itself, which would count it twice"
        )
    return original


def _megatron_version() -> str:
    try:
        from megatron.core import __version__
    except ImportError:
        return "(unknown version)"
    return str(__version__)
