"""flce-autotune end to end on the CPU (tune --quick, show, clear), the tuner's skip accounting with
a fake backend, and the entry points."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

import flce
import flce.autotune as autotune
from flce.autotune import cache as cache_files
from flce.autotune import locations, progress, spaces
from flce.autotune.cli import main, parse_bytes
from flce.autotune.lookup import override_params
from flce.autotune.tuner import Tuner, TuneRequest, resolve_backend
from flce.backends.reference.plan import plan_call, working_bytes_per_row
from flce.config import LCEConfig
from flce.engine.function import apply_eager, needs_autograd
from flce.engine.plans import PlanRequest
from flce.inputs import FlatInputs
from flce.registry import Backend, register_backend

TINY = ["--device", "cpu", "--dtype", "float32", "--hidden", "16", "--vocab", "64"]


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """User cache under tmp_path, no FLCE_AUTOTUNE_CACHE, no shipped defaults; returns tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(locations.CACHE_ENV, raising=False)
    monkeypatch.setattr(locations, "DEFAULTS_DIR", tmp_path / "no-defaults")
    autotune.reload()
    yield tmp_path
    autotune.reload()


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_quick_show_clear(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    path = cache_env / "tuned" / "autotune.yaml"
    path.parent.mkdir()
    path.write_text("schema: 1\nentries: [{device: x, hidden: 3")  # a truncated file is moved aside

    code, out, err = run_cli(capsys, "tune", *TINY, "--tokens", "64,128", "--quick", "--cache", str(path),
                             "--no-progress")
    assert code == 0, err
    assert "moved it to" in err and ".corrupt-" in err
    assert [p.name.split(".corrupt-")[0] for p in path.parent.glob("*.corrupt-*")] == ["autotune.yaml"]
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["shape", "best", "params", "ms"]
    assert "speed-up" in lines[0] and "peak MiB" in lines[0] and "logits-save limit" in lines[0]
    for shape in ("float32 64x16x64 plain", "float32 64x16x64 full", "float32 128x16x64 plain",
                  "float32 128x16x64 full"):
        assert any(line.startswith(shape) for line in lines), shape
    assert f"wrote 4 entries to {path.absolute()}" in out

    entries = cache_files.read_file(path).entries
    assert sorted((e.tokens, e.variant) for e in entries) == [(64, "full"), (64, "plain"), (128, "full"),
                                                              (128, "plain")]
    for e in entries:
        assert e.device == autotune.device_name(torch.device("cpu")) and e.backend == "reference"
        assert set(e.params) <= {"tokens_per_chunk"}
        assert {"ms", "heuristic_ms", "floor_ms", "speedup", "peak_mib", "flce", "torch", "triton", "date"} <= set(
            e.measured)
        assert e.measured["flce"] == flce.__version__ and e.measured["ms"] <= e.measured["heuristic_ms"]
        # Decided (0: recompute, or a byte count) unless the two keep-versus-recompute rounds disagreed.
        assert e.logits_save_limit_bytes is not None or e.measured.get("skipped", 0) >= 1
        assert e.measured["keep_logits_ms"] > 0 and e.measured["recompute_logits_ms"] > 0
    assert autotune.lookup("cpu", torch.float32, hidden=16, vocab=64, tokens=100, cache=path) is not None

    code, out, _ = run_cli(capsys, "show", "--cache", str(path))
    assert code == 0 and f"{path} (cache= argument / --cache): 4 entries" in out
    assert "device" in out and "logits-save limit" in out and out.count(" reference ") == 4

    code, out, _ = run_cli(capsys, "show")
    assert code == 0 and f"{cache_env / 'xdg' / 'flce' / 'autotune.yaml'} (user cache): absent" in out

    code, out, _ = run_cli(capsys, "clear", "--cache", str(path))
    assert code == 0 and out.strip() == f"removed {path.absolute()} (4 entries)"
    assert not path.exists() and any(path.parent.glob("*.corrupt-*"))  # only flce's file went
    code, out, _ = run_cli(capsys, "clear", "--cache", str(path))
    assert code == 0 and "nothing to clear" in out


@pytest.mark.parametrize("where", ["a shell rc file", "unwritable"])
def test_tune_fails_before_measuring_when_its_cache_path_cannot_take_the_entries(
        cache_env: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """--cache names the file to write: a file that is not an flce cache is left as it is, an
    unwritable path is not swapped for the user cache, and either fails before any measurement."""
    def refuse_to_measure(self: Tuner) -> None:
        raise AssertionError("the tuner measured before the cache path was checked")

    monkeypatch.setattr(Tuner, "run", refuse_to_measure)
    if where == "a shell rc file":
        path = cache_env / ".bashrc"
        path.write_text("export PATH=$HOME/bin:$PATH\nalias ll='ls -l'\n")
        expected = "is not an flce autotune cache"
    else:
        (cache_env / "a-file").write_text("")
        path = cache_env / "a-file" / "autotune.yaml"
        expected = "no writable autotune cache location"
    original = path.read_bytes() if path.exists() else None
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--quick", "--cache", str(path), "--no-progress")
    assert code == 1 and expected in err and str(path) in err
    assert (path.read_bytes() if path.exists() else None) == original
    assert not list(cache_env.glob("*.corrupt-*")) and not locations.user_cache_path().exists()


def test_tune_into_a_missing_folder_fails_before_measuring_and_creates_nothing(
        cache_env: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cache /no/such/dir/x.yaml: a mistyped folder is not created (docs/autotune.md: tune writes there or
    fails before measuring); the environment's and the user cache's folders are flce's to create."""
    monkeypatch.setattr(Tuner, "run", lambda self: pytest.fail("the tuner measured before the path was checked"))
    path = cache_env / "no" / "such" / "dir" / "x.yaml"
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--quick", "--cache", str(path), "--no-progress")
    assert code == 1 and f"no folder {path.parent}" in err, err
    assert not (cache_env / "no").exists() and not locations.user_cache_path().exists()


def test_tune_through_a_symbolic_link_writes_the_linked_file(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    """--cache LINK to a shared cache: the shared file gets the entry and the link stays a link."""
    shared = cache_env / "shared" / "cache.yaml"
    shared.parent.mkdir()
    link = cache_env / "mine.yaml"
    link.symlink_to(shared)
    code, out, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--variant", "plain", "--quick",
                             "--no-progress", "--cache", str(link))
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == shared.resolve()
    loaded = cache_files.read_file(shared)
    assert loaded.usable and len(loaded.entries) == 1 and loaded.entries[0].hidden == 16
    assert f"wrote 1 entry to {shared.resolve()}" in out
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "128", "--variant", "plain", "--quick",
                           "--no-progress", "--cache", str(link))
    assert code == 0 and link.is_symlink() and len(cache_files.read_file(shared).entries) == 2, err


def test_tune_of_a_shape_whose_inputs_cannot_be_allocated_prints_the_summary(cache_env: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """H = 2**40: no input tensor of that size exists here. The shape is skipped with the allocator's reason,
    the summary printed, the exit status 1, no traceback."""
    code, out, err = run_cli(capsys, "tune", "--device", "cpu", "--dtype", "float32", "--hidden", str(2**40),
                             "--vocab", "8", "--tokens", "4", "--variant", "plain", "--quick", "--no-progress",
                             "--cache", str(cache_env / "c.yaml"))
    assert code == 1 and "Traceback" not in err
    assert f"float32 4x{2**40}x8 plain" in out and "inputs not allocated" in out, out
    assert "can't allocate memory" in out or "overflow" in out, out


@pytest.mark.parametrize("where", ["--cache", "env", "user"])
def test_tune_refuses_a_directory_at_the_cache_path_and_moves_nothing(
        cache_env: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A directory where the cache file should be is someone's: tune fails before measuring (rc 1), the
    directory and what it holds stay, and no file or lock is written beside it."""
    def refuse_to_measure(self: Tuner) -> None:
        raise AssertionError("the tuner measured before the cache path was checked")

    monkeypatch.setattr(Tuner, "run", refuse_to_measure)
    directory = {"--cache": cache_env / "mine", "env": cache_env / "env-dir",
                 "user": locations.user_cache_path()}[where]
    directory.mkdir(parents=True)
    (directory / "keep.txt").write_text("precious")
    argv = ["tune", *TINY, "--tokens", "64", "--quick", "--no-progress"]
    if where == "--cache":
        argv += ["--cache", str(directory)]
    elif where == "env":
        monkeypatch.setenv(locations.CACHE_ENV, str(directory))
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and str(directory) in err and "is a directory, not a regular file" in err, err
    assert (directory / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name], "nothing moved or written"


def _cache_with(path: Path, entries: list[dict]) -> None:
    path.write_text(yaml.safe_dump({"schema": 1, "entries": entries}))


def _raw_entry(device: str, tokens: int, params: dict) -> dict:
    return {"device": device, "backend": "reference", "variant": "plain", "dtype": "float32", "hidden": 16,
            "vocab": 64, "tokens": tokens, "params": params, "logits_save_limit_bytes": None, "measured": {}}


def test_show_lists_this_machines_entries_and_marks_invalid_ones(cache_env: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    here = autotune.device_name(torch.device("cpu"))
    path = cache_env / "c.yaml"
    _cache_with(path, [_raw_entry(here, 64, {"tokens_per_chunk": 8}),
                       _raw_entry("NVIDIA Nonesuch 900", 128, {"tokens_per_chunk": 16}),
                       _raw_entry(here, 256, {"tokens_per_chunk": 0})])
    code, out, _ = run_cli(capsys, "show", "--cache", str(path))
    assert code == 0
    assert "2 entries (1 for devices not on this machine: --all shows them)" in out
    assert "ignored invalid entry 2: params tokens_per_chunk=0: expected a positive int" in out
    assert "tokens_per_chunk=8" in out and "Nonesuch" not in out and "tokens_per_chunk=0" not in out.split("\n", 2)[2]
    code, out, _ = run_cli(capsys, "show", "--all", "--cache", str(path))
    assert code == 0 and "2 entries\n" in out and "Nonesuch" in out and "tokens_per_chunk=16" in out


def test_show_into_a_closed_pipe_stops_quietly(cache_env: Path) -> None:
    """`flce-autotune show | head`: no BrokenPipeError traceback when the reader stops early."""
    path = cache_env / "big.yaml"
    _cache_with(path, [_raw_entry(f"device {i}", 64, {"tokens_per_chunk": 8}) for i in range(2000)])
    env = {**os.environ, "PYTHONPATH": str(Path(flce.__file__).parents[1])}
    shown = subprocess.Popen([sys.executable, "-m", "flce.autotune", "show", "--all", "--cache", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    shown.stdout.readline()
    shown.stdout.close()  # as head does after its lines
    err = shown.stderr.read().decode()
    assert shown.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_clear_defaults_to_the_user_cache_and_spares_other_files(cache_env: Path, capsys: pytest.CaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    user = locations.user_cache_path()
    cache_files.update_file(user, [])
    code, out, _ = run_cli(capsys, "clear")
    assert code == 0 and f"removed {user}" in out and not user.exists()
    foreign = cache_env / "settings.yaml"
    foreign.write_text("theme: dark\n")
    monkeypatch.setenv(locations.CACHE_ENV, str(foreign))
    code, _, err = run_cli(capsys, "clear")
    assert code == 1 and "not an flce autotune cache; left untouched" in err and foreign.exists()


def reference_bytes_per_row(vocab: int, hidden: int = 16) -> int:
    """The reference planner's working memory per token row for a float32 CPU call."""
    return working_bytes_per_row("cpu", vocab, torch.float32, LCEConfig())


def test_memory_budget_skips_and_counts_candidates(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    path = cache_env / "c.yaml"
    per_row = reference_bytes_per_row(64)
    code, out, err = run_cli(capsys, "tune", *TINY, "--tokens", "256", "--variant", "plain", "--quick",
                             "--memory-budget", str(64 * per_row), "--cache", str(path), "--no-progress")
    assert code == 0, err
    assert "float32 256x16x64 plain: skipped 1 keep logits over budget, 2 over budget" in out
    (e,) = cache_files.read_file(path).entries
    assert e.logits_save_limit_bytes == 0 and e.measured["memory_budget_bytes"] == 64 * per_row
    # The heuristic (one 256-row chunk, as dispatch runs it without a budget) does not fit: the
    # only candidate that does is chosen, whatever its speed.
    assert e.params == {"tokens_per_chunk": 64} and e.measured["budget_from"] == "argument"


def test_nothing_within_budget_writes_no_entry_and_says_why(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    path = cache_env / "c.yaml"
    code, out, _ = run_cli(capsys, "tune", *TINY, "--tokens", "128", "--variant", "plain", "--quick",
                           "--memory-budget", "1000", "--cache", str(path), "--no-progress")
    assert code == 1 and not path.exists()
    heuristic_kib = 128 * reference_bytes_per_row(64) / 1024  # one 128-row chunk
    why = f"neither the heuristic ({heuristic_kib:.1f} KiB) nor any candidate fits the memory budget of 1000 B"
    assert f"skipped 2 over budget (first: {why})" in out


def test_unwritable_env_cache_path_falls_back_to_the_user_cache(cache_env: Path, capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """FLCE_AUTOTUNE_CACHE is a preference, not an order (an explicit --cache is: see above)."""
    blocker = cache_env / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(locations.CACHE_ENV, str(blocker / "autotune.yaml"))
    code, out, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--variant", "plain", "--quick",
                             "--no-progress")
    assert code == 0
    assert f"cannot write {blocker / 'autotune.yaml'}" in err and "(user cache) instead" in err
    assert f"wrote 1 entry to {locations.user_cache_path()}" in out
    assert len(cache_files.read_file(locations.user_cache_path()).entries) == 1


@pytest.mark.parametrize("use_tqdm", [True, False])
def test_progress_in_a_pipe_is_plain_lines(cache_env: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch, use_tqdm: bool) -> None:
    """stderr not a terminal (a pipe, a log file): one line per measurement and no carriage return,
    whether tqdm is installed or not."""
    monkeypatch.setattr(progress, "_tqdm_available", lambda: use_tqdm)
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--variant", "plain", "--quick",
                           "--cache", str(cache_env / "c.yaml"))
    assert code == 0
    assert "\r" not in err
    assert "[1/5] float32 H=16 V=64 T=64 plain: floor" in err and "[5/5]" in err  # floor, heuristic, one
    # candidate, recompute, keep


def test_progress_on_a_terminal_is_a_bar(cache_env: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(progress, "_tqdm_available", lambda: True)
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--variant", "plain", "--quick",
                           "--cache", str(cache_env / "c.yaml"))
    assert code == 0 and "5/5" in err and "run" in err and "\r" in err and "[1/5]" not in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--tokens", "64"], "1 shape, plain and full variants"),
    (["--tokens", "64,128", "--variant", "full"], "2 shapes, full variant"),
])
def test_tune_says_how_many_shapes_and_which_variants(cache_env: Path, capsys: pytest.CaptureFixture,
                                                      argv: list[str], said: str) -> None:
    code, _, err = run_cli(capsys, "tune", *TINY, *argv, "--quick", "--no-progress",
                           "--cache", str(cache_env / "c.yaml"))
    assert code == 0 and said in err, err


def test_tune_leaves_no_lock_file(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    path = cache_env / "tuned" / "c.yaml"
    path.parent.mkdir()
    code, _, err = run_cli(capsys, "tune", *TINY, "--tokens", "64", "--variant", "plain", "--quick",
                           "--no-progress", "--cache", str(path))
    assert code == 0, err
    assert sorted(p.name for p in path.parent.iterdir()) == ["c.yaml"]


def test_the_floor_is_measured_once_per_shape_and_shared_by_the_variants(
        cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flce.autotune import workload

    measured: list[tuple] = []

    def counted_floor(shape, inputs, warmup, repeats):
        measured.append((shape.dtype, shape.hidden, shape.vocab, shape.tokens))
        return 1e-9  # never above a real time: no re-measurement for implausibility

    monkeypatch.setattr(workload, "floor_ms", counted_floor)
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[16], vocabs=[64],
                          tokens=[64, 128], variants=["plain", "full"], quick=True)
    results = Tuner(request).run()
    assert sorted(Counter(measured).values()) == [1, 1], measured
    for tokens in (64, 128):
        floors = {r.shape.variant: r.entry.measured["floor_ms"] for r in results if r.shape.tokens == tokens}
        assert set(floors) == {"plain", "full"} and floors["plain"] == floors["full"]


def test_the_floor_is_repeated_until_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first GEMM of a process pays for thread pools and kernel selection: the floor is measured
    again until two attempts agree, and the smallest kept (143 ms then 84 ms was once stored as 143)."""
    from flce.autotune import workload
    from flce.autotune.spaces import TuneShape

    times = iter([143.1, 90.0, 84.0, 83.9, 83.8, 83.7, 83.6, 83.5])
    calls = []

    def scripted(fn, device, warmup, repeats, reset=None):
        calls.append(1)
        return next(times), None, 0.01  # each attempt's repeats agree: steady within itself

    monkeypatch.setattr(workload, "time_call", scripted)
    shape = TuneShape(torch.device("cpu"), torch.float32, 16, 64, 32, "plain")
    inputs = workload.make_inputs(shape, seed=0)
    assert workload.floor_ms(shape, inputs, warmup=1, repeats=3) == 83.9
    assert len(calls) == 4


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "12,abc"], "--tokens='12,abc': 'abc' is not a positive integer"),
    (["--tokens", "0"], "--tokens='0': '0' is not a positive integer"),
    (["--tokens", "8", "--memory-budget", "12XB"], "--memory-budget='12XB': expected a size"),
    (["--tokens", "8", "--dtype", "int7"], "dtype='int7'"),
    (["--tokens", "8", "--variant", "fast"], "--variant='fast': 'fast' is not one of"),
    (["--tokens", "8", "--backend", "nope"], "backend='nope': unknown backend"),
    (["--tokens", "8", "--repeats", "0"], "--repeats=0: expected an int >= 1"),
])
def test_bad_arguments_exit_2_and_name_the_value(capsys: pytest.CaptureFixture, argv: list[str],
                                                 message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", *TINY, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unavailable_device_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        main(["tune", "--device", "cuda", "--hidden", "8", "--vocab", "8", "--tokens", "8"])
    assert "--device='cuda': no cuda device is available" in capsys.readouterr().err


def test_parse_bytes_units() -> None:
    assert parse_bytes("x", "512MiB") == 512 << 20
    assert parse_bytes("x", "1.5GB") == 1_500_000_000
    assert parse_bytes("x", "2gib") == 2 << 30
    assert parse_bytes("x", "4096") == 4096


# The tuner with a backend that misbehaves on purpose -----------------------------------------------


def _flaky_run(flat: FlatInputs, cfg: flce.config.LCEConfig, variant: str) -> torch.Tensor:
    """The reference computation, except for the knob "mode" read from the autotune cache."""
    w = flat.weight
    params, _ = autotune.tuned_params(w.device, "flaky", variant, w.dtype, w.shape[1], w.shape[0],
                                      flat.target.shape[0])
    mode = (params or {}).get("mode")
    if mode == "fail":
        raise RuntimeError("kernel does not compile")
    if mode == "oom":
        raise torch.OutOfMemoryError("out of memory (simulated)")
    if mode == "slow":
        time.sleep(0.05)
    loss = apply_eager(flat, plan_call(flat, cfg, variant, PlanRequest(training=needs_autograd(flat))))
    return loss * 1.5 if mode == "wrong" else loss


def test_tuner_skips_failures_oom_wrong_results_and_over_budget(
    cache_env: Path, isolated_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_backend(Backend(name="flaky", device_types=("cpu",), priority=-10,
                             is_available=lambda probe: (True, "test backend"),
                             supports=lambda cfg, dtype, h, v: (True, "everything"), run=_flaky_run))
    with pytest.raises(ValueError, match="backend='flaky' has no tuning space registered"):
        resolve_backend(torch.device("cpu"), "flaky")
    modes = ["fail", "oom", "wrong", "huge", "slow", "same"]
    space = spaces.TuningSpace(
        "flaky", candidates=lambda shape, quick: [{"mode": m} for m in modes],
        working_bytes=lambda shape, params: 1 << 50 if params.get("mode") == "huge" else 1024,
        tunes_logits_save_limit=False)
    monkeypatch.setitem(spaces._spaces, ("flaky", spaces.CROSS_ENTROPY), space)

    seen = []
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[8], vocabs=[32],
                          tokens=[16], variants=["plain"], backend="flaky", memory_budget=1 << 30, quick=True)
    (result,) = Tuner(request, on_result=seen.append).run()
    assert seen == [result]
    assert result.tried == len(modes)
    skipped = dict(result.skipped)
    skipped.pop("win not confirmed", None)  # "same" may win one noisy round, never the confirmation too
    assert skipped == {"failed": 1, "out of memory": 1, "wrong result": 1, "over budget": 1}
    assert result.first_error == "mode=fail: RuntimeError: kernel does not compile"
    assert result.entry is not None and result.entry.params in ({}, {"mode": "same"})
    assert result.entry.logits_save_limit_bytes is None and result.entry.backend == "flaky"
    assert result.heuristic_params is None  # the space has no heuristic: the planner's choice is unknown


def test_winning_heuristic_is_stored_as_the_knobs_it_chose(
    cache_env: Path, isolated_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no candidate beats the heuristic, the entry holds the heuristic's own knob values (what
    its space's heuristic reports), not empty params that would mean whatever a later flce picks."""
    register_backend(Backend(name="flaky", device_types=("cpu",), priority=-10,
                             is_available=lambda probe: (True, "test backend"),
                             supports=lambda cfg, dtype, h, v: (True, "everything"), run=_flaky_run))
    # Candidates that cannot win whatever the timings: the heuristic is kept.
    space = spaces.TuningSpace("flaky", candidates=lambda shape, quick: [{"mode": "fail"}, {"mode": "wrong"}],
                               tunes_logits_save_limit=False, heuristic=lambda shape: {"mode": f"h{shape.tokens}"})
    monkeypatch.setitem(spaces._spaces, ("flaky", spaces.CROSS_ENTROPY), space)
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[8], vocabs=[32],
                          tokens=[16], variants=["plain"], backend="flaky", quick=True)
    (result,) = Tuner(request).run()
    assert result.entry is not None and result.entry.measured["chosen"] == "heuristic"
    assert result.heuristic_params == result.entry.params == {"mode": "h16"}


def _scripted_timings(monkeypatch: pytest.MonkeyPatch, script: Callable[[dict, int | None, int], float | None]
                      ) -> None:
    """Replace each timed measurement's median by ``script(params, logits limit, how many times this
    configuration was timed before)`` where it returns a number: what a concurrent process or a
    clock jump makes a tuner see, without waiting for one. Made-up times are in seconds' range, far
    above the (real) floor of these tiny shapes, unless a test means them to be below it."""
    from flce.autotune import tuner

    lookup = importlib.import_module("flce.autotune.lookup")  # the module: flce.autotune.lookup is also a function

    real_time, counts = tuner.time_call, Counter()

    def scripted(fn, device, warmup, repeats, reset=None):
        ms, peak, spread = real_time(fn, device, warmup, repeats, reset)
        workload = getattr(fn, "__self__", fn)  # a Workload, or its forward-only method
        if not isinstance(workload, tuner.Workload) or not lookup._overrides:  # the floor's GEMMs are left alone
            return ms, peak, spread
        override = lookup._overrides[-1]
        key = (override.params, override.logits_save_limit_bytes)
        made_up = script(dict(override.params or ()), override.logits_save_limit_bytes, counts[key])
        counts[key] += 1
        return (ms, peak, spread) if made_up is None else (made_up, peak, 0.0)  # made-up repeats agree

    monkeypatch.setattr(tuner, "time_call", scripted)


def _flaky_space(monkeypatch: pytest.MonkeyPatch, candidates: list[dict], logits: bool = False) -> None:
    register_backend(Backend(name="flaky", device_types=("cpu",), priority=-10,
                             is_available=lambda probe: (True, "test backend"),
                             supports=lambda cfg, dtype, h, v: (True, "everything"), run=_flaky_run))
    monkeypatch.setitem(spaces._spaces, ("flaky", spaces.CROSS_ENTROPY), spaces.TuningSpace(
        "flaky", candidates=lambda shape, quick: candidates, tunes_logits_save_limit=logits))


FLAKY_REQUEST = dict(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[8], vocabs=[32], tokens=[16],
                     variants=["plain"], backend="flaky", quick=True)


def test_tuner_discards_a_time_below_the_floor(cache_env: Path, isolated_registry: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate timed at a hundredth of its own GEMMs (as concurrent tunes once recorded, 0.02x
    the floor) is measured again and, staying impossible, skipped; the heuristic's time stands."""
    _flaky_space(monkeypatch, [{"mode": "teleport"}])
    _scripted_timings(monkeypatch, lambda params, limit, seen: 1e-6 if params.get("mode") == "teleport" else None)
    (result,) = Tuner(TuneRequest(**FLAKY_REQUEST)).run()
    assert dict(result.skipped) == {"implausible timing": 1}, result.first_error
    assert "the floor" in result.first_error and "3 times" in result.first_error
    assert result.entry is not None and result.entry.measured["chosen"] == "heuristic"
    assert result.entry.measured["ms"] >= 0.5 * result.entry.measured["floor_ms"]


def test_a_win_that_does_not_repeat_is_not_kept(cache_env: Path, isolated_registry: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate 80x faster than the heuristic once, and as fast as it when timed again, is a noisy
    heuristic run, not a better candidate (the 83.89x "vs heuristic" of concurrent tunes)."""
    _flaky_space(monkeypatch, [{"mode": "same"}])

    def script(params: dict, limit: int | None, seen: int) -> float | None:
        if not params:  # the heuristic: slow the first time only
            return 80e3 if seen == 0 else 1e3
        return 1e3

    _scripted_timings(monkeypatch, script)
    (result,) = Tuner(TuneRequest(**FLAKY_REQUEST)).run()
    assert result.skipped["win not confirmed"] == 1
    assert result.entry is not None and result.entry.measured["chosen"] == "heuristic" and result.entry.params == {}


@pytest.mark.parametrize(("keep_rounds", "limit"), [((500, 500), "kept"), ((2000, 2000), 0), ((500, 2000), None),
                                                    ((2000, 500), None)])
def test_logits_save_limit_needs_two_rounds_that_agree(cache_env: Path, isolated_registry: None,
                                                       monkeypatch: pytest.MonkeyPatch, keep_rounds: tuple,
                                                       limit: object) -> None:
    """Keeping logits is timed against recomputing them twice: only two agreeing rounds set the limit
    (to keep, or 0 to recompute); rounds that disagree leave it to the planner (None)."""
    _flaky_space(monkeypatch, [], logits=True)

    def script(params: dict, save_limit: int | None, seen: int) -> float | None:
        if save_limit is None:
            return 1e3
        return keep_rounds[seen] if save_limit > 0 else 1e3

    _scripted_timings(monkeypatch, script)
    (result,) = Tuner(TuneRequest(**FLAKY_REQUEST)).run()
    got = result.entry.logits_save_limit_bytes
    assert (got is not None and got > 0) if limit == "kept" else got == limit
    assert ("logits-save limit inconclusive" in result.skipped) == (limit is None)


@pytest.mark.parametrize("variant", ["plain", "full"])
def test_reference_space_reports_the_planners_chunk(variant: str) -> None:
    """The reference space's heuristic is what the planner does with nothing cached."""
    from planning import reference_plan

    from flce.config import LCEConfig

    shape = spaces.TuneShape(torch.device("cpu"), torch.float32, hidden=64, vocab=1 << 20, tokens=4096,
                             variant=variant)
    with override_params(None):
        reported = spaces.tuning_space("reference").heuristic(shape)
        options = {} if variant == "plain" else {"label_smoothing": 0.1}
        planned = reference_plan(shape.stand_in_inputs(), LCEConfig(**options)).tokens_per_chunk
    assert reported == {"tokens_per_chunk": planned}
    assert 1 < planned < shape.tokens, "a shape whose heuristic splits the tokens, so the value says something"


def test_tuner_times_forward_only_overlays_and_stores_the_fastest(
    cache_env: Path, isolated_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Knobs only forward-only calls use (the CUDA backend's forward_stats path) are timed on such a
    call; a failing overlay is skipped and counted, a faster one replaces the baseline."""
    register_backend(Backend(name="flaky", device_types=("cpu",), priority=-10,
                             is_available=lambda probe: (True, "test backend"),
                             supports=lambda cfg, dtype, h, v: (True, "everything"), run=_flaky_run))
    space = spaces.TuningSpace("flaky", candidates=lambda shape, quick: [], tunes_logits_save_limit=False,
                               inference_overlays=({"mode": "slow"}, {"mode": "fail"}, {"mode": "same"}))
    monkeypatch.setitem(spaces._spaces, ("flaky", spaces.CROSS_ENTROPY), space)
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[8], vocabs=[32],
                          tokens=[16], variants=["plain"], backend="flaky", quick=True)
    (result,) = Tuner(request).run()
    assert result.entry is not None and result.entry.params == {"mode": "same"}
    assert dict(result.skipped) == {"forward only failed": 1}
    measured = result.entry.measured
    assert measured["inference_ms_mode=slow"] > 50 > measured["inference_ms_mode=same"]
    assert "inference_ms_mode=fail" not in measured


@pytest.mark.parametrize(("rounds", "chosen"), [((500, 500), {"mode": "fast"}), ((500, 1000), {}),
                                                 ((500, None), {})])
def test_a_forward_only_overlay_must_win_twice(cache_env: Path, isolated_registry: None,
                                               monkeypatch: pytest.MonkeyPatch, rounds: tuple, chosen: dict) -> None:
    """An overlay that beats the first one in its round is timed again beside it; it is stored only if
    it wins that round too (a quick tune once stored a forward-only path 5% slower on the same GPU).
    A confirmation round whose forward fails keeps the first overlay."""
    register_backend(Backend(name="flaky", device_types=("cpu",), priority=-10,
                             is_available=lambda probe: (True, "test backend"),
                             supports=lambda cfg, dtype, h, v: (True, "everything"), run=_flaky_run))
    space = spaces.TuningSpace("flaky", candidates=lambda shape, quick: [], tunes_logits_save_limit=False,
                               inference_overlays=({}, {"mode": "fast"}))
    monkeypatch.setitem(spaces._spaces, ("flaky", spaces.CROSS_ENTROPY), space)

    def script(params: dict, limit: int | None, seen: int) -> float | None:
        if params.get("mode") != "fast":
            return 1000.0  # the first overlay (and the training call)
        if rounds[seen] is None:
            raise RuntimeError("kernel does not compile")
        return rounds[seen]

    _scripted_timings(monkeypatch, script)
    (result,) = Tuner(TuneRequest(**FLAKY_REQUEST)).run()
    assert result.entry is not None and result.entry.params == chosen, result.skipped
    measured = result.entry.measured
    assert measured["inference_ms_mode=fast"] == 500
    confirmed = rounds[1] is not None
    assert ("inference_ms_confirm mode=fast" in measured) == confirmed
    expected = ({} if chosen else {"forward-only win not confirmed": 1}) if confirmed else {
        "forward only failed": 1, "forward-only confirmation failed": 1}
    assert dict(result.skipped) == expected


# Entry points and concurrent tuners --------------------------------------------------------------


def test_entry_points_and_concurrent_tunes_keep_every_entry(tmp_path: Path) -> None:
    """Two tune processes write one file at once, one through `python -m flce.autotune`, one
    through the `flce-autotune` console script; both entries survive."""
    path = tmp_path / "shared.yaml"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "OMP_NUM_THREADS": "1"}
    env.pop(locations.CACHE_ENV, None)
    script = console_script("flce-autotune")
    module = [sys.executable, "-m", "flce.autotune"]
    launchers = [module, [script] if script else module]
    tunes = [subprocess.Popen([*launcher, "tune", *TINY, "--tokens", tokens, "--variant", "plain", "--quick",
                               "--cache", str(path), "--no-progress"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for launcher, tokens in zip(launchers, ("64", "128"), strict=True)]
    outputs = [p.communicate(timeout=300) for p in tunes]
    assert [p.returncode for p in tunes] == [0, 0], outputs
    assert sorted(e.tokens for e in cache_files.read_file(path).entries) == [64, 128]
    if script is None:
        pytest.skip(f"the flce-autotune console script is not installed beside {sys.executable} (pip install "
                    "-e .); the concurrent tunes above ran through python -m flce.autotune")


def console_script(name: str) -> str | None:
    """The console script ``name`` of this interpreter's environment (its scripts directory), not
    whichever one PATH finds first: a venv's tests must run the venv's own entry point."""
    for path in (Path(sysconfig.get_path("scripts")) / name, Path(sys.executable).parent / name):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None
