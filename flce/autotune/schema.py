"""The cache file format: ``{schema: 1, entries: [...]}`` and one :class:`Entry` per tuned shape.

Parsing is strict about what dispatch reads (the key, ``params``, the logits-save limit) and
lenient about ``measured``, which is only ever displayed: a file written by another flce
version must never make a lookup crash.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
# The cross-entropy's variants, and linear distillation's entries (flce.linear_distillation_loss: their hidden is
# the student's, their params its planners' tokens_per_chunk and row-kernel knobs).
CROSS_ENTROPY_VARIANTS = ("plain", "full")
DISTILLATION_VARIANT = "distillation"
VARIANT_NAMES = (*CROSS_ENTROPY_VARIANTS, DISTILLATION_VARIANT)
# Marks a file as flce's own: `clear` deletes nothing else, even when the YAML is truncated.
HEADER = "# flce autotune cache (flce-autotune writes this file; format: flce's docs/design.md, 'Autotune cache')"
# Headers that files already on users' disks may carry (it named a design document flce does not ship):
# still flce's own, and replaced by HEADER when such a file is saved again.
FORMER_HEADERS = ("# flce autotune cache (flce-autotune writes this file; see DESIGN.md, 'Autotune cache')",)


def is_header(line: str) -> bool:
    """True for a line (with or without its newline) that marks a file as flce's cache."""
    return line.rstrip("\n") in (HEADER, *FORMER_HEADERS)

Scalar = int | float | str | bool | None
# (device, backend, variant, dtype, hidden, vocab): entries sharing it differ only in token bucket.
ShapeKey = tuple[str, str, str, str, int, int]


# Knobs that count or size something (rows, vocabulary columns, warps, stages, tiles, splits): any
# backend that reads one needs a positive int, so any other value makes the entry invalid, reported
# like every other invalid field. Knobs not listed here are checked by the planner that reads them.
POSITIVE_INT_KNOBS = frozenset({
    "tokens_per_chunk", "block_v", "num_warps", "grad_vocab_block",
    "gemm_block_m", "gemm_block_n", "gemm_block_k", "gemm_group_m", "gemm_warps", "gemm_stages", "gemm_splits",
})


class SchemaError(ValueError):
    """A file or entry that does not follow the schema; the message says where and what."""


class NewerSchemaError(SchemaError):
    """A file of a newer schema than this flce reads: a newer flce wrote it, and only such an flce may
    change it (a save here would drop what this flce cannot read)."""


@dataclass(frozen=True)
class Entry:
    device: str
    backend: str
    variant: str
    dtype: str
    hidden: int
    vocab: int
    tokens: int
    params: dict[str, Scalar]
    logits_save_limit_bytes: int | None = None
    measured: dict[str, Scalar] = field(default_factory=dict)
    # The file this entry was read from; not part of the entry's identity.
    source: str | None = field(default=None, compare=False)

    @property
    def shape_key(self) -> ShapeKey:
        return (self.device, self.backend, self.variant, self.dtype, self.hidden, self.vocab)

    @property
    def key(self) -> tuple[str, str, str, str, int, int, int]:
        """Identity in a file: a newer entry with the same key replaces the older one."""
        return (*self.shape_key, self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "backend": self.backend, "variant": self.variant, "dtype": self.dtype,
            "hidden": self.hidden, "vocab": self.vocab, "tokens": self.tokens,
            "params": dict(self.params),
            "logits_save_limit_bytes": self.logits_save_limit_bytes,
            "measured": dict(self.measured),
        }


def parse_document(document: Any) -> tuple[list[Entry], list[str]]:
    """Entries of a loaded YAML document and one message per entry that was skipped.

    Raises SchemaError when the document as a whole is not an flce cache of this schema.
    """
    if document is None:
        raise SchemaError("the file is empty")
    if not isinstance(document, Mapping):
        raise SchemaError(f"expected a mapping with 'schema' and 'entries' at the top, got a {_kind(document)}")
    if "schema" not in document:
        raise SchemaError("no 'schema' key: not an flce autotune cache")
    schema = document["schema"]
    if isinstance(schema, (int, float)) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
        writer = _writer_version(document.get("entries"))
        reader = f"flce {writer}, which reads it" if writer else f"one that reads schema {schema}"
        raise NewerSchemaError(f"is of schema {schema}, written by a newer flce ({reader}); this flce reads "
                               f"schema {SCHEMA_VERSION}")
    if schema != SCHEMA_VERSION or isinstance(schema, bool):  # 1.0 is 1
        raise SchemaError(f"schema={schema!r}: this flce reads schema {SCHEMA_VERSION}")
    raw_entries = document.get("entries")
    if raw_entries is None:
        return [], []
    if not isinstance(raw_entries, list):
        raise SchemaError(f"entries: expected a list, got a {_kind(raw_entries)}")
    entries, problems = [], []
    for position, raw in enumerate(raw_entries):
        try:
            entries.append(entry_from_dict(raw))
        except SchemaError as exc:
            problems.append(f"entry {position}: {exc}")
    return entries, problems


def _writer_version(raw_entries: Any) -> str | None:
    """The flce version an entry says wrote it (``measured.flce``), if any says so."""
    for raw in raw_entries if isinstance(raw_entries, list) else []:
        measured = raw.get("measured") if isinstance(raw, Mapping) else None
        version = measured.get("flce") if isinstance(measured, Mapping) else None
        if isinstance(version, (str, int, float)) and not isinstance(version, bool):
            return str(version)
    return None


def entry_from_dict(raw: Any, source: str | None = None) -> Entry:
    if not isinstance(raw, Mapping):
        raise SchemaError(f"expected a mapping, got a {_kind(raw)}")
    missing = [name for name in ("device", "backend", "variant", "dtype", "hidden", "vocab", "tokens", "params")
               if name not in raw]
    if missing:
        raise SchemaError(f"missing {', '.join(missing)}")
    for name in ("device", "backend", "dtype"):
        if not isinstance(raw[name], str) or not raw[name].strip():
            raise SchemaError(f"{name}={raw[name]!r}: expected a non-empty string")
    if raw["variant"] not in VARIANT_NAMES:
        raise SchemaError(f"variant={raw['variant']!r}: expected one of {VARIANT_NAMES}")
    for name in ("hidden", "vocab", "tokens"):
        if not _is_int(raw[name]) or raw[name] <= 0:
            raise SchemaError(f"{name}={raw[name]!r}: expected a positive int")
    params = raw["params"]
    if params is None:
        params = {}
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise SchemaError(f"params={params!r}: expected a mapping from knob names to values")
    bad = {k: v for k, v in params.items() if not _is_scalar(v)}
    if bad:
        raise SchemaError(f"params {bad!r}: expected numbers, strings, booleans or null")
    bad = {k: v for k, v in params.items() if k in POSITIVE_INT_KNOBS and not (_is_int(v) and v > 0)}
    if bad:
        raise SchemaError(f"params {', '.join(f'{k}={v!r}' for k, v in bad.items())}: expected a positive int")
    limit = raw.get("logits_save_limit_bytes")
    if limit is not None and (not _is_int(limit) or limit < 0):
        raise SchemaError(f"logits_save_limit_bytes={limit!r}: expected null or a byte count >= 0")
    measured = raw.get("measured") or {}
    if not isinstance(measured, Mapping):
        measured = {}
    return Entry(
        device=raw["device"], backend=raw["backend"], variant=raw["variant"], dtype=raw["dtype"],
        hidden=raw["hidden"], vocab=raw["vocab"], tokens=raw["tokens"], params=dict(params),
        logits_save_limit_bytes=limit,
        # Only scalars are kept: measured is for display, and odd values must not break a table.
        measured={str(k): v for k, v in measured.items() if _is_scalar(v)},
        source=source,
    )


def document_of(entries: list[Entry]) -> dict[str, Any]:
    return {"schema": SCHEMA_VERSION, "entries": [e.to_dict() for e in entries]}


def merge(old: list[Entry], new: list[Entry]) -> list[Entry]:
    """old with each new entry replacing the one of the same key (or appended), order kept."""
    position = {e.key: i for i, e in enumerate(old)}
    merged = list(old)
    for entry in new:
        if entry.key in position:
            merged[position[entry.key]] = entry
        else:
            position[entry.key] = len(merged)
            merged.append(entry)
    return merged


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (int, str, bool))


def _kind(value: Any) -> str:
    return type(value).__name__
