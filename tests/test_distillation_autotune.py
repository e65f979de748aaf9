"""Linear distillation's autotune cache entries (variant "distillation") and ``flce.explain_distillation``:
flce-autotune tunes the distillation workload on the CPU and writes an entry the planner then reads (an
explicit memory_budget still bounding it), and explain prints the record a call plans, for every backend
with distillation kernels, without the device."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from distillation_helpers import make_pair
from planning import reference_plan

import flce
import flce.autotune as autotune
from flce.autotune import cache as cache_files
from flce.autotune import locations, spaces
from flce.autotune.cli import main
from flce.autotune.lookup import override_params
from flce.autotune.schema import HEADER
from flce.autotune.tuner import Tuner, TuneRequest
from flce.backends.reference.distillation import plan_distillation
from flce.distillation.config import DistillationConfig
from flce.distillation.inputs import prepare_pair
from flce.engine.plans import PlanRequest

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


def _planned_chunk(generator: torch.Generator, **options: object) -> int:
    pair = make_pair(generator, n=128, student_size=16, teacher_size=16, vocab=64)
    flat = prepare_pair(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight,
                        pair.target, None, None, DistillationConfig(**options))
    return plan_distillation(flat, DistillationConfig(**options), PlanRequest(training=True)).plan.tokens_per_chunk


def test_tune_writes_a_distillation_entry_the_planner_reads(cache_env: Path, capsys: pytest.CaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            generator: torch.Generator) -> None:
    path = cache_env / "autotune.yaml"
    code = main(["tune", *TINY, "--tokens", "128", "--variant", "distillation", "--quick", "--cache", str(path),
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    (entry,) = cache_files.read_file(path).entries
    assert (entry.variant, entry.backend, entry.hidden, entry.vocab, entry.tokens) == (
        "distillation", "reference", 16, 64, 128)
    assert set(entry.params) == {"tokens_per_chunk"} and entry.logits_save_limit_bytes is None
    # Four GEMMs in the floor, and no logits-save limit or forward-only overlay measured.
    assert entry.measured["floor_ms"] > 0 and "keep_logits_ms" not in entry.measured
    with override_params({"tokens_per_chunk": 5}, backend="reference"):
        assert _planned_chunk(generator) == 5
        # 2 x 64 fp32 logits per row on the CPU: a 1 KiB budget holds 2 rows, and bounds the cached 5.
        assert _planned_chunk(generator, memory_budget=1024) == 2
    monkeypatch.setenv(locations.CACHE_ENV, str(path))
    autotune.reload()
    assert _planned_chunk(generator) == entry.params["tokens_per_chunk"]
    record = flce.explain_distillation("cpu", shape=(128, 16, 16, 64), dtype="float32")
    assert "distillation float32 H 16 V 64, tokens bucket 128" in record.cache

def test_unknown_variant_is_refused(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["tune", *TINY, "--tokens", "64", "--variant", "distill", "--quick", "--no-progress"])
    assert "distillation" in capsys.readouterr().err


def test_one_cache_file_answers_cross_entropy_and_distillation_apart(cache_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      generator: torch.Generator) -> None:
    """A file as flce-autotune writes it, holding a plain and a distillation entry of one (device, backend, dtype, H,
    V, tokens): each loss's planner reads its own entry's knobs, never the other's."""
    path = cache_env / "both.yaml"
    device = autotune.device_name(torch.device("cpu"))
    path.write_text(HEADER + "\nschema: 1\nentries:\n" + "".join(
        f"- {{device: '{device}', backend: reference, variant: {variant}, dtype: float32, hidden: 16, vocab: 64, "
        f"tokens: 128, params: {{tokens_per_chunk: {chunk}}}, logits_save_limit_bytes: null}}\n"
        for variant, chunk in (("plain", 7), ("distillation", 5))))
    monkeypatch.setenv(locations.CACHE_ENV, str(path))
    autotune.reload()
    shape = spaces.TuneShape(torch.device("cpu"), torch.float32, hidden=16, vocab=64, tokens=128, variant="plain")
    assert reference_plan(shape.stand_in_inputs()).tokens_per_chunk == 7
    assert _planned_chunk(generator) == 5
    assert autotune.lookup("cpu", torch.float32, hidden=16, vocab=64, tokens=128,
                           variant="distillation").params == {"tokens_per_chunk": 5}


def test_one_tune_of_both_losses_takes_each_its_own_space(cache_env: Path, capsys: pytest.CaptureFixture) -> None:
    """--variant plain,distillation in one run: the plain entry measures the logits-save limit (the reference
    planner keeps logits), the distillation entry does not (its planner keeps none), and each holds its own
    space's knobs."""
    path = cache_env / "autotune.yaml"
    code = main(["tune", *TINY, "--tokens", "128", "--variant", "plain,distillation", "--quick", "--cache", str(path),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    entries = {entry.variant: entry for entry in cache_files.read_file(path).entries}
    assert set(entries) == {"plain", "distillation"}
    assert "recompute_logits_ms" in entries["plain"].measured
    assert "recompute_logits_ms" not in entries["distillation"].measured
    assert entries["distillation"].logits_save_limit_bytes is None
    assert all(set(entry.params) == {"tokens_per_chunk"} for entry in entries.values())


@pytest.mark.parametrize("backend", ["reference", "cuda", "ascend"])
def test_every_backend_registers_a_space_per_loss(backend: str) -> None:
    """Each backend with distillation kernels tunes distillation in a space of its own, which measures no
    logits-save limit and no forward-only overlay; its cross-entropy space is another."""
    cross_entropy = spaces.tuning_space(backend)
    distillation = spaces.tuning_space(backend, spaces.DISTILLATION)
    assert cross_entropy is spaces.tuning_space(backend, spaces.CROSS_ENTROPY) is not None
    assert distillation is not None and distillation is not cross_entropy
    assert (cross_entropy.kind, distillation.kind) == (spaces.CROSS_ENTROPY, spaces.DISTILLATION)
    assert not distillation.tunes_logits_save_limit and distillation.inference_overlays == ()
    assert distillation.heuristic is not None and distillation.working_bytes is not None


def test_reference_distillation_space_is_the_distillation_planners() -> None:
    """The reference backend's distillation space reports the distillation planner's chunk and memory per row,
    not the cross-entropy's."""
    from flce.backends.reference import distillation
    from flce.engine.choice import describe_device
    from flce.engine.distillation.call import DistillDescription

    shape = spaces.TuneShape(torch.device("cpu"), torch.float32, hidden=64, vocab=1 << 20, tokens=4096,
                             variant="distillation")
    space = spaces.tuning_space("reference", spaces.DISTILLATION)
    with override_params(None):
        planned = distillation.choose_distillation(
            describe_device(shape.device), DistillDescription.tuned(4096, 64, 1 << 20, torch.float32))
        assert space.heuristic(shape) == {"tokens_per_chunk": planned.plan.tokens_per_chunk}
    assert 1 < planned.plan.tokens_per_chunk < shape.tokens, "a shape whose heuristic splits the tokens"
    per_row = distillation.working_bytes_per_row(shape.vocab, shape.dtype)
    assert space.working_bytes(shape, {"tokens_per_chunk": 256}) == 256 * per_row
    plain = spaces.TuneShape(shape.device, shape.dtype, shape.hidden, shape.vocab, shape.tokens, "plain")
    assert spaces.tuning_space("reference").working_bytes(plain, {"tokens_per_chunk": 256}) != 256 * per_row


def test_a_loss_the_backend_tunes_no_space_for_is_refused_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(spaces._spaces, ("reference", spaces.DISTILLATION))
    request = TuneRequest(device=torch.device("cpu"), dtypes=[torch.float32], hiddens=[16], vocabs=[64],
                          tokens=[128], variants=["plain", "distillation"], backend="reference", quick=True)
    with pytest.raises(ValueError, match=r"variant='distillation': backend 'reference' has no distillation tuning "
                                         r"space registered \(it tunes: \['cross_entropy'\]\)"):
        Tuner(request)


@pytest.mark.parametrize(("options", "message"), [
    ({"kind": "kl"}, "kind='kl': expected one of"),
    ({"kind": "distillation"}, r"tunes_logits_save_limit=True and inference_overlays=\(\): expected False and \(\)"),
    ({"kind": "distillation", "tunes_logits_save_limit": False, "inference_overlays": ({"forward_stats": "fused"},)},
     r"tunes_logits_save_limit=False and inference_overlays=\(\{'forward_stats': 'fused'\},\): expected False"),
])
def test_a_space_states_a_loss_it_can_tune(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spaces.TuningSpace("custom", candidates=lambda shape, quick: [], **options)


@pytest.mark.parametrize("device", ["cpu", "npu"])
@pytest.mark.parametrize("options", [{}, {"reduction": "none", "teacher_grad": True, "hard_label_weight": 0.5},
                                     {"loss": "forward_kl", "memory_budget": 1 << 20}])
def test_explain_equals_what_a_call_plans(device: str, options: dict, generator: torch.Generator) -> None:
    """The record explain prints from numbers is the one a real call of that shape plans (here on the CPU:
    the reference backend's; the Ascend backend's for a described NPU names its kernels and blocks)."""
    record = flce.explain_distillation(device, shape=(128, 16, 24, 64), dtype="float32", **options)
    text = str(record)
    assert "distillation, float32 128 tokens x V 64, student H 16, teacher H 24" in text
    if device == "cpu":
        pair = make_pair(generator, n=128, student_size=16, teacher_size=24, vocab=64)
        cfg = DistillationConfig(**options)
        flat = prepare_pair(pair.student_hidden, pair.student_weight, pair.teacher_hidden, pair.teacher_weight,
                            pair.target, None, None, cfg)
        assert plan_distillation(flat, cfg, PlanRequest(training=True)).choice == record
    else:
        assert record.backend == "ascend" and "BLOCK_V" in text
    if options.get("reduction") == "none":
        assert "in backward" in record.gradients and "teacher" in text
    for name in record.kernel_names():
        assert _resolves(name), f"{name} names no function"


def _resolves(name: str) -> bool:
    """Whether a dotted path names an object: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute, None)
        return found is not None
    return False


def test_command_line(capsys: pytest.CaptureFixture) -> None:
    from flce.__main__ import main as flce_main

    assert flce_main(["explain-distillation", "--device", "cpu", "--shape", "64x8x8x32", "--loss", "reverse_kl",
                      "--teacher_grad", "true", "--memory_budget", "1KiB", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "schedule: token chunks: 16 of up to 4 rows" in out and "loss=reverse_kl" in out
    with pytest.raises(SystemExit):
        flce_main(["explain-distillation", "--shape", "64x8x32"])
    assert "TOKENSxSTUDENT_HxTEACHER_HxVOCAB" in capsys.readouterr().err
