"""What dispatch asks the cache: :func:`lookup` (an entry) and :func:`tuned_params` (the one-line
helper every backend's planner calls), plus :func:`override_params` for the tuner.

Each file is parsed once per process and each answer is memoised by its key, so a planner pays a
dictionary lookup per call. Everything here is plain Python on ints and strings: no tensor is
touched, and under ``torch.compile`` the answer is computed at trace time and baked in as a constant.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from flce.autotune import cache as cache_files
from flce.autotune import locations
from flce.autotune.devices import device_name, dtype_name
from flce.autotune.schema import VARIANT_NAMES, Entry, Scalar

Params = dict[str, Scalar]
# Memoised answers of tuned_params; cleared when it grows past this (shapes vary little in training).
_MEMO_LIMIT = 4096
_memo: dict[tuple, tuple[tuple[tuple[str, Scalar], ...] | None, int | None]] = {}
_named_memo: dict[tuple, TunedEntry] = {}


@dataclass(frozen=True)
class _Override:
    params: tuple[tuple[str, Scalar], ...] | None
    logits_save_limit_bytes: int | None
    backend: str | None


_overrides: list[_Override] = []
_DEVICE_SPEC = re.compile(r"^(cpu|cuda|npu|xpu|mps|hip|meta)(:\d+)?$")


def lookup(
    device: str | torch.device,
    dtype: torch.dtype | str,
    *,
    hidden: int,
    vocab: int,
    tokens: int,
    backend: str | None = None,
    variant: str | None = None,
    cache: str | os.PathLike | None = None,
) -> Entry | None:
    """The cached entry for this shape (nearest token bucket), or None when no source has one.

    ``device`` is a torch device ("cuda", "cuda:1", a torch.device) or a device name as the cache
    files store it ("NVIDIA H100 80GB HBM3", "cpu:<model>"); backend and variant None match any.
    Sources are searched in docs/design.md's order, ``cache`` first.
    """
    for name, value in (("hidden", hidden), ("vocab", vocab), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: expected an int >= 0")
    if variant is not None and variant not in VARIANT_NAMES:
        raise ValueError(f"variant={variant!r}: expected None or one of {VARIANT_NAMES}")
    return _find(locations.lookup_sources(cache), _device_key(device), dtype_name(dtype), hidden, vocab, tokens,
                 backend, variant)


def _find(sources: list[locations.Source], device: str, dtype: str, hidden: int, vocab: int, tokens: int,
          backend: str | None, variant: str | None) -> Entry | None:
    for source in sources:
        loaded = cache_files.cached_file(source.path)
        if not loaded.usable:
            continue
        if backend is not None and variant is not None:
            bucket = loaded.by_shape.get((device, backend, variant, dtype, hidden, vocab), [])
        else:
            bucket = [e for key, entries in loaded.by_shape.items()
                      if key[0] == device and key[3] == dtype and key[4] == hidden and key[5] == vocab
                      and backend in (None, key[1]) and variant in (None, key[2])
                      for e in entries]
        if bucket:
            return cache_files.nearest_bucket(bucket, tokens)
    return None


def _device_key(device: str | torch.device) -> str:
    if isinstance(device, str):
        if not _DEVICE_SPEC.match(device.strip()):
            return device
        device = torch.device(device.strip())
    if isinstance(device, torch.device):
        try:
            return device_name(device)
        except Exception as exc:  # e.g. "cuda" in a process without CUDA
            raise ValueError(f"device={str(device)!r}: cannot tell its name in this process ({exc}); "
                             "pass the device name as the cache stores it instead") from None
    raise TypeError(f"device={device!r}: expected a torch.device, a device string or a cached device name")


def tuned_params(
    device: torch.device, backend: str, variant: str, dtype: torch.dtype | str, hidden: int, vocab: int, tokens: int
) -> tuple[Params | None, int | None]:
    """(params, logits_save_limit_bytes) for a planner: the cached knobs of the nearest bucket, or
    (None, None) when nothing is cached; either part may be None (use the heuristic for it).

    The planner validates each knob it reads: a file from another flce version may hold knobs it
    no longer knows or values it cannot use, and those must fall back to the heuristic.
    """
    if _overrides:
        override = _overrides[-1]
        if override.backend in (None, backend):
            return _as_dict(override.params), override.logits_save_limit_bytes
    if torch.compiler.is_compiling():
        # len(range(n)) makes dynamo specialise a symbolic size to a constant, which the
        # constant-result function needs; the chunk loop specialises on the token count anyway.
        items, limit = _constant_lookup(device.type, device.index, backend, variant, dtype_name(dtype),
                                        len(range(hidden)), len(range(vocab)), len(range(tokens)))
        return _as_dict(items), limit
    items, limit = _memoised_lookup(device.type, device.index, backend, variant, dtype_name(dtype),
                                    hidden, vocab, tokens)
    return _as_dict(items), limit


def _memoised_lookup(
    device_type: str, device_index: int | None, backend: str, variant: str, dtype: str, hidden: int, vocab: int,
    tokens: int,
) -> tuple[tuple[tuple[str, Scalar], ...] | None, int | None]:
    key = (device_type, device_index, backend, variant, dtype, hidden, vocab, tokens,
           os.environ.get(locations.CACHE_ENV), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"),
           locations.DEFAULTS_DIR, cache_files.generation)
    answer = _memo.get(key)
    if answer is None:
        device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
        entry = _find(locations.lookup_sources(), device_name(device), dtype, hidden, vocab, tokens, backend, variant)
        answer = (None, None) if entry is None else (tuple(entry.params.items()), entry.logits_save_limit_bytes)
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        _memo[key] = answer
    return answer


# Dynamo calls this eagerly while tracing and treats the result as a constant: file reads and
# dictionaries stay out of the graph. torch.compiler.assume_constant_result does exactly this
# marking, but importing it loads torch._dynamo (seconds, and triton) at `import flce`; the marker
# is set directly instead, and tests/test_autotune_cache.py compiles a lookup to hold it to that.
_memoised_lookup._dynamo_marked_constant = True  # type: ignore[attr-defined]
_constant_lookup = _memoised_lookup


@dataclass(frozen=True)
class TunedEntry:
    """What the cache holds for one call's shape: the knobs, the logits-save limit (either None where it
    holds nothing) and where they came from, for the record of the call's choice."""

    params: Params | None
    logits_save_limit_bytes: int | None
    source: str

    @property
    def key(self) -> tuple:
        """The entry, hashable (a planner's memo key)."""
        params = None if self.params is None else tuple(sorted(self.params.items()))
        return params, self.logits_save_limit_bytes, self.source


def tuned_entry(device: str, backend: str, variant: str, dtype: torch.dtype | str, hidden: int, vocab: int,
                tokens: int) -> TunedEntry:
    """:func:`tuned_params` for a device named as the cache names it (``device_name``), with the entry's
    file and token bucket: what a planner reads, and what ``python -m flce explain`` reads for a GPU it
    only knows by name."""
    if _overrides:
        override = _overrides[-1]
        if override.backend in (None, backend):
            return TunedEntry(_as_dict(override.params), override.logits_save_limit_bytes, "override_params")
    key = ("named", device, backend, variant, dtype_name(dtype), hidden, vocab, tokens,
           os.environ.get(locations.CACHE_ENV), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"),
           locations.DEFAULTS_DIR, cache_files.generation)
    answer = _named_memo.get(key)
    if answer is None:
        entry = _find(locations.lookup_sources(), device, dtype_name(dtype), hidden, vocab, tokens, backend, variant)
        if entry is None:
            answer = TunedEntry(None, None, f"none for {device} {backend} {variant} {dtype_name(dtype)} "
                                            f"H {hidden} V {vocab}")
        else:
            answer = TunedEntry(dict(entry.params), entry.logits_save_limit_bytes,
                                f"{entry.source or 'a cache file'}: {entry.device} {entry.variant} "
                                f"{entry.dtype} H {entry.hidden} V {entry.vocab}, tokens bucket {entry.tokens}")
        if len(_named_memo) >= _MEMO_LIMIT:
            _named_memo.clear()
        _named_memo[key] = answer
    return TunedEntry(None if answer.params is None else dict(answer.params), answer.logits_save_limit_bytes,
                      answer.source)


def _as_dict(items: tuple[tuple[str, Scalar], ...] | None) -> Params | None:
    return None if items is None else dict(items)


@contextlib.contextmanager
def override_params(
    params: Mapping[str, Scalar] | None,
    logits_save_limit_bytes: int | None = None,
    *,
    backend: str | None = None,
) -> Iterator[None]:
    """Within the block, :func:`tuned_params` answers (params, logits_save_limit_bytes) instead of
    reading the cache, for ``backend`` (None: every backend). ``params=None`` with no limit makes
    planners use their heuristics, which is how the tuner measures the baseline."""
    if logits_save_limit_bytes is not None and (isinstance(logits_save_limit_bytes, bool)
                                                or not isinstance(logits_save_limit_bytes, int)
                                                or logits_save_limit_bytes < 0):
        raise ValueError(f"logits_save_limit_bytes={logits_save_limit_bytes!r}: expected None or a byte count >= 0")
    override = _Override(None if params is None else tuple(dict(params).items()), logits_save_limit_bytes, backend)
    _overrides.append(override)
    try:
        yield
    finally:
        # Remove this very override (an equal one may be active in an outer block).
        del _overrides[next(i for i in reversed(range(len(_overrides))) if _overrides[i] is override)]


def reload() -> None:
    """Forget every parsed file and memoised answer: the next lookup reads the files again."""
    cache_files.forget()
    _memo.clear()
    _named_memo.clear()
