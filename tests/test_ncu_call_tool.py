"""tools/profiling/training_call_profile.py's report reading and table on the CPU (its runs need Nsight Compute and
a GPU): ncu's raw CSV with its units row, kernels grouped by name, totals and the call's ratio to the floor."""

from __future__ import annotations

import pytest
from helpers import load_tool

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum",'
          '"dram__bytes_read.sum","dram__bytes_write.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed"')
UNITS = '"","","","","","","","msecond","Gbyte","Mbyte","%"'


def report(*kernels: tuple[str, str, str, str, str]) -> str:
    rows = [f'"{i}","1","python3","host","{name}","1","7","{ms}","{read}","{written}","{sm}"'
            for i, (name, ms, read, written, sm) in enumerate(kernels)]
    return "\n".join(["==PROF== Connected to process 1", HEADER, UNITS, *rows, "==PROF== Disconnected"])


@pytest.fixture(scope="module")
def tool():
    return load_tool("tools/profiling/training_call_profile.py")


def test_report_rows_in_ms_and_gb(tool) -> None:
    rows = tool.read_report(report(("nvjet_sm90_tst_256x128(int)", "1,200.5", "2", "500", "90")))
    assert rows == [{"name": "nvjet_sm90_tst_256x128(int)", tool.DURATION: 1200.5, tool.READ: 2.0,
                     tool.WRITE: 0.5, tool.SM: 90.0}]
    assert tool.read_report("==PROF== nothing profiled") == []


def test_table_groups_kernels_and_compares_the_sums(tool) -> None:
    floor = tool.read_report(report(("nvjet_a(int)", "10", "1", "100", "90"),
                                    ("nvjet_b<1>(int)", "10", "1", "0", "90")))
    call = tool.read_report(report(("_ws_gemm_kernel(int)", "8", "1", "500", "80"),
                                   ("_ws_gemm_kernel(int)", "4", "1", "500", "95"),
                                   ("_scale_rows_kernel(float)", "1", "0.5", "500", "10")))
    text = tool.table(floor, call)
    assert "| call | `_ws_gemm_kernel` | 2 | 12.000 | 2.00 / 1.00 | 85 |" in text  # SM % weighted by time
    assert "| floor | `nvjet_b` | 1 | 10.000 | 1.00 / 0.00 | 90 |" in text
    assert "floor: 20.000 ms of kernels, 2.1 GB of DRAM traffic" in text
    assert "call: 13.000 ms of kernels, 4.0 GB of DRAM traffic" in text
    assert "call / floor: 0.650" in text


def test_metrics_are_what_the_report_reads(tool, capsys) -> None:
    """ncu_training_call.sh asks ncu for the metrics this prints: the ones read_report converts."""
    tool.main(["metrics"])
    assert capsys.readouterr().out.strip().split(",") == [tool.DURATION, tool.READ, tool.WRITE, tool.SM]
