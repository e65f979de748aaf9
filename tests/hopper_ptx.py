"""What the sm_90a compile tests look for in the PTX, spelled as every Triton flce supports (3.5 to 3.9)
emits it. Everything else they count (wgmma shapes, setmaxnreg, mbarrier waits, bar.sync, stores) is
spelled the same by all of them; where a release spells an instruction differently, the pattern
here takes each spelling, so a test states the instruction once."""

from __future__ import annotations

import re

# A TMA load (global -> shared, completing on an mbarrier). Up to Triton 3.7 the destination is named
# shared::cluster, from 3.8 shared::cta: the same copy for a kernel launched without clusters.
TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global\.mbarrier::complete_tx::bytes")
# A TMA store (shared -> global, tracked by a bulk group): one spelling in 3.5 to 3.9.
TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group")


def count(pattern: re.Pattern[str], ptx: str) -> int:
    """How many times ``pattern`` occurs in ``ptx``."""
    return len(pattern.findall(ptx))
