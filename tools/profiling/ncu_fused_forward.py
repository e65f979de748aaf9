"""One launch of the fused statistics GEMM and one cuBLAS GEMM of the same shape, between
cudaProfilerStart/Stop, for Nsight Compute to compare (tensor-pipe use, stalls, DRAM traffic):

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section WarpStateStats python tools/profiling/ncu_fused_forward.py 8192x4096x128256
"""

from __future__ import annotations

import argparse

import torch

from flce.backends.cuda.configs import default_gemm_config
from flce.backends.cuda.gemm_ops import gemm_row_stats
from flce.backends.cuda.hardware import describe_device
from flce.config import LCEConfig
from flce.testing.measure import parse_shape, shape_inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape")
    args = parser.parse_args()
    x, w, t, _ = shape_inputs(*parse_shape(args.shape), "cuda", requires_grad=False)
    config = default_gemm_config(describe_device(x.device), x.dtype)
    gemm_row_stats(x, w, None, t, LCEConfig(), 0, config)  # compiles outside the profiled range
    x @ w.t()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    gemm_row_stats(x, w, None, t, LCEConfig(), 0, config)
    x @ w.t()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
