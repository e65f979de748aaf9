"""Which backend and variant serve a call, resolved where ``torch.compile`` never traces it.

Selection reads hardware probes, environment variables and the file system (is triton-ascend
installed?) and runs each backend's availability and support checks. Dynamo must not trace any
of that: it refuses some of it outright (``importlib.util.find_spec``, ``os.stat``), and what it
can trace it would bake into the graph without guards it can keep. :func:`resolve_call` therefore
takes and returns only constants (device type, names, the call's option values, dtype, H, V),
and is marked as a constant-result function: Dynamo calls it once per compiled graph, outside
the trace, and inlines its answer. Eager calls use the same function, memoised, so both paths
always pick the same backend.

Backends' ``supports(config, dtype, hidden_size, vocab)`` runs here, once per distinct call
signature rather than once per call.
"""

from __future__ import annotations

import os

import torch

from flce.config import Primitive, config_from_primitives, resolve_variant
from flce.errors import InputError
from flce.inputs import FlatInputs
from flce.registry.backend import Backend
from flce.registry.probes import PROBE_ENV, HardwareProbe
from flce.registry.selection import (
    BACKEND_ENV,
    Candidates,
    backend_named,
    candidates_for,
    choose_for_call,
    registry_state,
)

# Environment variables selection reads: part of the memo key, so changing one is seen at once.
_SELECTION_ENV = (BACKEND_ENV, PROBE_ENV, "TRITON_INTERPRET")
# Memoised answers; cleared when it grows past this (a process makes few distinct calls).
_MEMO_LIMIT = 1024
_memo: dict[tuple, tuple[str, str]] = {}


def resolve_call(
    device_type: str,
    backend: str | None,
    variant: str,
    options: tuple[tuple[str, Primitive | tuple[str, str]], ...],
    dtype: torch.dtype,
    hidden_size: int,
    vocab: int,
    bias_dtype: torch.dtype | None,
    class_weight: tuple[int, torch.dtype] | None,
    sharded: bool,
    probe: HardwareProbe | None,
) -> tuple[str, str]:
    """(backend name, concrete variant) for a call; raises as selection does (unknown or
    unavailable backend, nothing supports the call).

    ``options`` are :func:`flce.config.primitive_options` as (name, value) pairs, floats encoded
    by :func:`_constant`; ``class_weight`` is its (length, dtype) or None; ``sharded``: a process
    group shards the vocabulary, so only backends built on the shared engine qualify.
    """
    key = (device_type, backend, variant, options, dtype, hidden_size, vocab, bias_dtype, class_weight, sharded,
           probe, tuple(os.environ.get(name) for name in _SELECTION_ENV), registry_state())
    answer = _memo.get(key)
    if answer is None:
        decoded = {name: _from_constant(value) for name, value in options}
        answer = _resolve(device_type, backend, variant, decoded, dtype, hidden_size, vocab, bias_dtype, class_weight,
                          sharded, probe)
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        _memo[key] = answer
    return answer


# Dynamo calls a function so marked eagerly while tracing and treats its result as a constant
# (torch.compiler.assume_constant_result sets the same marker, but importing it loads
# torch._dynamo at `import flce`). tests/test_compile.py holds the compiled forms to it with
# probes and backend checks that break any graph they are traced into.
resolve_call._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _resolve(
    device_type: str, backend: str | None, variant: str, options: dict[str, Primitive], dtype: torch.dtype,
    hidden_size: int, vocab: int, bias_dtype: torch.dtype | None, class_weight: tuple[int, torch.dtype] | None,
    sharded: bool, probe: HardwareProbe | None,
) -> tuple[str, str]:
    candidates = candidates_for(device_type, backend, probe)
    if sharded:
        candidates = engine_candidates(candidates)
    # class_weight is a tensor option: a meta stand-in of its length and dtype lets the config validate.
    stand_in_weight = None if class_weight is None else torch.empty(class_weight[0], dtype=class_weight[1],
                                                                    device="meta")
    cfg = config_from_primitives(options, class_weight=stand_in_weight)
    chosen = choose_for_call(candidates, cfg, dtype, hidden_size, vocab)
    return chosen.name, resolve_variant(variant, cfg)


def engine_candidates(candidates: Candidates) -> Candidates:
    """Only backends built on the shared engine can scan one vocabulary shard."""
    usable = tuple(b for b in candidates.backends if b.plan_call is not None)
    skipped = tuple((b.name, "does not plan for the shared engine, so it cannot scan a vocabulary shard")
                    for b in candidates.backends if b.plan_call is None)
    if candidates.explicit and skipped:
        raise InputError(f"backend {skipped[0][0]!r} cannot serve process_group: it does not plan for the shared "
                         "engine (no plan_call)")
    return Candidates(usable, candidates.explicit, candidates.passed_over + skipped)


def dispatch(
    device_type: str, backend: str | None, variant: str, cfg_options: dict[str, Primitive], flat: FlatInputs,
    class_weight: torch.Tensor | None, sharded: bool, probe: HardwareProbe | None,
) -> tuple[Backend, str]:
    """The backend and concrete variant for a prepared call, through :func:`resolve_call`.

    Runs inside a torch.compile trace too: everything here but the resolution is attribute reads,
    and sizes pass through ``len(range(n))``, which specialises a symbolic H or V to the constant
    the resolution needs (the token count never enters)."""
    weight = flat.weight
    options = tuple((name, _constant(value)) for name, value in cfg_options.items())
    name, variant = resolve_call(
        device_type, backend, variant, options, weight.dtype,
        len(range(weight.shape[1])), len(range(weight.shape[0])), None if flat.bias is None else flat.bias.dtype,
        None if class_weight is None else (len(range(class_weight.shape[0])), class_weight.dtype),
        sharded, probe,
    )
    return backend_named(name), variant


def _constant(value: Primitive) -> Primitive | tuple[str, str]:
    """A float option as its exact hex spelling: under torch.compile(dynamic=True) a module's float
    attributes are symbolic, and float.hex() is what turns one into a constant (with a guard)."""
    return ("float", value.hex()) if isinstance(value, float) else value


def _from_constant(value: Primitive | tuple[str, str]) -> Primitive:
    return float.fromhex(value[1]) if isinstance(value, tuple) else value
