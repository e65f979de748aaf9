"""The TRL drop-in of linear distillation (flce.integrations.trl.GKDDistillationLossMixin) against TRL 1.16.0's own
``GKDTrainer.compute_loss`` and ``generalized_jsd_loss`` (tests/trainer_code.py loads them), on two tiny Llamas of
different hidden sizes, float64 on the CPU: the loss and every student parameter's gradient, the teacher's
untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from trainer_code import trl_gkd_trainer

from flce.integrations import trl as flce_trl

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
