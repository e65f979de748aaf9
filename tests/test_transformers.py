"""flce.integrations.transformers on tiny randomly initialised causal LMs (no downloads).

The patched model's loss and every parameter gradient equal the unpatched model's, for Llama,
Qwen2, Mistral and Gemma 2 (final-logit soft-capping) configurations; calls that want logits
still get them.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flce.integrations import transformers as flce_hf  # noqa: E402

VOCAB, BATCH, SEQ = 96, 2, 11
# initializer_range 0.5 gives logits of a few units: large enough that the soft-cap matters.
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, initializer_range=0.5, max_position_embeddings=64)


def _config(family: str):
    if family == "llama":
        config = transformers.LlamaConfig(**_COMMON)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**_COMMON)
    elif family == "mistral":
        config = transformers.MistralConfig(**_COMMON, sliding_window=None)
    elif family == "gemma2":
        config = transformers.Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=3.0, query_pre_attn_scalar=8)
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    return config


def _models(family: str, seed: int):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).float()
    model.train()
    patched = flce_hf.apply(copy.deepcopy(model))
    return model, patched


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding in the second sequence
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, 4] = -100
    return input_ids, attention_mask, labels


def _loss_and_grads(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    loss = out.loss if not isinstance(out, tuple) else out[0]
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, patched, **inputs) -> None:
    loss, grads = _loss_and_grads(model, **inputs)
    loss_p, grads_p = _loss_and_grads(patched, **inputs)
    torch.testing.assert_close(loss_p, loss, rtol=1e-5, atol=1e-6)
    assert grads_p.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_p[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
def test_loss_and_gradients_equal_the_unpatched_model(family: str, generator: torch.Generator) -> None:
    model, patched = _models(family, seed=1)
    input_ids, attention_mask, labels = _batch(generator)
    _assert_same(model, patched, input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None, "the patched training forward must not materialise the logits"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_num_items_in_batch_and_shift_labels(family: str, generator: torch.Generator) -> None:
    """Gradient accumulation (sum / num_items_in_batch) and caller-shifted labels, as the model does."""
    model, patched = _models(family, seed=2)
    input_ids, attention_mask, labels = _batch(generator)
    num_items = torch.tensor(37)  # a whole accumulation window's token count, not this batch's
    _assert_same(model, patched, input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                 num_items_in_batch=num_items)
    shift_labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    shift_labels[:, -2:] = -100
    _assert_same(model, patched, input_ids=input_ids, labels=labels, shift_labels=shift_labels)


def test_softcap_comes_from_the_config(generator: torch.Generator) -> None:
    """The Gemma 2 test above is sensitive to the soft-cap: without it the loss differs."""
    model, patched = _models("gemma2", seed=3)
    assert flce_hf.is_applied(patched)
    input_ids, _, labels = _batch(generator)
    with_cap = patched(input_ids=input_ids, labels=labels).loss
    uncapped = flce_hf.causal_lm_loss(patched.model(input_ids=input_ids)[0], patched.lm_head, labels)
    assert (with_cap - uncapped).abs() > 1e-2, "the soft-cap should change this model's loss"
    torch.testing.assert_close(with_cap, model(input_ids=input_ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_logits_still_returned_where_wanted(generator: torch.Generator) -> None:
    model, patched = _models("qwen2", seed=4)
    input_ids, attention_mask, labels = _batch(generator)
    want = model(input_ids=input_ids, attention_mask=attention_mask)
    got = patched(input_ids=input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(got.logits, want.logits)
    with torch.no_grad():  # evaluation: loss and logits, as the unpatched model gives them
        want = model(input_ids=input_ids, labels=labels)
        got = patched(input_ids=input_ids, labels=labels)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)


def test_positional_arguments_and_tuple_output(generator: torch.Generator) -> None:
    model, patched = _models("mistral", seed=5)
    input_ids, attention_mask, labels = _batch(generator)
    out = patched(input_ids, attention_mask, labels=labels, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], model(input_ids, attention_mask, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_remove_restores_the_model(generator: torch.Generator) -> None:
    _, patched = _models("llama", seed=6)
    input_ids, _, labels = _batch(generator)
    flce_hf.remove(patched)
    assert not flce_hf.is_applied(patched)
    assert patched(input_ids=input_ids, labels=labels).logits is not None


def test_apply_rejects_bad_models_and_options() -> None:
    config = _config("llama")
    with pytest.raises(TypeError, match="backbone without an LM head"):
        flce_hf.apply(transformers.LlamaModel(config))
    with pytest.raises(ValueError, match=r"options \['reduction'\]: set by the transformers adapter"):
        flce_hf.apply(transformers.LlamaForCausalLM(config), reduction="sum")
    with pytest.raises(ValueError, match="memory_budget=-1"):
        flce_hf.apply(transformers.LlamaForCausalLM(config), memory_budget=-1)


def test_a_forward_set_on_the_instance_is_kept(generator: torch.Generator) -> None:
    """Libraries such as accelerate replace model.forward on the instance: that forward still runs
    where logits are wanted, and remove() puts it back."""
    model, _ = _models("llama", seed=7)
    calls = []
    class_forward = model.forward

    def hooked_forward(*args, **kwargs):
        calls.append(kwargs.get("labels") is not None)
        return class_forward(*args, **kwargs)

    model.forward = hooked_forward
    flce_hf.apply(model)
    input_ids, _, labels = _batch(generator)
    assert model(input_ids=input_ids).logits is not None
    assert model(input_ids=input_ids, labels=labels).logits is None
    assert calls == [False], "only the logits call goes through the instance's forward"
    flce_hf.remove(model)
    assert model.forward is hooked_forward


@pytest.fixture
def transformers_warnings(caplog: pytest.LogCaptureFixture):
    """Every warning transformers logs during the test, its once-only ones included (their memo is
    cleared before and after, so that an earlier test's warning does not hide this test's)."""
    import logging

    from transformers.utils import logging as hf_logging

    once = getattr(logging.Logger, "warning_once", None)
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    hf_logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="transformers")
    try:
        yield lambda: [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    finally:
        hf_logging.disable_propagation()
        if once is not None and hasattr(once, "cache_clear"):
            once.cache_clear()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_patched_forward_makes_transformers_warn_no_more_than_the_model(
        family: str, generator: torch.Generator, transformers_warnings) -> None:
    """The output carries the backbone's cache under the name the installed transformers uses (``cache``
    in 5.x, ``past_key_values`` before): no deprecation warning on every forward with labels."""
    model, patched = _models(family, seed=8)
    input_ids, attention_mask, labels = _batch(generator)
    model.eval(), patched.eval()  # use_cache: the backbone returns a cache to carry over
    want = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    unpatched_warnings = transformers_warnings()
    got = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert got.logits is None, "the patched path ran"
    assert transformers_warnings() == unpatched_warnings, transformers_warnings()
    name = next(n for n in ("cache", "past_key_values") if n in type(want).__dataclass_fields__)
    assert type(getattr(got, name)) is type(getattr(want, name)) and getattr(want, name) is not None
