"""TRL's distillation trainers on flce (flce/integrations/trl_distillation.py) against TRL 1.16.0's own code
(tests/trainer_code.py loads it): GKDDistillationLossMixin against ``GKDTrainer.compute_loss`` and
``generalized_jsd_loss`` on two tiny Llamas of different hidden sizes, float64 on the CPU (the loss and every student
parameter's gradient, the teacher's untouched) and bf16 on the GPU; chunked_divergence_loss against the
DistillationTrainer's ``_chunked_divergence_loss`` over TRL's kernel, and against float64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trainer_code import trl_chunked_divergence_loss, trl_gkd_trainer

from flce.integrations import trl as flce_trl
from flce.testing.distillation import reference_distillation_loss

FP64 = dict(rtol=1e-9, atol=1e-11)
VOCAB = 48


def _tiny_llama(generator: torch.Generator, hidden_size: int, **config: object) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    options = dict(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31, (), generator=generator)))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**options, **config})).double()


def _inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A batch as TRL's ChatML collator makes it: the prompt's labels and the padding -100."""
    batch, length, prompt = 3, 12, 4
    input_ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, 9:] = 0  # a short sequence, padded
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    labels[attention_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class _Accelerator:
    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


def _trainers(teacher: torch.nn.Module, beta: float) -> tuple[object, object]:
    """TRL's compute_loss and the mixin's over it, each on a stand-in with the attributes they read."""
    base = trl_gkd_trainer()
    mixed = type("Mixed", (flce_trl.GKDDistillationLossMixin, base), {})
    attrs = dict(teacher_model=teacher, beta=beta, accelerator=_Accelerator())
    mixin_trainer = mixed.__new__(mixed)  # GKDTrainer's __init__ builds a whole training run: the attributes alone
    vars(mixin_trainer).update(attrs)
    return SimpleNamespace(**attrs, generalized_jsd_loss=base.generalized_jsd_loss), mixin_trainer


@pytest.mark.parametrize("accumulation", [False, True], ids=["batchmean", "num_items_in_batch"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.2, 1.0])
def test_gkd_mixin_matches_trls_compute_loss(beta: float, accumulation: bool, generator: torch.Generator) -> None:
    student, teacher = _tiny_llama(generator, 16), _tiny_llama(generator, 24)
    inputs = _inputs(generator)
    items = torch.tensor(2 * int((inputs["labels"][:, 1:] != -100).sum())) if accumulation else None
    base = trl_gkd_trainer()
    trl_trainer, _ = _trainers(teacher, beta)
    want = base.compute_loss(trl_trainer, student, inputs, num_items_in_batch=items)
    params = [p for p in student.parameters() if p.requires_grad]
    want_grads = torch.autograd.grad(want, params)

    flce_trl.add_policy_head(student)
    flce_trl.add_policy_head(teacher)
    _, mixin_trainer = _trainers(teacher, beta)
    got = mixin_trainer.compute_loss(student, inputs, num_items_in_batch=items)
    torch.testing.assert_close(got, want, **FP64)
    for got_grad, want_grad in zip(torch.autograd.grad(got, params), want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, **FP64)
    assert all(p.grad is None for p in teacher.parameters()), "the teacher took a gradient"


def test_gkd_mixin_returns_trls_outputs_when_asked(generator: torch.Generator) -> None:
    """Evaluation asks for the model's outputs (its logits): the mixin runs TRL's own compute_loss."""
    student, teacher = _tiny_llama(generator, 16), _tiny_llama(generator, 24)
    flce_trl.add_policy_head(student)
    flce_trl.add_policy_head(teacher)
    _, mixin_trainer = _trainers(teacher, 0.5)
    inputs = _inputs(generator)
    loss, outputs = mixin_trainer.compute_loss(student, inputs, return_outputs=True)
    assert outputs.logits.shape == (3, 12, VOCAB)
    torch.testing.assert_close(loss, mixin_trainer.compute_loss(student, inputs), **FP64)


def test_gkd_mixin_refuses_a_logit_softcap(generator: torch.Generator) -> None:
    student = _tiny_llama(generator, 16)
    student.config.final_logit_softcapping = 30.0
    teacher = _tiny_llama(generator, 24)
    flce_trl.add_policy_head(student)
    flce_trl.add_policy_head(teacher)
    _, mixin_trainer = _trainers(teacher, 0.5)
    with pytest.raises(ValueError, match="logit softcap or scale"):
        mixin_trainer.compute_loss(student, _inputs(generator))


def test_a_copy_of_a_patched_model_runs_its_own_forward(generator: torch.Generator) -> None:
    """copy.deepcopy of a model after add_policy_head (as a reference model is often made): the copy's forward,
    with flce_policy and without, is the copy's, not that of the model it was copied from."""
    import copy

    model = _tiny_llama(generator, 16)
    flce_trl.add_policy_head(model)
    flce_trl.add_policy_head(model)  # twice: still the model's own forward underneath
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2.0)
        twin.model.norm.weight.mul_(3.0)
    ids = _inputs(generator)["input_ids"]
    logits, twin_logits = model(input_ids=ids).logits, twin(input_ids=ids).logits
    torch.testing.assert_close(twin_logits, 6.0 * logits, **FP64)
    hidden = twin(input_ids=ids, flce_policy=lambda hidden, weight, bias, scaling: hidden @ weight.T)
    torch.testing.assert_close(hidden, twin_logits, **FP64)


def _divergence_inputs(generator: torch.Generator, dtype: torch.dtype = torch.float64, device: str = "cpu",
                       batch: int = 3, length: int = 7, student_h: int = 16, teacher_h: int = 24,
                       vocab: int = 300) -> dict:
    """The DistillationTrainer's arguments: [B, K, H] hidden states aligned to the completion, its mask (padding
    after each completion), the two heads (different hidden sizes), biases."""
    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(device, dtype)

    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    return {"student_hidden_states": draw(batch, length, student_h),
            "teacher_hidden_states": draw(batch, length, teacher_h),
            "student_lm_head_weight": draw(vocab, student_h, scale=student_h**-0.5),
            "teacher_lm_head_weight": draw(vocab, teacher_h, scale=teacher_h**-0.5),
            "completion_mask": mask.to(device), "student_lm_head_bias": draw(vocab, scale=0.1),
            "teacher_lm_head_bias": draw(vocab, scale=0.1)}


def _divergence_run(function, inputs: dict, **options: object) -> tuple:
    """``function``'s (loss, entropy sum, count) and the student's gradients (hidden, weight, bias)."""
    student = ("student_hidden_states", "student_lm_head_weight", "student_lm_head_bias")
    leaves = {k: v.detach().clone().requires_grad_(k in student) if v.is_floating_point() else v
              for k, v in inputs.items()}
    loss, entropy, count = function(**leaves, **options)
    grads = torch.autograd.grad(loss, [leaves[k] for k in student])
    return loss.detach(), entropy, count, grads


def _entropy_of(inputs: dict, temperature: float) -> torch.Tensor:
    """The student's entropy at ``temperature`` summed over the counted positions, float64 on materialised logits."""
    hidden = inputs["student_hidden_states"].double()
    logits = (hidden @ inputs["student_lm_head_weight"].double().T + inputs["student_lm_head_bias"].double())
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    rows = -(log_q.exp() * log_q).sum(-1)
    return rows[inputs["completion_mask"] != 0].sum()


@pytest.mark.parametrize("accumulation", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("beta,temperature", [(0.5, 1.0), (0.0, 1.0), (1.0, 0.7), (0.2, 1.6)])
def test_chunked_divergence_loss_matches_trls(beta: float, temperature: float, accumulation: bool,
                                              generator: torch.Generator) -> None:
    """flce.integrations.trl.chunked_divergence_loss against TRL's _chunked_divergence_loss on the same arguments:
    the loss, the entropy sum, the count and the student's gradients. TRL's kernel keeps its logits tiles in fp32
    whatever the inputs' dtype, so the two agree to fp32 rounding; flce's equal the float64 oracle to 1e-10."""
    inputs = _divergence_inputs(generator)
    options = dict(beta=beta, temperature=temperature, num_items_in_batch=torch.tensor(17.0) if accumulation else None)
    got = _divergence_run(flce_trl.chunked_divergence_loss, inputs, **options)
    want = _divergence_run(trl_chunked_divergence_loss(), inputs, **options)
    assert int(got[2]) == int(want[2]) == 12  # 7 + 4 + 1 positions
    torch.testing.assert_close(got[0], want[0].to(got[0].dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1].double(), want[1].double(), rtol=1e-5, atol=1e-6)
    for g, w in zip(got[3], want[3], strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-4, atol=1e-7)
    # flce's against float64 itself: the loss (TRL's semantics, the oracle's JSD) and the entropy
    valid = inputs["completion_mask"].reshape(-1) != 0
    flat = {k: inputs[k].reshape(-1, inputs[k].shape[-1])[valid] for k in ("student_hidden_states",
                                                                            "teacher_hidden_states")}
    divergence = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    oracle = reference_distillation_loss(flat["student_hidden_states"], inputs["student_lm_head_weight"],
                                         flat["teacher_hidden_states"], inputs["teacher_lm_head_weight"],
                                         loss=divergence, beta=beta, temperature=temperature, reduction="sum",
                                         student_bias=inputs["student_lm_head_bias"],
                                         teacher_bias=inputs["teacher_lm_head_bias"])
    torch.testing.assert_close(got[0], oracle / (17.0 if accumulation else 12.0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], _entropy_of(inputs, temperature), rtol=1e-10, atol=1e-12)


def test_chunked_divergence_loss_of_no_positions_is_zero(generator: torch.Generator) -> None:
    inputs = _divergence_inputs(generator)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    loss, entropy, count, grads = _divergence_run(flce_trl.chunked_divergence_loss, inputs, beta=0.5)
    assert float(loss) == 0.0 and float(entropy) == 0.0 and int(count) == 0
    assert all(float(g.abs().sum()) == 0.0 for g in grads)


def test_chunked_divergence_loss_refuses_a_softcap_or_scale(generator: torch.Generator) -> None:
    inputs = _divergence_inputs(generator)
    for option in ({"student_final_logit_softcapping": 30.0}, {"teacher_logit_scale": 0.5}):
        with pytest.raises(ValueError, match="no logit scale or softcap"):
            flce_trl.chunked_divergence_loss(**inputs, beta=0.5, **option)


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_chunked_divergence_loss_in_bfloat16_on_the_gpu(beta: float, generator: torch.Generator) -> None:
    """As the DistillationTrainer runs it: bf16 hidden states on the GPU, an fp32 master copy of the teacher's
    head, flce's CUDA kernels at a vocabulary of thousands. The loss, the student's gradients and the entropy sum
    against float64 on the same values, and against TRL's own kernel there (its logits tiles fp32)."""
    inputs = _divergence_inputs(generator, dtype=torch.bfloat16, device="cuda", batch=4, length=300, student_h=256,
                                teacher_h=384, vocab=32003)
    inputs["teacher_lm_head_weight"] = inputs["teacher_lm_head_weight"].float()
    got = _divergence_run(flce_trl.chunked_divergence_loss, inputs, beta=beta, temperature=0.9)
    trl = _divergence_run(trl_chunked_divergence_loss(), inputs, beta=beta, temperature=0.9)
    wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    want = _divergence_run(flce_trl.chunked_divergence_loss, wide, beta=beta, temperature=0.9)
    assert int(got[2]) == int(want[2]) == int(trl[2])
    assert _relative(got[0], want[0]) <= 2e-2 and _relative(trl[0], want[0]) <= 2e-2
    assert _relative(got[1], want[1]) <= 1e-2, (float(got[1]), float(want[1]))
    for g, t, w in zip(got[3], trl[3], want[3], strict=True):
        assert _relative(g, w) <= 2e-2, (_relative(g, w), _relative(t, w))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_mixin_in_bfloat16_on_the_gpu(beta: float, generator: torch.Generator) -> None:
    """The mixin as training runs it: bf16 models on the GPU, the CUDA kernels at a vocabulary of thousands. Its loss
    and student gradients against TRL's compute_loss in float64 on the same weights, within 1.5x the error of TRL's
    own compute_loss in bf16 (the models' bodies, alike in both, round the same)."""
    import copy

    device = torch.device("cuda")
    vocab, length = 4099, 64
    options = dict(vocab_size=vocab, tie_word_embeddings=False)
    student64, teacher64 = _tiny_llama(generator, 64, **options), _tiny_llama(generator, 96, **options)
    student64, teacher64 = student64.to(device), teacher64.to(device)
    input_ids = torch.randint(0, vocab, (3, length), generator=generator)
    attention_mask = torch.ones(3, length, dtype=torch.long)
    attention_mask[1, 40:] = 0
    labels = input_ids.clone()
    labels[:, :8] = -100
    labels[attention_mask == 0] = -100
    inputs = {k: v.to(device) for k, v in
              {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}.items()}
    base = trl_gkd_trainer()

    def trl_loss(student: torch.nn.Module, teacher: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        trainer, _ = _trainers(teacher, beta)
        loss = base.compute_loss(trainer, student, inputs)
        return loss, torch.autograd.grad(loss, [p for p in student.parameters() if p.requires_grad])

    want, want_grads = trl_loss(student64, teacher64)
    student, teacher = (copy.deepcopy(m).to(torch.bfloat16) for m in (student64, teacher64))
    eager, eager_grads = trl_loss(student, teacher)
    flce_trl.add_policy_head(student)
    flce_trl.add_policy_head(teacher)
    _, mixin_trainer = _trainers(teacher, beta)
    got = mixin_trainer.compute_loss(student, inputs)
    got_grads = torch.autograd.grad(got, [p for p in student.parameters() if p.requires_grad])
    assert _relative(got, want) <= 1.5 * _relative(eager, want) + 1e-6, (got.item(), eager.item(), want.item())
    errors = [(_relative(g, w), _relative(e, w)) for g, e, w in zip(got_grads, eager_grads, want_grads, strict=True)]
    assert all(g <= 1.5 * e + 1e-6 for g, e in errors), errors
    assert all(p.grad is None for p in teacher.parameters()), "the teacher took a gradient"
