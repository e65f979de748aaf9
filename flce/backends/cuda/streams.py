"""A call's second CUDA stream (flce.engine.distillation.call.Beside): linear distillation's teacher GEMMs run on it,
each waiting only until the chunk before is done with the teacher's buffer, so its tiles fill the multiprocessors
the other GEMMs' last tiles leave idle. Forks and joins are stream waits on events, which CUDA graph capture
records as edges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch


@cache
def _second_stream(device_index: int) -> torch.cuda.Stream:
    """One stream a device for every call: the caching allocator keeps its blocks per stream, so a new stream from
    PyTorch's pool each call (it hands out 32 in turn) would find none cached and allocate afresh, which syncs."""
    return torch.cuda.Stream(device_index)


class CudaSecondStream:
    """flce.engine.distillation.call.Beside on the device's second stream."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = _second_stream(index)
        self.released: torch.cuda.Event | None = None

    @contextmanager
    def run(self) -> Iterator[None]:
        if self.released is None:  # no free() since the last run: after everything launched so far
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        else:
            self.stream.wait_event(self.released)
            self.released = None
        with torch.cuda.stream(self.stream):
            yield

    def join(self, *tensors: torch.Tensor) -> None:
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        for tensor in tensors:
            # allocated on the second stream: its memory is not reused there before the current stream is done
            tensor.record_stream(current)

    def free(self) -> None:
        self.released = torch.cuda.Event()
        self.released.record(torch.cuda.current_stream(self.stream.device))
