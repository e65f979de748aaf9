"""flce.integrations.megatron on a tiny megatron-core GPTModel, on the CPU with gloo.

Needs megatron-core (``pip install -e '.[megatron]'`` in a checkout); skipped without it. The model is built in
the test: learned absolute positions, MLP-only transformer layers (megatron-core's local
attention allocates its buffers with ``torch.cuda`` and cannot run on a CPU-only torch), the
tensor-parallel output layer. Patched and unpatched models must give the same per-token losses
and the same gradients for every parameter, at TP=1 and TP=2, tied and untied embeddings. With
sequence parallelism megatron-core's decoder and head need CUDA, so the patched
sequence-parallel post-processing step is compared with the unpatched one without sequence
parallelism, fed the full sequence. The RL outputs (log-probs and entropy at a temperature) through
megatron-core's ``output_processor`` hook (0.19) are compared with Megatron's native vocab-parallel
path and with float64 log-softmax over the gathered logits.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_distributed import Checker, _expect_error, assert_section, run_ranks, seed_of

import flce
from flce.integrations import megatron as flce_megatron

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.core") is not None
if HAS_MEGATRON:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex / Transformer Engine not installed, falling back to torch"
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig

# megatron-core's output_processor hook (0.19): where flce's RL outputs plug in without a patch.
HAS_OUTPUT_PROCESSOR = HAS_MEGATRON and "output_processor" in inspect.signature(GPTModel.forward).parameters
VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 8, 2
FORWARD = dict(rtol=1e-5, atol=1e-5)
GRADS = dict(rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- model building (in the ranks)

def build_model(tp: int, *, tied: bool = False, head_only: bool = False, sequence_parallel: bool = False,
                post_process: bool = True, seed: int = 1234) -> torch.nn.Module:
    """A 2-layer GPTModel on the CPU. ``head_only``: identity transformer layers and no final norm
    (what sequence parallelism needs here: torch's LayerNorm refuses it, Apex/TE are GPU-only)."""
    assert head_only or not sequence_parallel
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = IdentityOp
    spec.submodules.self_attention = IdentityOp
    spec.submodules.self_attn_bda = IdentityFuncOp
    if head_only:
        spec.submodules.pre_mlp_layernorm = IdentityOp
        spec.submodules.mlp = IdentityOp
        spec.submodules.mlp_bda = IdentityFuncOp
        spec = TransformerBlockSubmodules(layer_specs=[spec, spec], layer_norm=None)
    torch.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=tied, post_process=post_process)


def batch(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = seed_of(name)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    upstream = torch.rand(BATCH, SEQ, generator=gen, dtype=torch.float32) + 0.25  # a loss mask's role
    return ids, labels, upstream


def step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
         upstream: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A whole forward + backward: the per-token loss and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)
    (loss * upstream).sum().backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def compare(name: str, got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(got[0], want[0], **FORWARD, msg=lambda m: f"{name}: per-token loss: {m}")
    assert got[1].keys() == want[1].keys(), f"{name}: grads for {sorted(got[1])} vs {sorted(want[1])}"
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], **GRADS, msg=lambda m, k=key: f"{name}: grad {k}: {m}")


# --------------------------------------------------------------------------- sections

def section_patched_equals_unpatched(checker: Checker, rank: int, world_size: int) -> None:
    for tp in (1, 2):
        for tied in (False, True):
            name = f"TP={tp} tied={tied}"
            with checker.case(name):
                model = build_model(tp, tied=tied)
                ids, labels, upstream = batch(name)
                want = step(model, ids, labels, upstream)
                flce_megatron.apply(model)
                assert flce_megatron.is_applied(model)
                got = step(model, ids, labels, upstream)
                compare(name, got, want)
                logits = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None)  # no labels: Megatron's path
                assert logits.shape == (BATCH, SEQ, VOCAB // tp), f"logits shape {tuple(logits.shape)}"
                flce_megatron.remove(model)
                again = step(model, ids, labels, upstream)
                assert torch.equal(again[0], want[0]), "remove() did not restore Megatron's head"


def section_sequence_parallel(checker: Checker, rank: int, world_size: int) -> None:
    """The patched sequence-parallel model's post-processing step (the part the adapter replaces),
    fed this rank's sequence shard, equals the unpatched model's without sequence parallelism fed
    the whole sequence. The decoder cannot run here: with sequence parallelism megatron-core forks
    its CUDA RNG tracker around the layers."""
    name = "TP=2 sequence parallel"
    with checker.case(name):
        ids, labels, upstream = batch(name)
        full_hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=seed_of(name + "/hidden"))
        rows = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
        reference = build_model(2, head_only=True)
        want = postprocess_step(reference, full_hidden, ids, labels, upstream)
        want[1]["hidden"] = want[1]["hidden"][rows]
        model = build_model(2, head_only=True, sequence_parallel=True)
        model.load_state_dict(reference.state_dict())
        assert model.output_layer.sequence_parallel, "test setup: the head is not sequence-parallel"
        flce_megatron.apply(model)
        got = postprocess_step(model, full_hidden[rows], ids, labels, upstream)
        compare(name, got, want)


def postprocess_step(model: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                     upstream: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPTModel._postprocess on given hidden states [s(/tp), b, H]: loss, head grads, hidden grad."""
    model.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model._postprocess(hidden_states=hidden, input_ids=ids, position_ids=positions, labels=labels,
                              rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None)
    (loss * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    grads["hidden"] = hidden.grad.clone()
    return loss.detach(), grads


def section_patch_time_errors(checker: Checker, rank: int, world_size: int) -> None:
    model = build_model(2)
    with checker.case("options the adapter owns"):
        _expect_error(lambda: flce_megatron.apply(model, reduction="sum"), ValueError, "reduction")
    with checker.case("invalid option value"):
        _expect_error(lambda: flce_megatron.apply(model, label_smoothing=2.0), ValueError, "label_smoothing")
    with checker.case("multi-token prediction"):
        model.config.mtp_num_layers = 1
        try:
            _expect_error(lambda: flce_megatron.apply(model), NotImplementedError, "mtp_num_layers")
        finally:
            model.config.mtp_num_layers = None
    with checker.case("deferred embedding wgrad"):
        model.config.defer_embedding_wgrad_compute = True
        try:
            _expect_error(lambda: flce_megatron.apply(model), NotImplementedError, "defer_embedding_wgrad_compute")
        finally:
            model.config.defer_embedding_wgrad_compute = False
    with checker.case("not a GPTModel"):
        _expect_error(lambda: flce_megatron.apply(torch.nn.Linear(2, 2)), TypeError, "GPTModel")
    with checker.case("wrapped model"):
        wrapper = torch.nn.Module()
        wrapper.module = model
        assert flce_megatron.apply(wrapper) is wrapper and flce_megatron.is_applied(model)
        flce_megatron.remove(wrapper)
        assert not flce_megatron.is_applied(model)
    with checker.case("pipeline stage without the head"):
        stage = build_model(2, post_process=False)
        assert flce_megatron.apply(stage) is stage and not flce_megatron.is_applied(stage)
    with checker.case("label smoothing uses the global vocabulary"):
        model = build_model(2)
        ids, labels, upstream = batch("smoothing")
        flce_megatron.apply(model, label_smoothing=0.1)
        loss = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels)
        hidden_loss = _smoothed_reference(model, ids, labels)
        torch.testing.assert_close(loss, hidden_loss, **FORWARD)


def _smoothed_reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Megatron's own logit shards, gathered over TP, then torch's cross_entropy with smoothing over all V."""
    flce_megatron.remove(model)
    shard = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None).contiguous()  # [b, s, V/tp]
    group = model.output_layer.tp_group
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, shard, group=group)
    full = torch.cat(parts, dim=-1)
    return torch.nn.functional.cross_entropy(full.reshape(-1, VOCAB).double(), labels.reshape(-1),
                                             reduction="none", label_smoothing=0.1).reshape(BATCH, SEQ).float()


def _megatron_client() -> ModuleType:
    """tools/distributed/megatron_client.py: Megatron's native RL outputs (logits, vocab-parallel CE, entropy)."""
    path = Path(__file__).resolve().parent.parent / "tools" / "distributed" / "megatron_client.py"
    spec = importlib.util.spec_from_file_location("megatron_client", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section_output_processor_rl(checker: Checker, rank: int, world_size: int) -> None:
    """flce's output_processor (RL log-probs + entropy at a temperature) against Megatron's native
    path (the head's logits, -vocab_parallel_cross_entropy(logits / T) and a vocab-parallel entropy)
    and against float64 log-softmax over the gathered logits; gradients of every parameter through both."""
    client = _megatron_client()
    temperature = 0.7
    for tp in (1, 2):
        for tied in (False, True):
            name = f"RL TP={tp} tied={tied}"
            with checker.case(name):
                model = build_model(tp, tied=tied)
                ids, labels, upstream = batch(name)
                got = _rl_outputs(model, ids, labels, upstream, flce_megatron.output_processor(
                    temperature=temperature, return_logprobs=True, return_entropy=True))
                want = _rl_outputs(model, ids, labels, upstream, client.megatron_rl_processor(temperature))
                for key in ("logprobs", "entropy"):
                    torch.testing.assert_close(got[0][key], want[0][key], **FORWARD, msg=lambda m, k=key: f"{k}: {m}")
                exact = _gathered_rl_reference(model, ids, labels, temperature)
                for key in ("logprobs", "entropy"):
                    torch.testing.assert_close(got[0][key].double(), exact[key], **FORWARD,
                                               msg=lambda m, k=key: f"{k} vs float64: {m}")
                assert got[1].keys() == want[1].keys(), f"grads for {sorted(got[1])} vs {sorted(want[1])}"
                for key in want[1]:
                    torch.testing.assert_close(got[1][key], want[1][key], **GRADS, msg=lambda m, k=key: f"{k}: {m}")
    with checker.case("a patched model with an output_processor runs the processor"):
        model = build_model(2)
        ids, labels, upstream = batch("patched+processor")
        flce_megatron.apply(model)
        out = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels,
                    output_processor=flce_megatron.output_processor(return_logprobs=True))
        assert isinstance(out, flce.LCEOutput) and out.logprobs.shape == (BATCH, SEQ), type(out)
    with checker.case("output_processor errors"):
        _expect_error(lambda: flce_megatron.output_processor(reduction="sum"), ValueError, "reduction")
        _expect_error(lambda: flce_megatron.output_processor(temperature=-1.0), ValueError, "temperature")
        model = build_model(2)
        ids, labels, _ = batch("errors")
        process = flce_megatron.output_processor()
        _expect_error(lambda: model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, output_processor=process),
                      ValueError, "labels=None")
        model.config.use_mup = True
        try:
            _expect_error(lambda: model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels,
                                        output_processor=process), NotImplementedError, "use_mup")
            _expect_error(lambda: flce_megatron.apply(model), NotImplementedError, "use_mup")
        finally:
            model.config.use_mup = False


def _rl_outputs(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor,
                processor: Callable[..., Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels, output_processor=processor)
    ((out.logprobs * upstream).sum() + (out.entropy * upstream.flip(0)).sum()).backward()
    return {"logprobs": out.logprobs.detach(), "entropy": out.entropy.detach()}, \
        {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _gathered_rl_reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                           temperature: float) -> dict[str, torch.Tensor]:
    """Megatron's own logit shards gathered over TP; float64 log-softmax at the temperature."""
    with torch.no_grad():
        shard = model(ids, torch.arange(SEQ).expand(BATCH, SEQ), None).contiguous()  # [b, s, V/tp]
    group = model.output_layer.tp_group
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(parts, shard, group=group)
    logprobs = (torch.cat(parts, dim=-1).double() / temperature).log_softmax(-1)
    return {"logprobs": logprobs.gather(-1, labels[..., None])[..., 0],
            "entropy": -(logprobs.exp() * logprobs).sum(-1)}


SECTIONS: dict[str, dict[str, Callable[[Checker, int, int], None]]] = {
    "2": {
        "patched_equals_unpatched": section_patched_equals_unpatched,
        "sequence_parallel": section_sequence_parallel,
        "patch_time_errors": section_patch_time_errors,
        **({"output_processor_rl": section_output_processor_rl} if HAS_OUTPUT_PROCESSOR else {}),
    },
}


# --------------------------------------------------------------------------- pytest entry points

@pytest.fixture(scope="module")
def megatron_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(2, tmp_path_factory.mktemp("megatron"), sections_module=__name__,
                     preload=("megatron.core.models.gpt",))


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed (pip install -e '.[megatron]')")
@pytest.mark.parametrize("section", [s for s in SECTIONS["2"] if s != "output_processor_rl"])
def test_megatron_adapter(megatron_reports: list[dict[str, dict]], section: str) -> None:
    assert_section(megatron_reports, section)


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed (pip install -e '.[megatron]')")
def test_megatron_output_processor_present(megatron_reports: list[dict[str, dict]]) -> None:
    if not HAS_OUTPUT_PROCESSOR:
        pytest.skip("this megatron-core has no output_processor hook (added in 0.19)")
    assert_section(megatron_reports, "output_processor_rl")


def test_missing_megatron_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core.models.gpt", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[megatron\]'"):
        flce_megatron.apply(torch.nn.Linear(2, 2))
