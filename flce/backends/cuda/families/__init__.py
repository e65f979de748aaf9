"""The CUDA backend's kernel families (family.py says what one is), registered here, fastest first: where a
role's family does not fit a call, or the heuristic passes over it, the choice (cuda/choice.py) tries the next.
A new family (a Blackwell GEMM, say) is its module beside these and one entry below."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flce.backends.cuda.configs import LaunchSettings
from flce.backends.cuda.families import cublas, triton_gemm, warp_specialized
from flce.backends.cuda.families.family import KernelFamily

FAMILIES: tuple[KernelFamily, ...] = (
    warp_specialized.FAMILY,
    triton_gemm.TMA_FAMILY,
    triton_gemm.FAMILY,
    cublas.FAMILY,
)


def family_named(name: str) -> KernelFamily:
    """The registered family called ``name``."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"kernel family {name!r}: not registered; registered: {[f.name for f in FAMILIES]}")


def families_for(role: str) -> tuple[KernelFamily, ...]:
    """The families that have a kernel for ``role``, in registration order."""
    return tuple(family for family in FAMILIES if role in family.roles)


@dataclass(frozen=True)
class KernelChoice:
    """The launchers' instructions for one call: per role (families/family.py's ROLES) the families that take it,
    the chosen one first and then, in order, those that take its place should a kernel fail to compile (every one
    of them fit for the call; cuBLAS last, which cannot fail); no family for a role the call does not run that way
    (EXPONENTIALS where a chunk's gradient comes from its logits)."""

    chains: Mapping[str, tuple[KernelFamily, ...]] = field(hash=False)
    settings: LaunchSettings

    def family(self, role: str) -> KernelFamily | None:
        """The family chosen for ``role``, None where no family takes it."""
        chain = self.chains.get(role, ())
        return chain[0] if chain else None

    def fallbacks(self, role: str) -> tuple[KernelFamily, ...]:
        return self.chains.get(role, ())[1:]


