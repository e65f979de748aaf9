"""Where cache files live, in lookup order.

Lookup: the explicit path > ``FLCE_AUTOTUNE_CACHE`` > the user cache
(``$XDG_CACHE_HOME/flce/autotune.yaml``, default ``~/.cache``) > the defaults shipped in
``flce/autotune/defaults/*.yaml`` > the backend's heuristic. The first source that holds any
entry for a (device, backend, variant, dtype, H, V) answers, with its nearest token bucket: a user
who tuned a shape gets their own numbers, never a mix of theirs and the shipped ones.

Writes (``flce-autotune tune``) go to the first writable of: the explicit path,
``FLCE_AUTOTUNE_CACHE``, the user cache. Shipped defaults are never written by a lookup or a tune
without ``--cache``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "FLCE_AUTOTUNE_CACHE"
USER_FILE_NAME = "autotune.yaml"
# A module attribute, not a constant inlined at call sites, so tests can point it elsewhere.
DEFAULTS_DIR = Path(__file__).resolve().parent / "defaults"


@dataclass(frozen=True)
class Source:
    kind: str  # "argument", "env", "user" or "shipped"
    path: Path

    def describe(self) -> str:
        return {"argument": "cache= argument / --cache", "env": CACHE_ENV, "user": "user cache",
                "shipped": "shipped default"}[self.kind]


def user_cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "flce" / USER_FILE_NAME


def env_cache_path() -> Path | None:
    value = os.environ.get(CACHE_ENV, "").strip()
    return Path(value).expanduser() if value else None


def shipped_paths() -> list[Path]:
    try:
        return sorted(p for p in DEFAULTS_DIR.glob("*.yaml") if p.is_file())
    except OSError:
        return []


def lookup_sources(cache: str | os.PathLike | None = None) -> list[Source]:
    """Every file a lookup consults, highest precedence first, without duplicates."""
    sources = []
    if cache is not None:
        sources.append(Source("argument", Path(cache).expanduser()))
    env = env_cache_path()
    if env is not None:
        sources.append(Source("env", env))
    sources.append(Source("user", user_cache_path()))
    sources.extend(Source("shipped", p) for p in shipped_paths())
    return _unique(sources)


def write_targets(cache: str | os.PathLike | None = None) -> list[Source]:
    """Where a tune may write, first choice first; later ones are the read-only fallbacks."""
    return [s for s in lookup_sources(cache) if s.kind != "shipped"]


def _unique(sources: list[Source]) -> list[Source]:
    seen, unique = set(), []
    for source in sources:
        key = source.path.absolute()
        if key not in seen:
            seen.add(key)
            unique.append(source)
    return unique
