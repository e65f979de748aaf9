"""The CUDA backend's linear distillation kernels (flce/backends/cuda/distill_kernels.py) against the float64
oracle: in the Triton interpreter on CPU tensors without a GPU (``backend="cuda"``; tests/conftest.py sets
TRITON_INTERPRET=1), on the GPU where there is one. Blocks of 16 columns make a row of 40 span three blocks, the
last partial. Every loss x reduction x hard-label weight (ignored rows, biases, a temperature, the teacher's
gradient, chunks of three rows), temperatures, no target, forward's passes in one kernel and one kernel each,
rows in flight, vocabulary shards (the kernels' statistics merged across shards as the engine's vocab-parallel
combine merges them), bf16 and fp16 within 1.5x of eager's error; the record a call plans equals explain's and
names the kernels that ran; the tuning space's heuristic is the planner's choice.
"""

from __future__ import annotations

import pytest
import torch
from distillation_helpers import assert_matches_oracle, eager_loss, flce_loss, make_pair, oracle, relative
from helpers import count_launches

import flce
from flce.autotune import override_params
from flce.backends.cuda.configs import LaunchParams
from flce.backends.cuda.distill_ops import pair_grad_, pair_grad_expectation_, pair_passes_
from flce.backends.cuda.plan import PAIR_REGISTERS, PAIR_REGISTERS_RANGE
from flce.distillation.config import DistillationConfig
from flce.distillation.semantics import (
    PairStats,
    PartialPairStats,
    merge_pair_stats,
    pair_coefficients,
    with_mixture_sums,
)
from flce.distillation.tiles import tile_gradients, tile_mixture_sums, tile_statistics

pytestmark = pytest.mark.triton

LOSSES = ("forward_kl", "reverse_kl", "jsd")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCKS = {"block_v": 16, "num_warps": 4}
# 13 rows of 2 x 40 fp32 logits: chunks of 3 rows.
MANY_CHUNKS = 1000
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def _check(pair, generator: torch.Generator, knobs: dict | None = None, **options: object) -> None:
    with override_params(dict(SMALL_BLOCKS, **(knobs or {})), backend="cuda"):
        assert_matches_oracle(pair.detached(DEVICE), generator, backend="cuda", **options)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("hard_label_weight", [0.0, 0.3, 1.0])
def test_every_loss_reduction_and_hard_weight(loss: str, reduction: str, hard_label_weight: float,
                                              generator: torch.Generator) -> None:
    pair = make_pair(generator, bias=True)
    _check(pair, generator, loss=loss, reduction=reduction, hard_label_weight=hard_label_weight, temperature=0.7,
           teacher_grad=True, memory_budget=MANY_CHUNKS)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperatures(loss: str, temperature: float, generator: torch.Generator) -> None:
    pair = make_pair(generator, scale=3.0)
    _check(pair, generator, loss=loss, temperature=temperature, hard_label_weight=0.2, beta=0.3)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("knobs", [{"pair_passes": "separate"}, {"rows_in_flight": 3}], ids=["separate", "in-flight"])
def test_passes_one_kernel_each_and_rows_in_flight(loss: str, knobs: dict, generator: torch.Generator) -> None:
    pair = make_pair(generator, n=17, bias=True, scale=2.0)
    _check(pair, generator, knobs, loss=loss, hard_label_weight=0.3, temperature=1.3, teacher_grad=True)


# Both heads' statistics from the logits GEMMs' epilogue (the Triton statistics GEMM here; the warp-specialised one
# on Hopper by default): the losses whose statistics each head makes alone, and forward KL, whose cross sum the
# fused passes make in the student's gradient sweep.
STATS_IN_GEMM = {"forward_logits": "fused", "logits_kernel": "triton"}


@pytest.mark.parametrize(("options", "knobs"), [
    ({"hard_label_weight": 0.0, "temperature": 0.7}, {}),
    ({"hard_label_weight": 0.4, "temperature": 1.0, "reduction": "sum"}, {}),
    ({"hard_label_weight": 1.0, "temperature": 1.0}, {"rows_in_flight": 3}),
    ({"hard_label_weight": 0.4, "reduction": "none", "teacher_grad": True}, {}),
    ({"hard_label_weight": 0.4, "temperature": 1.0}, {"pair_passes": "separate"}),
    ({"target": False, "temperature": 1.6}, {}),
    ({"loss": "forward_kl", "hard_label_weight": 0.0, "temperature": 0.7}, {}),
    ({"loss": "forward_kl", "hard_label_weight": 0.4, "temperature": 1.0, "reduction": "sum"}, {"rows_in_flight": 3}),
    ({"loss": "forward_kl", "target": False, "temperature": 1.6}, {}),
    ({"loss": "forward_kl", "hard_label_weight": 0.4, "temperature": 1.0}, {"pair_passes": "separate"}),
    ({"loss": "reverse_kl", "hard_label_weight": 0.0, "temperature": 0.7}, {}),
    ({"loss": "reverse_kl", "hard_label_weight": 0.4, "temperature": 1.0, "reduction": "sum"}, {"rows_in_flight": 3}),
    ({"loss": "reverse_kl", "hard_label_weight": 0.4, "reduction": "none", "teacher_grad": True}, {}),
    ({"loss": "reverse_kl", "target": False, "temperature": 1.6, "teacher_grad": True}, {"pair_passes": "separate"}),
], ids=["soft-cold", "hard-sum", "hard-only-in-flight", "none-teacher", "separate", "no-target", "fkl-cold",
        "fkl-hard-sum-in-flight", "fkl-no-target", "fkl-separate", "rkl-cold", "rkl-hard-sum-in-flight",
        "rkl-none-teacher", "rkl-no-target-teacher-separate"])
def test_statistics_from_the_logits_gemms(options: dict, knobs: dict, generator: torch.Generator) -> None:
    """The plan takes both heads' statistics from the logits GEMMs (no pair statistics pass), and the loss and every
    gradient still match the float64 oracle: fused passes reading the known statistics (forward KL's cross sum
    made in its gradient's sweep, in the fused kernel's or pair_grad's; reverse KL's in the student's GEMM, whose
    epilogue reads the teacher's logits), one kernel a pass, a deferred backward."""
    options = {"loss": "jsd", **options}
    pair = make_pair(generator, n=17, bias=True, scale=2.0, target=options.pop("target", True))
    knobs = {**STATS_IN_GEMM, **knobs}
    with override_params(dict(SMALL_BLOCKS, **knobs), backend="cuda"):
        record = flce.explain_distillation(DEVICE, backend="cuda", shape=(17, 8, 12, 40), dtype="float32",
                                           student_bias=True, teacher_bias=True, **options)
    assert record.plan.stats_in_gemm
    assert "flce.backends.cuda.distill_kernels._pair_stats_kernel" not in record.kernel_names()
    if options["loss"] == "forward_kl":
        assert "E_p[t - s]" in str(record)
    if options["loss"] == "reverse_kl":
        assert "E_q[s - t], its epilogue reading the teacher's logits" in str(record) and "E_p" not in str(record)
    _check(pair, generator, knobs, memory_budget=MANY_CHUNKS, **options)


@pytest.mark.parametrize(("options", "knobs"), [
    ({"loss": "reverse_kl", "return_entropy": True}, {}),
    ({"loss": "forward_kl", "teacher_grad": True}, {}),
    ({"loss": "forward_kl", "reduction": "none"}, {}),
    ({"loss": "forward_kl", "training": False}, {}),
    ({"loss": "reverse_kl", "sharded": True, "return_entropy": True}, {}),
    ({"hard_label_weight": 0.3, "temperature": 2.0}, {}),
], ids=["rkl-entropy", "fkl-teacher", "fkl-none", "fkl-no-grad", "rkl-entropy-shard", "hard-own-softmax"])
def test_statistics_needing_both_heads_keep_their_pass(options: dict, knobs: dict) -> None:
    """Forward KL's cross sum where forward does not write the student's gradient alone (the teacher's too, a
    deferred backward, no gradient) and the hard term's own softmax at a temperature need both heads' logits at
    once, and reverse KL's centre beside the entropy's sum two sums of the student's epilogue: asked for the GEMMs'
    statistics, the plan keeps the pair statistics pass and says why."""
    with override_params({**STATS_IN_GEMM, **knobs}, backend="cuda"):
        record = flce.explain_distillation("cpu", backend="cuda", shape=(64, 8, 12, 40), dtype="float32", **options)
    assert not record.plan.stats_in_gemm
    fused = not knobs and not options.get("sharded")
    kernel = "_pair_passes_kernel" if fused else "_pair_stats_kernel"
    assert f"flce.backends.cuda.distill_kernels.{kernel}" in record.kernel_names()
    why = ("needs the student's softmax at temperature 1" if "temperature" in options else
           "makes one weighted sum" if options.get("return_entropy") else "needs both heads' logits")
    assert why in str(record)


@pytest.mark.parametrize("knobs", [{"forward_logits": "cublas"}, None])
def test_reverse_kl_reads_the_teacher_only_where_asked(knobs: dict | None) -> None:
    """Reverse KL's statistics come from the GEMMs only through families whose epilogue reads the teacher's logits,
    and only where the cache asks for them (measured level with the pair statistics pass): asked for cuBLAS
    logits, or with nothing cached, the pass stays, saying why."""
    with override_params(knobs, backend="cuda"):
        record = flce.explain_distillation("cpu", backend="cuda", shape=(64, 8, 12, 40), dtype="float32",
                                           loss="reverse_kl")
    assert not record.plan.stats_in_gemm
    assert "flce.backends.cuda.distill_kernels._pair_passes_kernel" in record.kernel_names()
    if knobs is None:
        assert "forward_logits=fused" in str(record)


def test_expectation_sweep_is_forward_kl_for_the_student_alone(generator: torch.Generator) -> None:
    """pair_grad's sweep that sums forward KL's p (t - s) refuses the losses and the teacher gradient that need a
    centre before it, and on forward KL returns the gradient pair_grad writes with the row sums of p (t - s)."""
    teacher, student = (torch.randn(3, 40, generator=generator).to(DEVICE) for _ in range(2))
    cfg = DistillationConfig(loss="forward_kl")
    stats = PairStats.from_partial(tile_statistics(teacher.double(), student.double(), None, cfg), cfg)
    coeffs = pair_coefficients(stats, torch.ones(3, dtype=torch.float64, device=DEVICE), cfg, teacher=False)
    with override_params(SMALL_BLOCKS, backend="cuda"):
        launch = LaunchParams(block_v=16, num_warps=4)
        grad, expectation = pair_grad_expectation_(teacher.clone(), student.clone(), None, cfg, 0, coeffs, launch)
        alone, _ = pair_grad_(teacher.clone(), student.clone(), None, cfg, 0, coeffs, launch)
        torch.testing.assert_close(grad, alone, rtol=0, atol=0)
        p = torch.softmax(teacher.double(), dim=1)
        torch.testing.assert_close(expectation.double(), (p * (teacher - student).double()).sum(1), rtol=1e-5,
                                   atol=1e-6)
        for loss, teacher_grad in (("reverse_kl", False), ("jsd", False), ("forward_kl", True)):
            other = DistillationConfig(loss=loss)
            with_teacher = pair_coefficients(stats, torch.ones(3, dtype=torch.float64, device=DEVICE), other,
                                             teacher=teacher_grad)
            with pytest.raises(ValueError, match="forward KL's student gradient alone"):
                pair_grad_expectation_(teacher.clone(), student.clone(), None, other, 0, with_teacher, launch)


def test_known_statistics_that_cannot_serve_are_refused(generator: torch.Generator) -> None:
    """The fused passes refuse the GEMMs' statistics for a call whose cross sum they cannot make in the gradient's
    sweep (reverse KL; forward KL without a gradient to write), before launching anything."""
    logits = torch.randn(3, 40, generator=generator).to(DEVICE)
    known = PartialPairStats(*(torch.zeros(3, device=DEVICE) for _ in range(4)))
    for loss, scale in (("reverse_kl", torch.ones(3, device=DEVICE)), ("forward_kl", None)):
        cfg = DistillationConfig(loss=loss)
        with pytest.raises(ValueError, match="known statistics cannot serve this call: .*both heads"):
            pair_passes_(logits, logits.clone(), None, cfg, scale, False, LaunchParams(block_v=16), None, known)


@pytest.mark.parametrize(("loss", "reduction"), [("forward_kl", "mean"), ("reverse_kl", "sum"), ("jsd", "none")])
def test_without_target(loss: str, reduction: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, target=False, token_shape=(3, 5))
    _check(pair, generator, loss=loss, reduction=reduction, memory_budget=MANY_CHUNKS)


def test_other_ignore_index_and_all_rows_ignored(generator: torch.Generator) -> None:
    pair = make_pair(generator, ignore_index=5, ignore_fraction=0.4)
    _check(pair, generator, loss="reverse_kl", ignore_index=5, hard_label_weight=0.5, temperature=0.9)
    ignored = make_pair(generator, ignore_fraction=1.0).detached(DEVICE)
    with override_params(SMALL_BLOCKS, backend="cuda"):
        loss = flce_loss(ignored, hard_label_weight=0.5, backend="cuda")
    loss.backward()
    assert loss.item() == 0.0
    assert ignored.student_hidden.grad.abs().max().item() == 0.0
    assert ignored.student_weight.grad.abs().max().item() == 0.0
    empty = make_pair(generator, n=0).detached(DEVICE)
    loss = flce_loss(empty, backend="cuda")
    loss.backward()
    assert loss.item() == 0.0 and empty.student_weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("hard_label_weight", [0.0, 0.4])
def test_vocab_shards_merge_to_the_whole_row(loss: str, hard_label_weight: float, generator: torch.Generator) -> None:
    """Each shard's pair_stats (its vocab_offset), merged as the vocab-parallel combine merges them, equal the whole
    row's in float64 (flce.distillation.tiles); each shard's JSD sums and gradients, given the merged statistics,
    equal the whole row's columns of them."""
    from flce.backends.cuda import distill_ops
    from flce.backends.cuda.configs import LaunchParams

    cfg = DistillationConfig(loss=loss, hard_label_weight=hard_label_weight, temperature=0.8, beta=0.3)
    n, vocab = 6, 40
    u_t = torch.randn(n, vocab, generator=generator, dtype=torch.float64) * 3
    u_s = torch.randn(n, vocab, generator=generator, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (n,), generator=generator)
    target[1] = cfg.ignore_index
    whole_cols = torch.where(target != cfg.ignore_index, target, -1)
    want = PairStats.from_partial(tile_statistics(u_t, u_s, whole_cols, cfg), cfg)
    launch = LaunchParams(block_v=16, num_warps=4)
    shards = ((0, 9), (9, 40))
    merged = None
    for start, stop in shards:
        part = distill_ops.pair_stats(u_t[:, start:stop].float().to(DEVICE), u_s[:, start:stop].float().to(DEVICE),
                                      target.to(DEVICE), cfg, start, launch)
        part = part.like([t.double().cpu() for t in part.present()])
        merged = part if merged is None else merge_pair_stats(merged, part, cfg)
    got = PairStats.from_partial(merged, cfg)
    for name in ("teacher_max", "teacher_log_sum", "student_max", "student_log_sum", "cross_mean", "hard_lse",
                     "target_logit"):
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if cfg.soft and loss == "jsd":
        sums = [distill_ops.mixture_sums(u_t[:, a:b].float().to(DEVICE), u_s[:, a:b].float().to(DEVICE),
                                         _on(got, DEVICE), cfg, launch) for a, b in shards]
        teacher_kl, student_kl = (sum(s[i].double().cpu() for s in sums) for i in range(2))
        want_kl = tile_mixture_sums(u_t, u_s, (want.teacher_max, want.teacher_log_sum),
                                    (want.student_max, want.student_log_sum), cfg)
        torch.testing.assert_close(teacher_kl, want_kl[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(student_kl, want_kl[1], rtol=1e-5, atol=1e-6)
        want = with_mixture_sums(want, *want_kl)
        got = with_mixture_sums(got, teacher_kl, student_kl)
    scale = torch.rand(n, generator=generator, dtype=torch.float64) + 0.5
    scale[1] = 0.0
    want_grads = tile_gradients(u_t, u_s, whole_cols, pair_coefficients(want, scale, cfg, teacher=True), cfg)
    coeffs = pair_coefficients(_on(got, DEVICE), scale.float().to(DEVICE), cfg, teacher=True)
    for start, stop in shards:
        teacher_logits = u_t[:, start:stop].float().contiguous().to(DEVICE)
        student_logits = u_s[:, start:stop].float().contiguous().to(DEVICE)
        student_grad, teacher_grad = distill_ops.pair_grad_(teacher_logits, student_logits, target.to(DEVICE), cfg,
                                                            start, coeffs, launch)
        assert student_grad.data_ptr() == student_logits.data_ptr(), "the gradient is written over the logits"
        for got_grad, want_grad in ((student_grad, want_grads[0]), (teacher_grad, want_grads[1])):
            torch.testing.assert_close(got_grad.double().cpu(), want_grad[:, start:stop], rtol=1e-4, atol=1e-6)


def _on(stats: PairStats, device: str) -> PairStats:
    return PairStats(**{name: None if t is None else t.float().to(device) for name, t in vars(stats).items()})


@pytest.mark.parametrize(("dtype", "loss"), [(torch.bfloat16, "forward_kl"), (torch.bfloat16, "reverse_kl"),
                                             (torch.bfloat16, "jsd"), (torch.float16, "jsd")])
def test_16_bit_within_eager_error(dtype: torch.dtype, loss: str, generator: torch.Generator) -> None:
    pair = make_pair(generator, n=64, student_size=32, teacher_size=48, vocab=256, ignore_fraction=0.1,
                     scale=3.0).detached(DEVICE)
    reference = pair.detached("cpu")
    expected = oracle(reference, loss=loss, temperature=1.5)
    want = torch.autograd.grad(expected, (reference.student_hidden, reference.student_weight))
    eager, eager_grads = eager_loss(pair, dtype, loss, 1.5)
    ours = type(pair)(*(None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad)
                        for t in pair.leaves), pair.target)
    with override_params({"block_v": 64, "num_warps": 4}, backend="cuda"):
        got = flce_loss(ours, loss=loss, temperature=1.5, backend="cuda", memory_budget=64 * 256 * 2 * 2 // 3)
    grads = torch.autograd.grad(got, (ours.student_hidden, ours.student_weight))
    assert relative(got.detach(), expected) <= 1.5 * max(relative(eager.detach(), expected), 1e-3)
    for name, g, e, w in zip(("grad student_hidden", "grad student_weight"), grads, eager_grads, want, strict=True):
        assert relative(g, w) <= 1.5 * relative(e, w), (name, relative(g, w), relative(e, w))


# ------------------------------------------------------------------------- the record: what a call plans and runs

def _planned(monkeypatch: pytest.MonkeyPatch, step) -> object:
    """The record of the distillation call ``step`` makes (its DistillCall carries it)."""
    from flce.engine.distillation import run

    records = []
    real = run.apply_eager

    def capturing(pair, call):
        records.append(call.choice)
        return real(pair, call)

    monkeypatch.setattr(run, "apply_eager", capturing)
    step()
    assert len(records) == 1 and records[0] is not None
    return records[0]


RECORD_CALLS = {  # name: (options, knobs, training, bias)
    "jsd-fused": ({"hard_label_weight": 0.2}, {}, True, True),
    "forward-kl-none-teacher": ({"loss": "forward_kl", "reduction": "none", "teacher_grad": True,
                                 "memory_budget": MANY_CHUNKS}, {}, True, False),
    "reverse-kl-separate": ({"loss": "reverse_kl", "temperature": 2.0}, {"pair_passes": "separate"}, True, True),
    "jsd-separate-many-chunks": ({"memory_budget": MANY_CHUNKS}, {"pair_passes": "separate", "rows_in_flight": 4},
                                 True, False),
    "no-grad": ({"hard_label_weight": 0.5}, {}, False, False),
    "jsd-stats-in-gemm": ({"hard_label_weight": 0.2}, STATS_IN_GEMM, True, True),
    "jsd-stats-in-gemm-separate": ({"memory_budget": MANY_CHUNKS}, {**STATS_IN_GEMM, "pair_passes": "separate"},
                                   True, False),
    "stats-in-gemm-no-grad": ({"hard_label_weight": 0.5}, STATS_IN_GEMM, False, False),
}


@pytest.mark.parametrize("name", list(RECORD_CALLS))
def test_record_equals_explain_and_names_what_ran(name: str, monkeypatch: pytest.MonkeyPatch,
                                                  generator: torch.Generator) -> None:
    """A call's record equals explain's for the same description (the interpreter's CPU, or this GPU), and every
    Triton kernel and torch GEMM it launched (counted by name) is one the record names, and the reverse."""
    options, knobs, training, bias = RECORD_CALLS[name]
    gemms = {"torch.mm", "torch.addmm", "torch.Tensor.addmm_"}
    ran = count_launches(monkeypatch, ("distill_kernels", "kernels", "target_kernels", "gemm_kernels"), gemms)
    pair = make_pair(generator, n=16, student_size=8, teacher_size=24, vocab=48, bias=bias,
                     teacher_requires_grad=options.get("teacher_grad", False)).detached(DEVICE)

    def step() -> None:
        with override_params(knobs or None, backend="cuda"), torch.set_grad_enabled(training):
            loss = flce_loss(pair, backend="cuda", **options)
        if training:
            loss.sum().backward()

    planned = _planned(monkeypatch, step)
    described = {}
    if DEVICE == "cuda":  # this GPU as its driver describes it
        props = torch.cuda.get_device_properties(0)
        described = {"gpu": torch.cuda.get_device_name(0), "capability": (props.major, props.minor),
                     "multiprocessors": props.multi_processor_count, "total_memory": props.total_memory}
    with override_params(knobs or None, backend="cuda"):
        explained = flce.explain_distillation(DEVICE, backend="cuda", shape=(16, 8, 24, 48), dtype="float32",
                                              training=training, student_bias=bias, teacher_bias=bias, **described,
                                              **options)
    assert explained == planned
    named = {k for k in planned.kernel_names() if k.startswith("flce.") or k in gemms}
    assert ran == named, f"ran {sorted(ran)}\n{planned}"
    assert planned.plan.fused_passes == (knobs.get("pair_passes") != "separate")


@pytest.mark.parametrize("gpu", [H100, A100])
@pytest.mark.parametrize("options", [{}, {"loss": "reverse_kl", "reduction": "none", "teacher_grad": True},
                                     {"hard_label_weight": 0.5, "memory_budget": 128 << 20}])
def test_record_on_a_described_gpu_equals_the_plan(gpu: str, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner reads its device through hardware.describe_device: with a described GPU injected there, a call
    planned on stand-in tensors of the issue's shape (nothing runs) has explain's record; its chunks fit the budget,
    and it names the pair kernels, the logits' family and the gradient products'."""
    from flce.backends import cuda
    from flce.backends.cuda import hardware
    from flce.distillation.inputs import FlatPair
    from flce.engine.plans import PlanRequest

    monkeypatch.setattr(hardware, "describe_device", lambda device: hardware.gpu_description(gpu))
    n, hs, ht, v = 8192, 4096, 8192, 128256

    def view(*size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty((), dtype=dtype).expand(*size)

    pair = FlatPair(view(n, hs), view(v, hs), None, view(n, ht), view(v, ht), None, view(n, dtype=torch.int64),
                    torch.Size([n]))
    cfg = DistillationConfig(**options)
    planned = cuda.BACKEND.plan_distillation(pair, cfg, PlanRequest(training=True))
    explained = flce.explain_distillation("cuda", gpu=gpu, shape=(n, hs, ht, v), dtype="bfloat16", **options)
    assert planned.choice == explained and explained.backend == "cuda"
    assert explained.memory.working_bytes <= explained.memory.budget
    assert explained.memory.working_bytes == planned.plan.tokens_per_chunk * 2 * v * 2
    names = explained.kernel_names()
    passes = "_pair_passes_kernel" if cfg.reduction != "none" else "_pair_grad_kernel"
    assert f"flce.backends.cuda.distill_kernels.{passes}" in names and "torch.mm" in names
    # On Hopper the warp-specialised GEMM writes both heads' logits with their softmaxes' statistics where the loss
    # needs no cross sum (JSD, the hard term at temperature 1); the gradient products stay cuBLAS's (measured
    # faster), and every other GPU's logits too.
    in_gemm = gpu == H100 and cfg.loss == "jsd"
    assert explained.plan.stats_in_gemm == in_gemm
    assert ("flce.backends.cuda.distill_kernels._pair_stats_kernel" in names) == (not in_gemm and not
                                                                                   explained.plan.fused_passes)
    ws = [name for name in names if "ws_gemm_kernels" in name]
    assert ws == (["flce.backends.cuda.ws_gemm_kernels._ws_gemm_kernel"] if in_gemm else [])
    products = next(step for step in explained.steps if step.name.startswith("gradient products"))
    assert "ws_gemm" not in " ".join(products.kernels)


@pytest.mark.parametrize("gpu", [H100, A100])
def test_vocabulary_shard_plans_one_kernel_a_pass(gpu: str) -> None:
    """A shard's passes are one kernel each (its statistics need the other shards' first); on Hopper the logits
    GEMMs make the shard's statistics, elsewhere the pair statistics kernel does."""
    record = flce.explain_distillation("cuda", gpu=gpu, shape="8192x4096x4096x64128", sharded=True)
    assert not record.plan.fused_passes and record.plan.stats_in_gemm == (gpu == H100)
    names = record.kernel_names()
    for kernel in ("_mixture_sums_kernel", "_pair_grad_kernel"):
        assert f"flce.backends.cuda.distill_kernels.{kernel}" in names
    assert ("flce.backends.cuda.distill_kernels._pair_stats_kernel" in names) == (gpu == A100)


@pytest.mark.parametrize(("knobs", "registers"), [(None, PAIR_REGISTERS), ({"pair_registers": 96}, 96),
                                                   ({"pair_registers": 1000}, PAIR_REGISTERS),
                                                   ({"pair_registers": 8}, PAIR_REGISTERS)])
def test_pair_passes_register_cap(knobs: dict | None, registers: int) -> None:
    """The one-kernel passes run with at most PAIR_REGISTERS registers a thread, or the cache's pair_registers
    where the compiler can take it (a value out of range falls back); the record says which, and the tuner
    measures the kernel without the cap too."""
    from flce.autotune.spaces import DISTILLATION, TuneShape, tuning_space

    with override_params(knobs, backend="cuda"):
        record = flce.explain_distillation("cpu", backend="cuda", shape=(2048, 16, 16, 64), dtype="float32")
    assert f"at most {registers} registers a thread" in str(record)
    shape = TuneShape(torch.device("cpu"), torch.float32, 16, 64, 2048, "distillation")
    candidates = tuning_space("cuda", DISTILLATION).candidates(shape, False)
    assert {c.get("pair_registers") for c in candidates} == {None, PAIR_REGISTERS_RANGE[1]}


def test_pair_passes_launch_carries_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels compile to PTX the one kernel is launched with ptxas's maxnreg at the cap; the interpreter
    (and HIP) launch it without."""
    from flce.backends.cuda import distill_ops
    from flce.backends.cuda.configs import LaunchParams

    seen: dict = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(distill_ops.k, "_pair_passes_kernel", Recorder())
    logits = torch.randn(4, 40), torch.randn(4, 40)
    for ptx, expected in ((True, PAIR_REGISTERS), (False, None)):
        seen.clear()
        monkeypatch.setattr(distill_ops, "compiles_to_ptx", lambda t, ptx=ptx: ptx)
        distill_ops.pair_passes_(*logits, None, DistillationConfig(loss="jsd"), torch.ones(4), False,
                                 LaunchParams(block_v=16), None, None, PAIR_REGISTERS)
        assert seen["PTX"] is ptx and seen.get("maxnreg") == expected


def test_tuning_space_heuristic_is_the_planners_choice() -> None:
    from flce.autotune.spaces import DISTILLATION, TuneShape, tuning_space

    space = tuning_space("cuda", DISTILLATION)
    shape = TuneShape(torch.device("cpu"), torch.float32, 16, 64, 2048, "distillation")
    heuristic = space.heuristic(shape)
    record = flce.explain_distillation("cpu", backend="cuda", shape=(2048, 16, 16, 64), dtype="float32")
    assert heuristic["tokens_per_chunk"] == record.plan.tokens_per_chunk
    assert heuristic["pair_passes"] == "fused" and heuristic["grad_gemm_kernel"] == "cublas"
    candidates = space.candidates(shape, True)
    assert {c["pair_passes"] for c in candidates} == {"fused", "separate"}
    assert space.working_bytes(shape, {"tokens_per_chunk": 256}) == 256 * 2 * 64 * 4
    assert space.budget_candidates(shape, 64 * 512 * 2 * 4) == [{"tokens_per_chunk": 512}]
    with override_params({"pair_passes": "separate", "tokens_per_chunk": 512}, backend="cuda"):
        tuned = flce.explain_distillation("cpu", backend="cuda", shape=(2048, 16, 16, 64), dtype="float32")
    assert not tuned.plan.fused_passes and tuned.plan.tokens_per_chunk == 512


def test_products_family_fits_both_heads_where_the_teacher_takes_a_gradient() -> None:
    """The cache's warp-specialised products on a Hopper GPU: taken for the student's head, passed over (cuBLAS)
    where the teacher takes a gradient and its hidden size is one that family cannot take."""
    ws = "flce.backends.cuda.ws_gemm_kernels._ws_gemm_kernel"
    with override_params({"grad_gemm_kernel": "warp_specialized"}, backend="cuda"):
        student_only = flce.explain_distillation("cuda", gpu=H100, shape="8192x4096x4100x128256")
        both = flce.explain_distillation("cuda", gpu=H100, shape="8192x4096x4100x128256", teacher_grad=True)
    assert ws in student_only.kernel_names()
    assert ws not in both.kernel_names() and "the teacher's head: warp_specialized: H=4100" in str(both)
