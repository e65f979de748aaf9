"""The Gluon API as flce's kernels use it, on every Triton flce supports (3.5 to 3.9).

Gluon is experimental and its names move between Triton releases. The kernels import the moving
names from here, so a new Triton is an edit of this module, not a branch in each kernel:

================  ==========================================  =============================================
kernels call      Triton 3.5 - 3.7                            Triton 3.8 - 3.9
================  ==========================================  =============================================
tma_load          tma.async_copy_global_to_shared             tma.async_load (3.8 keeps the old name as an
                                                              alias, 3.9 makes it raise)
tma_store         tma.async_copy_shared_to_global             tma.async_store (likewise)
cta_barrier       gl.thread_barrier (3.5, 3.6), gl.barrier    gl.barrier
                  (3.7)
warp_specialize   3.5: gl.warp_specialize(default_args,       gl.warp_specialize([(default_fn, args),
                  default_fn, worker_args, worker_fns,        (worker_fn, args), ...], warps, regs), the form
                  warps, regs), adapted here                  since 3.6
================  ==========================================  =============================================

Each name is bound by what the installed Triton has, not by its version number. Host-side code
(descriptors, GluonASTSource) has not moved in this range. :func:`gluon_support` says whether this
Triton builds flce's Gluon kernels (the warp-specialised Hopper GEMM) and, if not, why; this module
imports without Triton so that the probe can say so.
"""

from __future__ import annotations

import inspect

from flce.backends.cuda.hardware import OLDEST_TRITON, triton_release

# The newest Triton release this module maps; a newer one is tried with the 3.9 names (an older one than
# hardware.OLDEST_TRITON is refused).
NEWEST_TESTED_TRITON = (3, 9)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import tma
except Exception as error:  # no Triton, or one without Gluon (triton-ascend installs itself as `triton`; a
    # broken install raises more than ImportError): the probe reports it, and the kernels are not built
    _IMPORT_ERROR: Exception | None = error
    tma_load = tma_store = cta_barrier = warp_specialize = None
else:
    _IMPORT_ERROR = None
    # The new names first: 3.9 keeps the old ones as functions that raise.
    tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    tma_store = getattr(tma, "async_store", None) or getattr(tma, "async_copy_shared_to_global", None)
    cta_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)

    if "functions_and_args" in inspect.signature(gl.warp_specialize).parameters:
        warp_specialize = gl.warp_specialize
    else:
        # Triton 3.5 hands one argument tuple to every worker partition. Each worker gets the table of
        # all workers' (function, arguments) pairs, and an adapter calls its own pair: the kernels keep
        # the partition-list form, and each partition receives exactly its own arguments.
        @gluon.jit
        def _worker_0(table):
            table[0][0](*table[0][1])

        @gluon.jit
        def _worker_1(table):
            table[1][0](*table[1][1])

        @gluon.jit
        def _worker_2(table):
            table[2][0](*table[2][1])

        _WORKER_ADAPTERS = (_worker_0, _worker_1, _worker_2)

        @builtin
        def warp_specialize(functions_and_args, worker_num_warps, worker_num_regs, _semantic=None,
                            _generator=None):
            """gl.warp_specialize([(default_fn, args), (worker_fn, args), ...], warps, regs) on Triton 3.5."""
            default_fn, default_args = functions_and_args[0]
            workers = functions_and_args[1:]
            if len(workers) > len(_WORKER_ADAPTERS):
                raise ValueError(f"warp_specialize: {len(workers)} worker partitions; on Triton 3.5 flce's "
                                 f"adapter takes at most {len(_WORKER_ADAPTERS)}")
            table = gl.tuple([gl.tuple([gl.constexpr(fn), args]) for fn, args in workers])
            return gl.warp_specialize(default_args, default_fn, gl.tuple([table]),
                                      list(_WORKER_ADAPTERS[:len(workers)]), worker_num_warps, worker_num_regs,
                                      _semantic=_semantic, _generator=_generator)


def triton_version() -> tuple[int, int] | None:
    """(major, minor) of the importable ``triton`` package (NVIDIA's or triton-ascend's), None without one."""
    try:
        import triton
    except Exception:  # absent, or an install that does not import: no Triton to build with
        return None
    return triton_release(triton.__version__)


_support: tuple[bool, str] | None = None


def gluon_support() -> tuple[bool, str]:
    """(True, what is used) where this Triton builds flce's Gluon kernels (the warp-specialised Hopper
    GEMM of ws_gemm_kernels.py), else (False, why not). Probed once per process."""
    global _support
    if _support is None:
        _support = _probe()
    return _support


def _probe() -> tuple[bool, str]:
    version = triton_version()
    if version is None:
        return False, "triton is not installed"
    name = f"triton {version[0]}.{version[1]}"
    if version < OLDEST_TRITON:
        return False, (f"{name} is older than {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]}, the oldest Gluon API flce's "
                       "kernels are written for")
    if _IMPORT_ERROR is not None:
        return False, f"{name} has no Gluon Hopper module ({_IMPORT_ERROR})"
    missing = [what for what, value in
               (("TMA load", tma_load), ("TMA store", tma_store), ("CTA barrier", cta_barrier)) if value is None]
    if missing:
        return False, f"{name}: Gluon lacks {', '.join(missing)}"
    untested = "" if version <= NEWEST_TESTED_TRITON else (
        f" (newer than {NEWEST_TESTED_TRITON[0]}.{NEWEST_TESTED_TRITON[1]}, the newest tested)")
    return True, f"{name}: Gluon with TMA, wgmma and warp specialisation{untested}"
