"""Linear distillation's options, checks and semantics (the formulas every backend shares).

The public entry points live in :mod:`flce.distillation.api` (``flce.linear_distillation_loss``,
``flce.get_distillation_impl``), above the engine; this package's other modules sit beside
:mod:`flce.semantics`, below it.
"""

from flce.distillation.config import LOSSES, DistillationConfig

__all__ = ["LOSSES", "DistillationConfig"]
