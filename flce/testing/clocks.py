"""What the GPU's clocks did while a benchmark ran: ``nvidia-smi`` sampled in the background.

Under sustained GEMMs every H100 holds its power cap (the SM clock falls from 1980 to ~1370 MHz on the
machines flce is measured on), which times the floor and the implementations alike. A GPU that is also
held back by its temperature is another matter: one H100 lent for flce's benchmarks reached 87 C within two
seconds of load and ran at 345 MHz under software thermal slowdown, three times slower than its peers, and
each of its timings wrong by a different factor. :class:`ClockSampler` records the clocks, temperature and
the driver's reasons for slowing down over a run, so that a table says which machine state it was measured
in and a thermally held-back run is flagged instead of published.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass

import torch

# nvidia-smi's clocks_event_reasons bits (nvml's clocksEventReasons).
REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
# Reasons that make a run's timings incomparable with another machine's: the GPU is held back by heat or by
# an external power brake, not by the power cap every GPU under full load reaches.
HELD_BACK = 0x8 | 0x20 | 0x40 | 0x80
_QUERY = "clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active"


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    temperature_c: float
    power_w: float
    reasons: int


@dataclass(frozen=True)
class ClockSummary:
    """The samples of one run: SM clock (mean, min, max), hottest reading, mean power, every slowdown reason
    seen, and whether any of them held the GPU back (HELD_BACK)."""

    samples: int
    sm_mhz_mean: float
    sm_mhz_min: float
    sm_mhz_max: float
    temperature_max_c: float
    power_mean_w: float
    reasons: tuple[str, ...]
    held_back: bool

    def describe(self) -> str:
        seen = ", ".join(self.reasons) or "none"
        text = (f"GPU clocks over the run ({self.samples} samples): SM {self.sm_mhz_mean:.0f} MHz mean "
                f"({self.sm_mhz_min:.0f}-{self.sm_mhz_max:.0f}), {self.temperature_max_c:.0f} C at most, "
                f"{self.power_mean_w:.0f} W mean; slowdown reasons seen: {seen}")
        if self.held_back:
            text += (". WARNING: the GPU was held back by heat or a power brake during this run; its timings do "
                     "not compare with another machine's, and ratios within it are suspect")
        return text


def parse_sample(line: str) -> Sample | None:
    """One ``--format=csv,noheader,nounits`` line of _QUERY, or None for a line that is not one (a field
    nvidia-smi reports as "[N/A]", a partial line at the end)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        return Sample(float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 16))
    except ValueError:
        return None


def summarize(samples: list[Sample]) -> ClockSummary | None:
    """The summary of a run's samples; None without any (nothing is claimed about an unsampled run)."""
    if not samples:
        return None
    mhz = [s.sm_mhz for s in samples]
    seen = 0
    for s in samples:
        seen |= s.reasons
    return ClockSummary(
        samples=len(samples), sm_mhz_mean=statistics.fmean(mhz), sm_mhz_min=min(mhz), sm_mhz_max=max(mhz),
        temperature_max_c=max(s.temperature_c for s in samples),
        power_mean_w=statistics.fmean(s.power_w for s in samples),
        reasons=tuple(name for bit, name in REASONS.items() if seen & bit and bit != 0x1),
        held_back=bool(seen & HELD_BACK))


def _nvidia_smi_id(device: torch.device) -> str | None:
    """The GPU's UUID as nvidia-smi's ``-i`` takes it (the CUDA index may be remapped by
    CUDA_VISIBLE_DEVICES; the UUID is not), or None where torch does not report one."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class ClockSampler:
    """``with ClockSampler(device) as clocks: ...`` then ``clocks.summary``: nvidia-smi sampled every
    ``interval_ms`` over the block. ``summary`` is None where there is nothing to sample (a CPU, no
    nvidia-smi on the PATH, a GPU it does not list) or nothing was read."""

    def __init__(self, device: torch.device | str | None = None, *, interval_ms: int = 100) -> None:
        self.device = torch.device(device) if device is not None else None
        self.interval_ms = interval_ms
        self.summary: ClockSummary | None = None
        self._process: subprocess.Popen | None = None
        self._output = None

    def _command(self) -> list[str] | None:
        if self.device is None or self.device.type != "cuda" or shutil.which("nvidia-smi") is None:
            return None
        command = ["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
                   "--loop-ms", str(self.interval_ms)]
        gpu = _nvidia_smi_id(self.device)
        return command + ["--id", gpu] if gpu is not None else command

    def __enter__(self) -> ClockSampler:
        command = self._command()
        if command is not None:
            self._output = tempfile.TemporaryFile(mode="w+")
            self._process = subprocess.Popen(command, stdout=self._output, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None or self._output is None:
            return
        self._process.terminate()
        self._process.wait()
        self._output.seek(0)
        samples = [s for s in map(parse_sample, self._output) if s is not None]
        self._output.close()
        self.summary = summarize(samples)
