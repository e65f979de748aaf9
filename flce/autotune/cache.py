"""Reading and writing cache files.

Reads never fail and never block: a missing file has no entries, and an unreadable, corrupt,
truncated, empty, oversized or foreign-schema file is reported once (a RuntimeWarning naming the
path) and contributes none. Only regular files are read, opened without blocking and read no
further than :data:`MAX_FILE_BYTES`: a FIFO with no writer, a device or a directory at a cache path
is reported, never waited on, and never replaced by a save.
Writes go through :func:`update_file`: an exclusive lock on ``<file>.lock``, a fresh read, a merge,
and an atomic rename of a temporary file, so concurrent tuners never lose each other's entries
and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import yaml

from flce.autotune import locations
from flce.autotune.files import UnreadablePathError, read_bytes, special_file
from flce.autotune.schema import (
    FORMER_HEADERS,
    HEADER,
    Entry,
    NewerSchemaError,
    SchemaError,
    ShapeKey,
    document_of,
    is_header,
    merge,
    parse_document,
)

T = TypeVar("T")

try:
    import fcntl
except ImportError:  # Windows: atomic rename still protects readers; concurrent tuners are not serialised.
    fcntl = None

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# Status of a loaded file.
OK, ABSENT, INVALID = "ok", "absent", "invalid"
@dataclass
class CacheFile:
    """One file as read: its entries, indexed by shape for nearest-bucket lookups."""

    path: Path
    status: str
    problem: str | None = None  # why an INVALID file was ignored
    newer_schema: bool = False  # INVALID because a newer flce wrote it: only such an flce may replace it
    skipped: list[str] = field(default_factory=list)  # entries left out of an OK file, and why
    entries: list[Entry] = field(default_factory=list)
    by_shape: dict[ShapeKey, list[Entry]] = field(default_factory=dict)  # each list sorted by tokens

    @property
    def usable(self) -> bool:
        return self.status == OK


def read_file(path: str | os.PathLike) -> CacheFile:
    """Parse a file now (no in-process caching, no warning)."""
    path = Path(path)
    try:
        text = read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        return CacheFile(path, ABSENT)
    except UnreadablePathError as exc:
        return CacheFile(path, INVALID, problem=str(exc))
    except (OSError, UnicodeDecodeError) as exc:
        return CacheFile(path, INVALID, problem=f"cannot be read ({exc})")
    try:
        document = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        return CacheFile(path, INVALID, problem=f"is not valid YAML{at} (corrupt or truncated?)")
    try:
        entries, skipped = parse_document(document)
    except SchemaError as exc:
        return CacheFile(path, INVALID, problem=str(exc), newer_schema=isinstance(exc, NewerSchemaError))
    entries = [replace(e, source=str(path)) for e in entries]
    loaded = CacheFile(path, OK, skipped=skipped, entries=entries)
    for entry in entries:
        loaded.by_shape.setdefault(entry.shape_key, []).append(entry)
    for bucket in loaded.by_shape.values():
        bucket.sort(key=lambda e: e.tokens)
    return loaded


# Files parsed in this process, by resolved path: dispatch parses each file at most once.
_loaded: dict[Path, CacheFile] = {}
_reported: set[tuple[Path, str]] = set()
# Bumped whenever a parsed file is dropped, so answers memoised from it are dropped too.
generation = 0


def cached_file(path: str | os.PathLike) -> CacheFile:
    """The file as parsed the first time this process asked for it; problems warned about once."""
    key = Path(path).expanduser().absolute()
    loaded = _loaded.get(key)
    if loaded is None:
        loaded = _loaded[key] = read_file(key)
        _report(loaded)
    return loaded


def forget(path: str | os.PathLike | None = None) -> None:
    """Drop the parsed copy of one file (all files when None) so the next lookup re-reads it."""
    global generation
    generation += 1
    if path is None:
        _loaded.clear()
    else:
        _loaded.pop(Path(path).expanduser().absolute(), None)


def _report(loaded: CacheFile) -> None:
    messages = []
    if loaded.status == INVALID:
        messages.append(f"flce: ignoring autotune cache {loaded.path}: {loaded.problem}")
    elif loaded.skipped:
        messages.append(f"flce: autotune cache {loaded.path}: ignoring {len(loaded.skipped)} invalid "
                        f"entr{'y' if len(loaded.skipped) == 1 else 'ies'} ({'; '.join(loaded.skipped[:3])})")
    for message in messages:
        if (loaded.path, message) not in _reported:
            _reported.add((loaded.path, message))
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def nearest_bucket(bucket: list[Entry], tokens: int) -> Entry:
    """The entry whose token count is nearest in ratio (ties go to the larger bucket)."""
    target = max(tokens, 1)
    return min(bucket, key=lambda e: (max(e.tokens, target) / min(e.tokens, target), -e.tokens))


def render(entries: list[Entry], comments: list[str] = ()) -> str:
    """The file's text: the header, then ``comments`` (lines starting with '#'), then the YAML."""
    body = yaml.dump(document_of(entries), Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=200)
    return "".join(f"{line}\n" for line in [HEADER, *comments]) + body


def leading_comments(path: Path) -> list[str]:
    """Comment lines at the top of a file, without flce's header: notes such as the command that
    made a shipped file survive later updates."""
    comments = []
    try:
        text = read_bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not is_header(line):
            comments.append(line)
    return comments


def is_flce_file(path: Path) -> bool:
    """True for a file flce wrote (its header survives truncation) or one that parses as a cache."""
    try:
        head = read_bytes(path, limit=max(len(h.encode()) for h in (HEADER, *FORMER_HEADERS)) + 1)
        head = head.decode("utf-8", errors="replace")
    except OSError:
        return False
    if is_header(head.split("\n", 1)[0]):
        return True
    loaded = read_file(path)
    return loaded.status == OK or loaded.newer_schema or (loaded.problem or "").startswith("schema=")


# A top-level `schema:` key at the start of a line: what a cache file says it is, even when the YAML
# after it is truncated or corrupt.
_SCHEMA_LINE = re.compile(r"^schema\s*:", re.MULTILINE)


def claims_to_be_a_cache(path: Path) -> bool:
    """True for a file that says it is an flce cache (flce's header, or a top-level ``schema`` key),
    whatever state the rest is in, and for an empty one (nothing to lose). Only such files may be
    moved aside and replaced by a save; any other file is someone else's."""
    if is_flce_file(path):
        return True
    try:
        text = read_bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return not text.strip() or bool(_SCHEMA_LINE.search(text))


class NotACacheError(ValueError):
    """A save would replace what is not this flce's to replace: a file that is not an flce cache, a
    directory, FIFO or device, or the cache of a newer flce (a newer schema)."""


def _refuse_foreign(path: Path, loaded: CacheFile) -> None:
    # Only an existing file can be someone else's: a path that cannot exist (under a regular file)
    # is an unwritable location, reported as such by the write. A directory, a FIFO or a device is never
    # a cache, whatever it holds.
    if loaded.newer_schema:
        raise NotACacheError(
            f"{path} {loaded.problem}: refusing to replace it: tune with that flce, or pass another --cache path "
            "(or FLCE_AUTOTUNE_CACHE)"
        )
    if loaded.status == INVALID and (special_file(path) or (path.is_file() and not claims_to_be_a_cache(path))):
        raise NotACacheError(
            f"{path} is not an flce autotune cache ({loaded.problem}); refusing to replace it: pass "
            "another --cache path (or FLCE_AUTOTUNE_CACHE), or move the file away yourself"
        )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (created with its folder when missing), and remove the
    lock file before releasing it: no ``.lock`` stays beside the cache. A process that was waiting on
    the removed file sees that it is no longer the live one and locks a fresh one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            # `clear` may have unlinked the lock file while we waited on it; lock the live one.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # Windows cannot remove an open file: it stays there
            os.unlink(lock_path)
        os.close(fd)  # closing releases the flock


def atomic_write(path: Path, text: str) -> None:
    """Write a temporary file beside ``path``, flush it to disk, and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass
class UpdateResult:
    path: Path
    entries: int  # entries in the file after the update
    moved_aside: Path | None = None  # where a corrupt or foreign file went
    problem: str | None = None  # what was wrong with it


def update_file(path: str | os.PathLike, new_entries: list[Entry]) -> UpdateResult:
    """Merge entries into the file under its lock. A cache file that is corrupt, of another schema
    or holds invalid entries is moved to ``<name>.corrupt-<timestamp>`` first (its valid entries,
    if any, are carried over). Raises NotACacheError, touching nothing, when the file is not an flce
    cache at all, and OSError when the location cannot be written."""
    path = _write_path(path)
    _refuse_foreign(path, read_file(path))  # before the lock: no <name>.lock beside someone else's file
    with locked(path):
        current = read_file(path)
        _refuse_foreign(path, current)
        comments = leading_comments(path) if current.usable else []
        moved = None
        if current.status == INVALID or current.skipped:
            moved = _move_aside(path)
        merged = merge([_without_source(e) for e in current.entries], [_without_source(e) for e in new_entries])
        atomic_write(path, render(merged, comments))
    forget(path)
    problem = current.problem or ("; ".join(current.skipped) if current.skipped else None)
    return UpdateResult(path, len(merged), moved_aside=moved, problem=problem if moved else None)


def remove_file(path: str | os.PathLike) -> int:
    """Delete an flce cache file and its lock file; returns how many entries it held.
    Raises FileNotFoundError when absent and ValueError when the file is not flce's."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(path)
    if not is_flce_file(path):
        raise ValueError(f"{path} is not an flce autotune cache; left untouched")
    with locked(path):
        count = len(read_file(path).entries)
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".lock").unlink(missing_ok=True)
    forget(path)
    return count


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, target)
    return target


def _write_path(path: str | os.PathLike) -> Path:
    """The file a write to ``path`` goes to: through a symbolic link to its target (a link to a shared cache
    stays a link, and the shared file gets the entries), absolute."""
    return Path(path).expanduser().resolve()


def _without_source(entry: Entry) -> Entry:
    return entry if entry.source is None else replace(entry, source=None)


def check_writable(path: Path) -> None:
    """Raise, before anything is measured, what a save to ``path`` would raise: OSError when its
    folder cannot be written, NotACacheError when the file there is someone else's."""
    path = _write_path(path)
    _refuse_foreign(path, read_file(path))  # before the lock: no <name>.lock beside someone else's file
    with locked(path):
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)


def _first_writable(cache: str | os.PathLike | None, log: Callable[[str], None],
                    attempt: Callable[[Path], T]) -> T:
    """attempt(path) at ``cache`` alone when given, else at each of ``FLCE_AUTOTUNE_CACHE`` and the user
    cache in turn until one does not raise OSError (saying so through ``log`` when one is skipped)."""
    targets = locations.write_targets(cache)
    if cache is not None:
        targets = targets[:1]
    failures = []
    for position, target in enumerate(targets):
        try:
            return attempt(target.path)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            failures.append(f"{target.path}: {reason}")
            if position + 1 < len(targets):
                following = targets[position + 1]
                log(f"flce-autotune: cannot write {target.path} ({reason}); "
                    f"writing to {following.path} ({following.describe()}) instead")
    raise OSError(f"no writable autotune cache location ({'; '.join(failures)})")


def save_target(cache: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> Path:
    """Where a tune will write, checked before it measures: ``cache`` itself when given (an explicit
    path is honoured or the tune fails; its folder must exist, a mistyped one is not created), else the
    first writable of ``FLCE_AUTOTUNE_CACHE`` and the user cache. Raises OSError when nothing can be
    written, NotACacheError for a foreign file."""
    def writable(path: Path) -> Path:
        path = _write_path(path)
        if cache is not None and not path.parent.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"no folder {path.parent} (flce creates the folders of "
                                    f"${locations.CACHE_ENV} and of the user cache, not of a path given)")
        check_writable(path)
        return path

    return _first_writable(cache, log, writable)


def save_entries(
    entries: list[Entry], cache: str | os.PathLike | None = None, log: Callable[[str], None] = print
) -> UpdateResult:
    """Merge entries into ``cache`` when given (no other location), else into the first writable
    of ``FLCE_AUTOTUNE_CACHE`` and the user cache, saying through ``log`` when a location is skipped
    or a bad cache file is moved aside. Raises OSError when no location can be written, and
    NotACacheError for a file that is not an flce cache."""
    def update(path: Path) -> UpdateResult:
        result = update_file(path, entries)
        if result.moved_aside is not None:
            log(f"flce-autotune: {path} was not a usable cache ({result.problem}); "
                f"moved it to {result.moved_aside} and wrote a fresh one")
        return result

    return _first_writable(cache, log, update)
