"""The loss module that ``flce.get_impl`` returns, and the functional form."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any, ClassVar

import torch

from flce.config import LCEConfig, check_variant, config_from_keywords, primitive_options, resolve_variant
from flce.distributed.dtensor import localize_inputs
from flce.engine.plans import BATCH_INVARIANT_TOKENS
from flce.engine.run import run_backend
from flce.engine.selected import check_selected_ids, selected_logprobs
from flce.errors import InputTypeError
from flce.inputs import FlatInputs, check_token_weights, prepare_inputs
from flce.outputs import LCEOutput
from flce.registry import HardwareProbe, candidates_for, dispatch, registered_backends, resolve_device


class LinearCrossEntropy(torch.nn.Module):
    """``CE(hidden @ weight.T + bias, target)`` without materialising the logits.

    Constructor keywords are docs/design.md's options; ``forward(hidden, weight, target, bias=None, *,
    selected_ids=None, token_weights=None)`` returns the loss, or an :class:`flce.LCEOutput` when a
    ``return_*`` option or ``selected_ids`` (integer ``[*target.shape, K]``: ``selected_logprobs``) is set;
    ``token_weights`` (floating, target's shape, no gradient) multiplies each token's cross-entropy term.
    Subclasses made by :func:`get_impl` fix the device type, backend and variant.
    """

    device_type: ClassVar[str] = "cpu"
    backend_name: ClassVar[str | None] = None
    variant: ClassVar[str] = "auto"
    probe: ClassVar[HardwareProbe | None] = None

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = _checked_config("LinearCrossEntropy", self.variant, options)
        # A buffer, so module.to(device) moves the class weights with the module.
        self.register_buffer("class_weight", self.config.class_weight, persistent=False)

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
        *, selected_ids: torch.Tensor | None = None, token_weights: torch.Tensor | None = None,
    ) -> torch.Tensor | LCEOutput:
        cfg = self.config
        # The buffer is what the call weighs by, as nn.CrossEntropyLoss.weight: moved with the module, or
        # assigned (a tensor weighs, None unweighs).
        if self.class_weight is not cfg.class_weight:
            cfg = cfg.replace(class_weight=self.class_weight)
            resolve_variant(self.variant, cfg)  # a plain-variant module refuses class weights assigned to it
        return _compute(hidden, weight, target, bias, cfg, self.variant, self.device_type, self.backend_name,
                        self.probe, selected_ids, token_weights)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """get_impl's classes are made at run time, so pickle cannot find one by name
        (``torch.save(model)`` with this loss as a submodule): rebuild the class from what it
        was made of, then restore the instance's state as for any module."""
        cls = type(self)
        reduced = super().__reduce_ex__(protocol)
        if cls is LinearCrossEntropy or not isinstance(reduced, tuple):
            return reduced
        return (_new_impl_instance, (cls.device_type, cls.backend_name, cls.variant, cls.probe), *reduced[2:])

    def extra_repr(self) -> str:
        options = {k: v for k, v in vars(self.config).items() if k != "class_weight"}
        return f"device_type={self.device_type!r}, backend={self.backend_name!r}, variant={self.variant!r}, {options}"


def _checked_config(caller: str, variant: str, options: dict[str, Any]) -> LCEConfig:
    if "weight" in options:
        # torch's cross_entropy names its class weights weight=; here weight is the LM head's matrix.
        raise InputTypeError(
            f"{caller}() got weight=: flce's keyword for class weights is class_weight= (torch's "
            "cross_entropy calls them weight=); the LM head's weight is the second positional argument"
        )
    config = config_from_keywords(caller, options)
    resolve_variant(variant, config)  # refuses what the variant cannot serve, at construction
    return config


def _compute(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    cfg: LCEConfig, variant: str, device_type: str, backend_name: str | None, probe: HardwareProbe | None,
    selected_ids: torch.Tensor | None = None, token_weights: torch.Tensor | None = None,
) -> torch.Tensor | LCEOutput:
    """One call, shared by the module and the functional form. Selection happens in
    flce.registry.dispatch, which torch.compile never traces.

    ``selected_ids`` asks the call's log-probs too (flce.engine.selected composes the selected ones
    from them); ``token_weights`` rides with the flat inputs into every schedule (the full variant's:
    the plain one has no per-token loss weight); ``batch_invariant`` pads the tokens to whole tiles of
    BATCH_INVARIANT_TOKENS rows, ignored, so that every tile the planner runs has the same shape, and drops
    them from the outputs."""
    hidden, weight, target, bias, cfg = localize_inputs(hidden, weight, target, bias, cfg)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    ids = None
    run_cfg = cfg
    per_token_inputs = tuple(name for name, given in (("token_weights", token_weights), ("selected_ids", selected_ids))
                             if given is not None)
    variant = resolve_variant(variant, cfg, per_token_inputs) if per_token_inputs else variant
    if token_weights is not None:
        flat = dataclasses.replace(flat, token_weight=check_token_weights(token_weights, flat))
    if selected_ids is not None:
        ids = check_selected_ids(selected_ids, flat.token_shape, _global_vocab(flat, cfg), flat.hidden.device)
        run_cfg = cfg.replace(return_logprobs=True)
    n_rows, token_shape = flat.target.shape[0], flat.token_shape
    if cfg.batch_invariant:
        flat, ids = _padded_to_tiles(flat, cfg, ids)
    result = run_prepared(flat, run_cfg, variant, device_type, backend_name, probe)
    if ids is None and not cfg.batch_invariant:
        return result
    out = result if isinstance(result, LCEOutput) else LCEOutput(loss=result)
    if ids is not None:
        offset = 0 if cfg.process_group is None else _vocab_offset(flat, cfg)
        # Detached log-probs detach the selected ones too: composed from them with grad on, they would carry
        # the dot products' gradient without the lse's.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not cfg.detach_extras):
            out = out._replace(selected_logprobs=selected_logprobs(
                flat, cfg, ids, out.logprobs, offset, BATCH_INVARIANT_TOKENS if cfg.batch_invariant else None))
        if not cfg.return_logprobs:
            out = out._replace(logprobs=None)
    if cfg.batch_invariant:
        out = _unpadded(out, cfg, n_rows, token_shape)
    return out if cfg.returns_extras or ids is not None else out.loss


def run_prepared(flat: FlatInputs, cfg: LCEConfig, variant: str, device_type: str, backend_name: str | None,
                 probe: HardwareProbe | None) -> torch.Tensor | LCEOutput:
    """One prepared call (flce.inputs.prepare_inputs) on the backend the registry picks, sharded or not: the
    cross-entropy's, and the policy loss's (flce.policy.api) with ``flat.policy`` set."""
    sharded = cfg.process_group is not None
    backend, variant = dispatch(device_type, backend_name, variant, primitive_options(cfg), flat, cfg.class_weight,
                                sharded, probe)
    if sharded:
        from flce.distributed import vocab_parallel_linear_cross_entropy

        return vocab_parallel_linear_cross_entropy(flat, cfg, backend, variant)
    return run_backend(backend, flat, cfg, variant)


def _global_vocab(flat: FlatInputs, cfg: LCEConfig) -> int:
    if cfg.process_group is None:
        return flat.weight.shape[0]
    from flce.distributed.shards import vocab_shard

    return vocab_shard(cfg.process_group, flat.weight).global_vocab


def _vocab_offset(flat: FlatInputs, cfg: LCEConfig) -> int:
    from flce.distributed.shards import vocab_shard

    return vocab_shard(cfg.process_group, flat.weight).offset


def _padded_to_tiles(flat: FlatInputs, cfg: LCEConfig,
                     ids: torch.Tensor | None) -> tuple[FlatInputs, torch.Tensor | None]:
    """The tokens padded with ignored zero rows to a multiple of BATCH_INVARIANT_TOKENS."""
    n_rows = flat.target.shape[0]
    pad = -n_rows % BATCH_INVARIANT_TOKENS
    if pad == 0:
        # ids' K by name, not -1: a batch of no tokens has no elements to infer it from.
        return dataclasses.replace(flat, token_shape=torch.Size([n_rows])), (
            None if ids is None else ids.reshape(n_rows, ids.shape[-1]))
    hidden = torch.cat([flat.hidden, flat.hidden.new_zeros(pad, flat.hidden.shape[1])])
    target = torch.cat([flat.target, flat.target.new_full((pad,), cfg.ignore_index)])
    if ids is not None:
        ids = ids.reshape(n_rows, ids.shape[-1])
        ids = torch.cat([ids, ids.new_zeros(pad, ids.shape[1])])
    token_weight = None if flat.token_weight is None else torch.cat([flat.token_weight,
                                                                     flat.token_weight.new_zeros(pad)])
    return dataclasses.replace(flat, hidden=hidden, target=target, token_shape=torch.Size([n_rows + pad]),
                               token_weight=token_weight), ids


def _unpadded(out: LCEOutput, cfg: LCEConfig, n_rows: int, token_shape: torch.Size) -> LCEOutput:
    """The per-token outputs of the real tokens, in the target's shape (scalars pass through)."""
    per_row = cfg.reduction == "none"

    def real(t: torch.Tensor | None, per_token: bool) -> torch.Tensor | None:
        if t is None or not per_token:
            return t
        return t[:n_rows].reshape(*token_shape, *t.shape[1:])

    return LCEOutput(
        loss=real(out.loss, per_row), z_loss=real(out.z_loss, per_row),
        token_accuracy=real(out.token_accuracy, per_row), predicted_tokens=real(out.predicted_tokens, True),
        logprobs=real(out.logprobs, True), entropy=real(out.entropy, True),
        selected_logprobs=real(out.selected_logprobs, True), logit_stats=real(out.logit_stats, True),
    )


def get_impl(
    device: str | torch.device | torch.Tensor | None = None,
    *,
    backend: str | None = None,
    variant: str = "auto",
    probe: HardwareProbe | None = None,
) -> type[LinearCrossEntropy]:
    """The loss-module class for ``device`` (None: the current accelerator, else the CPU).

    ``backend`` forces one backend (else ``FLCE_BACKEND``, else the best available);
    ``variant`` is "auto", "plain" or "full"; ``probe`` replaces the hardware probes (tests).
    """
    check_variant(variant)  # an unknown variant fails here, not at the first call
    device_type = resolve_device(device).type
    # Fail at get_impl, not at the first call, when the named backend cannot serve this device.
    candidates_for(device_type, backend, probe)
    return _impl_class(device_type, backend, variant, probe)


@cache
def _impl_class(device_type: str, backend: str | None, variant: str,
                probe: HardwareProbe | None) -> type[LinearCrossEntropy]:
    name = f"LinearCrossEntropy_{device_type}_{backend or 'auto'}_{variant}"
    attrs = {"device_type": device_type, "backend_name": backend, "variant": variant, "probe": probe,
             "__module__": __name__}
    return type(name, (LinearCrossEntropy,), attrs)


def _new_impl_instance(device_type: str, backend: str | None, variant: str,
                       probe: HardwareProbe | None) -> LinearCrossEntropy:
    """An uninitialised instance of get_impl's class, for unpickling (its state comes next)."""
    cls = _impl_class(device_type, backend, variant, probe)
    return cls.__new__(cls)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    /,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    variant: str = "auto",
    selected_ids: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor | LCEOutput:
    """Functional form of :class:`LinearCrossEntropy` on hidden's device.

    hidden, weight and target are positional: torch's ``weight=`` keyword (class weights) then
    reaches the options and gets a message naming ``class_weight``, not a clash with ``weight``."""
    if not isinstance(hidden, torch.Tensor):
        # Checked here because hidden also names the device: the module's own checks come later.
        raise InputTypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    # No module object per call: building one inside a torch.compile trace would break the graph.
    cfg = _checked_config("linear_cross_entropy", variant, options)
    return _compute(hidden, weight, target, bias, cfg, variant, hidden.device.type, backend, None, selected_ids,
                    token_weights)


# Register the built-in backends at import: a first lookup inside a torch.compile trace would
# have to import them, which dynamo refuses (a graph break in the functional form).
registered_backends()
