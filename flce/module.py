"""The loss module that ``flce.get_impl`` returns, and the functional form."""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

import torch

from flce.config import LCEConfig, config_from_keywords, primitive_options
from flce.distributed.dtensor import localize_inputs
from flce.engine.run import run_backend
from flce.inputs import prepare_inputs
from flce.outputs import LCEOutput
from flce.registry import VARIANTS, HardwareProbe, candidates_for, dispatch, registered_backends, resolve_device


class LinearCrossEntropy(torch.nn.Module):
    """``CE(hidden @ weight.T + bias, target)`` without materialising the logits.

    Constructor keywords are DESIGN.md's options; ``forward(hidden, weight, target, bias=None)``
    returns the loss, or an :class:`flce.LCEOutput` when a ``return_*`` option is set.
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
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | LCEOutput:
        cfg = self.config
        if self.class_weight is not None and self.class_weight is not cfg.class_weight:
            cfg = cfg.replace(class_weight=self.class_weight)
        return _compute(hidden, weight, target, bias, cfg, self.variant, self.device_type, self.backend_name,
                        self.probe)

    def extra_repr(self) -> str:
        options = {k: v for k, v in vars(self.config).items() if k != "class_weight"}
        return f"device_type={self.device_type!r}, backend={self.backend_name!r}, variant={self.variant!r}, {options}"


def _checked_config(caller: str, variant: str, options: dict[str, Any]) -> LCEConfig:
    config = config_from_keywords(caller, options)
    if variant == "plain" and config.needs_full:
        names = ", ".join(config.full_feature_options())
        raise ValueError(f"variant='plain' cannot serve {names}; use variant='full' or 'auto'")
    return config


def _compute(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    cfg: LCEConfig, variant: str, device_type: str, backend_name: str | None, probe: HardwareProbe | None,
) -> torch.Tensor | LCEOutput:
    """One call, shared by the module and the functional form. Selection happens in
    flce.registry.dispatch, which torch.compile never traces."""
    hidden, weight, target, bias, cfg = localize_inputs(hidden, weight, target, bias, cfg)
    flat = prepare_inputs(hidden, weight, target, bias, cfg)
    sharded = cfg.process_group is not None
    backend, variant = dispatch(device_type, backend_name, variant, primitive_options(cfg), flat, cfg.class_weight,
                                sharded, probe)
    if sharded:
        from flce.distributed import vocab_parallel_linear_cross_entropy

        return vocab_parallel_linear_cross_entropy(flat, cfg, backend, variant)
    return run_backend(backend, flat, cfg, variant)


def _check_variant(variant: str) -> None:
    if variant not in ("auto", *VARIANTS):
        raise ValueError(f"variant={variant!r}: expected 'auto', 'plain' or 'full'")


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
    _check_variant(variant)
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


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
    variant: str = "auto",
    **options: Any,
) -> torch.Tensor | LCEOutput:
    """Functional form of :class:`LinearCrossEntropy` on hidden's device."""
    if not isinstance(hidden, torch.Tensor):
        # Checked here because hidden also names the device: the module's own checks come later.
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    _check_variant(variant)
    # No module object per call: building one inside a torch.compile trace would break the graph.
    cfg = _checked_config("linear_cross_entropy", variant, options)
    return _compute(hidden, weight, target, bias, cfg, variant, hidden.device.type, backend, None)


# Register the built-in backends at import: a first lookup inside a torch.compile trace would
# have to import them, which dynamo refuses (a graph break in the functional form).
registered_backends()
