"""The suite tests the same thing whatever the user's shell exports (tests/conftest.py clears the
variables that steer flce and moves the user cache aside)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_exported_steering_variables_do_not_change_the_suite(tmp_path: Path) -> None:
    """With FLCE_BACKEND, faked probes and a cache file exported, tests that check selection and
    chunk planning still pass: they run on what they set up, not on the user's environment."""
    user_cache = tmp_path / "user-cache.yaml"
    user_cache.write_text("this file must not be read or written by the tests\n")
    env = {**os.environ, "FLCE_BACKEND": "reference", "FLCE_PROBE_OVERRIDE": "cuda=1,triton=1",
           "FLCE_AUTOTUNE_CACHE": str(user_cache), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    selected = ["test_module.py::test_info_command_reports_passed_over_backends",
                "test_reference_contract.py::test_plan_respects_memory_budget",
                "test_registry.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert user_cache.read_text() == "this file must not be read or written by the tests\n"
    assert not (tmp_path / "xdg").exists(), "the suite wrote into the user's cache directory"


def test_global_rng_draws_depend_on_the_test_alone(request) -> None:
    """torch's global generator starts each test from a seed of the test's id (conftest.seeded_global_rng), so
    what a test draws from it does not depend on which tests its process ran before; and it is not the
    ``generator`` fixture's stream, which a test may draw from beside it."""
    import torch
    from conftest import _GLOBAL_RNG_OFFSET, _test_seed

    drawn = torch.rand(8)
    seed = _test_seed(request)
    global_stream = torch.Generator().manual_seed((seed + _GLOBAL_RNG_OFFSET) % 2**63)
    assert torch.equal(drawn, torch.rand(8, generator=global_stream))
    assert not torch.equal(drawn, torch.rand(8, generator=torch.Generator().manual_seed(seed)))


class _FakeCuda:
    """torch.cuda's four functions that conftest.release_cached_gpu_memory calls, with a reserve of its choosing."""

    def __init__(self, reserved: int, initialized: bool = True) -> None:
        self.reserved, self.initialized, self.emptied = reserved, initialized, 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def memory_reserved(self) -> int:
        return self.reserved

    def empty_cache(self) -> None:
        self.emptied += 1
        self.reserved = 0


def test_a_large_gpu_reserve_goes_back_after_a_test() -> None:
    """After a test that reserved more than RELEASE_GPU_MEMORY_ABOVE, the cache goes back to the driver (so the
    other xdist worker on the GPU can have it); a small reserve, or a process that never touched CUDA, is left."""
    from conftest import RELEASE_GPU_MEMORY_ABOVE, release_cached_gpu_memory

    large = _FakeCuda(46 << 30)
    assert release_cached_gpu_memory(large) and large.emptied == 1 and large.reserved == 0
    small = _FakeCuda(RELEASE_GPU_MEMORY_ABOVE)
    assert not release_cached_gpu_memory(small) and small.emptied == 0
    untouched = _FakeCuda(46 << 30, initialized=False)
    assert not release_cached_gpu_memory(untouched) and untouched.emptied == 0
