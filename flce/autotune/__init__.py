"""The autotune cache: tuned knobs per (device, backend, variant, dtype, H, V, token bucket).

Dispatch calls :func:`tuned_params` (one line in a backend's planner); users and tools call
:func:`lookup` and :func:`info_lines`; backends make themselves tunable with
:func:`register_tuning_space`, one space per loss they tune (:data:`LOSS_KINDS`); ``flce-autotune``
(:mod:`flce.autotune.cli`) fills the cache.
See docs/design.md, "Autotune cache", for the file format and the lookup order.
"""

from flce.autotune.devices import device_name, dtype_name
from flce.autotune.info import info_lines
from flce.autotune.lookup import lookup, override_params, reload, tuned_params
from flce.autotune.schema import SCHEMA_VERSION, Entry
from flce.autotune.spaces import (
    LOSS_KINDS,
    TuneShape,
    TuningSpace,
    register_tuning_space,
    tunable_backends,
    tuning_space,
)

__all__ = [
    "LOSS_KINDS", "SCHEMA_VERSION", "Entry", "TuneShape", "TuningSpace", "device_name", "dtype_name", "info_lines",
    "lookup", "override_params", "register_tuning_space", "reload", "tunable_backends", "tuned_params", "tuning_space",
]
