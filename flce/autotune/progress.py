"""Progress reporting for ``flce-autotune tune``: a tqdm bar on a terminal when tqdm is installed,
plain lines otherwise (in a pipe or a log file a bar's carriage returns would make one long line;
tqdm is optional, nothing else in flce needs it)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, enabled: bool = True, stream: TextIO | None = None, use_tqdm: bool | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.use_tqdm = (_tqdm_available() and _is_terminal(self.stream)) if use_tqdm is None else use_tqdm
        self._bar = None
        self._done = 0
        self._total = 0

    def start(self, total: int) -> None:
        self._total, self._done = total, 0
        if self.enabled and self.use_tqdm:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="run", dynamic_ncols=True, leave=True)

    def step(self, description: str) -> None:
        """One measurement is about to start."""
        self._done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(description, refresh=False)
            self._bar.update(1)
        else:
            print(f"[{self._done}/{self._total}] {description}", file=self.stream, flush=True)

    def advance(self, count: int) -> None:
        """Measurements that will not run (skipped after a failure)."""
        self._done += count
        if self._bar is not None and count > 0:
            self._bar.update(count)

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _tqdm_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False
