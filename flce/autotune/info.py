"""Lines for ``python -m flce info``: which cache files were read, and whether a shape hits."""

from __future__ import annotations

import torch

from flce.autotune import cache as cache_files
from flce.autotune import locations
from flce.autotune.devices import device_name, dtype_name
from flce.autotune.lookup import _find
from flce.autotune.schema import VARIANT_NAMES, Entry
from flce.devices import default_device


def info_lines(
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    hidden: int | None = None,
    vocab: int | None = None,
    tokens: int | None = None,
) -> list[str]:
    """The cache sources in lookup order with what each holds; with hidden, vocab and tokens, also
    the entry each backend and variant would use for that shape on ``device`` (default: the current
    accelerator, else the CPU) in ``dtype`` (default: bfloat16 on accelerators, float32 on the CPU)."""
    dev = _resolve(device)
    try:
        name = device_name(dev)
    except Exception as exc:  # a device type this process cannot use: still list the files
        name, dev_note = str(dev), f" (cannot name {dev} here: {exc})"
    else:
        dev_note = ""
    sources = locations.lookup_sources()
    lines = [f"autotune cache, in lookup order{dev_note}:"]
    for rank, source in enumerate(sources, 1):
        lines.append(f"  {rank}. {source.describe()}: {source.path}: {_status(source.path, name)}")
    lines.append("  then: each backend's heuristic")
    if hidden is None or vocab is None or tokens is None:
        return lines
    dtype_str = dtype_name(dtype if dtype is not None else (torch.float32 if dev.type == "cpu" else torch.bfloat16))
    shape = f"{dtype_str} H={hidden} V={vocab} tokens={tokens} on {name!r}"
    hits = []
    for backend in sorted({e.backend for e in _entries_for(sources, name)}):
        for variant in VARIANT_NAMES:
            entry = _find(sources, name, dtype_str, hidden, vocab, tokens, backend, variant)
            if entry is not None:
                hits.append(f"  hit: {backend}/{variant} -> {_describe(entry)}")
    if hits:
        lines.append(f"shape {shape}:")
        lines.extend(hits)
    else:
        lines.append(f"shape {shape}: no cached entry; backends use their heuristic")
    return lines


def _resolve(device: str | torch.device | None) -> torch.device:
    if device is None:
        return default_device()
    return torch.device(device) if isinstance(device, str) else device


def _status(path: object, device: str) -> str:
    loaded = cache_files.cached_file(path)
    if loaded.status == cache_files.ABSENT:
        return "absent"
    if not loaded.usable:
        return f"ignored ({loaded.problem})"
    here = sum(1 for e in loaded.entries if e.device == device)
    text = f"read, {len(loaded.entries)} entries ({here} for this device)"
    if loaded.skipped:
        text += f", {len(loaded.skipped)} invalid entries ignored"
    return text


def _entries_for(sources: list[locations.Source], device: str) -> list[Entry]:
    return [e for s in sources for e in cache_files.cached_file(s.path).entries if e.device == device]


def _describe(entry: Entry) -> str:
    params = ", ".join(f"{k}={v}" for k, v in entry.params.items()) or "heuristic params"
    limit = entry.logits_save_limit_bytes
    limit_text = "default" if limit is None else f"{limit / 2**20:.0f} MiB"
    return (f"{params}; logits-save limit {limit_text} (bucket tokens={entry.tokens}, from {entry.source}; "
            f"tuned with flce {entry.measured.get('flce', '?')})")
