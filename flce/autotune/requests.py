"""What a tune is asked (:class:`TuneRequest`) and what it finds per shape (:class:`ShapeResult`),
and the hook that saves each result as soon as it exists."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flce.autotune import cache as cache_files
from flce.autotune.schema import Entry, Scalar
from flce.autotune.spaces import TuneShape

Params = dict[str, Scalar]


@dataclass
class TuneRequest:
    device: torch.device
    dtypes: list[torch.dtype]
    hiddens: list[int]
    vocabs: list[int]
    tokens: list[int]
    variants: list[str] = field(default_factory=lambda: ["plain", "full"])
    backend: str | None = None  # None: the backend dispatch would pick for this device
    memory_budget: int | None = None  # bytes of working memory a chosen configuration may use
    quick: bool = False
    repeats: int | None = None
    warmup: int | None = None
    seed: int = 0

    def timing(self) -> tuple[int, int]:
        """(warmup, repeats) after the untimed first call: few on the CPU and in quick mode, more
        where timings are cheap."""
        if self.quick:
            warmup, repeats = 0, 3
        elif self.device.type == "cpu":
            warmup, repeats = 1, 5
        else:
            warmup, repeats = 3, 20
        return (self.warmup if self.warmup is not None else warmup,
                self.repeats if self.repeats is not None else repeats)


@dataclass
class ShapeResult:
    shape: TuneShape
    backend: str
    entry: Entry | None = None
    heuristic_params: Params | None = None  # what the planner chose without the cache, when it says
    heuristic_ms: float | None = None
    best_ms: float | None = None
    floor_ms: float | None = None
    peak_mib: float | None = None
    peak_kind: str = "unknown"  # "measured" (allocator statistics), "estimated" (the space's figure)
    tried: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    first_error: str | None = None

    @property
    def speedup(self) -> float | None:
        if self.heuristic_ms and self.best_ms:
            return self.heuristic_ms / self.best_ms
        return None



def save_progressively(cache: str | None, log: Callable[[str], None]) -> Callable[[ShapeResult], None]:
    """An on_result hook that merges each new entry into the cache as soon as it exists; after
    the first write it keeps using the location that worked (no repeated fallback messages)."""
    state: dict = {"cache": cache, "fixed": False}

    def save(result: ShapeResult) -> None:
        if result.entry is None:
            return
        if state["fixed"]:
            update = cache_files.update_file(state["cache"], [result.entry])
        else:
            update = cache_files.save_entries([result.entry], state["cache"], log)
            state["cache"], state["fixed"] = update.path, True
        state["path"] = update.path

    save.state = state
    return save
