"""LM-head weights as training frameworks hold them: DTensors (tensor parallelism, FSDP2) and
partitioned parameters (DeepSpeed ZeRO-3, FSDP1).

One spawn of 2 gloo ranks runs every distributed section (spawning is what costs on a 2-core
machine); each pytest test asserts one section of what the ranks reported:

* ``tensor_parallel``: a ``Shard(0)`` DTensor weight (and bias) over a 1-D mesh, even and uneven
  vocabulary, hidden plain / replicated / sequence-sharded: loss and gradients equal the unsharded
  op, and the gradients come back as DTensors in the inputs' placements; a replicated weight.
* ``fsdp2_outside_forward``: ``model.lm_head.weight`` of a ``fully_shard`` head, used outside the
  head's forward (flce receives the sharded DTensor): gradients equal those FSDP2 stores when the
  head runs its own forward with PyTorch's cross-entropy.
* ``fsdp2_inside_forward``: a Hugging Face Llama patched by ``flce.integrations.transformers`` under
  ``fully_shard`` (the loss inside the model's forward): equal to the unpatched model under FSDP2.
* ``real_client``: tools/distributed/dtensor_client.py, torchtitan's TP and FSDP2 parallelisation, a few SGD
  steps with flce vs PyTorch's (``loss_parallel``) cross-entropy.
* ``compile``: ``torch.compile`` over steps whose head weight is a DTensor (graph counts).
* ``errors``: what flce refuses, and the words of the errors.

DeepSpeed is not installed here and FSDP1 refuses a CPU-only machine: their parameters are stood in
for by tensors carrying the attributes those frameworks set.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from test_distributed import Checker, _expect_error, assert_section, run_ranks, seed_of

import flce

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
TOOLS = Path(__file__).resolve().parent.parent / "tools"
FORWARD = dict(rtol=1e-5, atol=1e-6)
GRADS = dict(rtol=1e-4, atol=1e-5)


def _client() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dtensor_client", TOOLS / "distributed" / "dtensor_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


def _mesh(name: str = "tp"):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))


def _inputs(name: str, vocab: int, tokens: tuple[int, ...] = (4, 6), hidden_size: int = 16):
    gen = seed_of(name)
    hidden = torch.randn(*tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    bias = torch.randn(vocab, generator=gen)
    target = torch.randint(0, vocab, tokens, generator=gen)
    target[0, 0] = -100
    return hidden, weight, bias, target


def _reference(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
               **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Materialised logits and torch's cross-entropy: the loss and the grads of (hidden, weight, bias)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if bias is not None else 0)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten(), **options)
    loss.sum().backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


# --------------------------------------------------------------------------- sections

def section_tensor_parallel(checker: Checker, rank: int, world_size: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = _mesh()
    for vocab in (32, 21):  # 21: torch.chunk's uneven shards, 11 and 10 rows
        for hidden_kind in ("plain", "replicate", "sequence-sharded"):
            for with_bias in (False, True):
                name = f"V={vocab} hidden={hidden_kind} bias={with_bias}"
                with checker.case(name):
                    hidden, weight, bias, target = _inputs(name, vocab)
                    want, want_grads = _reference(hidden, weight, bias if with_bias else None, target)
                    w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
                    b = torch.nn.Parameter(distribute_tensor(bias, mesh, [Shard(0)])) if with_bias else None
                    if hidden_kind == "plain":
                        h = hidden.clone().requires_grad_()
                    else:
                        # Shard(1): the sequence dimension of [batch, seq, H], as torchtitan shards it.
                        placement = Replicate() if hidden_kind == "replicate" else Shard(1)
                        h = distribute_tensor(hidden, mesh, [placement]).requires_grad_()
                    loss = flce.linear_cross_entropy(h, w, target, b)
                    loss.backward()
                    assert not isinstance(loss, DTensor), "loss: expected a plain tensor, equal on every rank"
                    torch.testing.assert_close(loss, want, **FORWARD)
                    for label, param, reference in (("weight", w, want_grads[1]), ("bias", b, want_grads[-1])):
                        if param is None:
                            continue
                        assert isinstance(param.grad, DTensor), f"{label}.grad: {type(param.grad).__name__}"
                        assert param.grad.placements == (Shard(0),), f"{label}.grad placements {param.grad.placements}"
                        torch.testing.assert_close(param.grad.full_tensor(), reference, **GRADS)
                    grad_hidden = h.grad.full_tensor() if isinstance(h.grad, DTensor) else h.grad
                    if isinstance(h, DTensor):
                        assert h.grad.placements == h.placements, f"hidden.grad placements {h.grad.placements}"
                    torch.testing.assert_close(grad_hidden, want_grads[0], **GRADS)
    with checker.case("replicated weight, full options, reduction='none'"):
        hidden, weight, bias, target = _inputs("replicated", 24)
        options = dict(label_smoothing=0.1, reduction="none")
        want, want_grads = _reference(hidden, weight, bias, target, **options)
        w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        b = torch.nn.Parameter(distribute_tensor(bias, mesh, [Replicate()]))
        h = hidden.clone().requires_grad_()
        loss = flce.get_impl("cpu")(**options)(h, w, target, b)
        loss.sum().backward()
        torch.testing.assert_close(loss.flatten(), want, **FORWARD)
        assert w.grad.placements == (Replicate(),), f"weight.grad placements {w.grad.placements}"
        torch.testing.assert_close(w.grad.to_local(), want_grads[1], **GRADS)
        torch.testing.assert_close(h.grad, want_grads[0], **GRADS)


def section_fsdp2_outside_forward(checker: Checker, rank: int, world_size: int) -> None:
    """Pattern (b): the head is its own fully_shard unit and flce gets its sharded weight."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh("dp")
    for vocab, with_bias in ((32, False), (21, True)):
        name = f"V={vocab} bias={with_bias}"
        with checker.case(name):
            hidden, weight, bias, target = _inputs(f"fsdp2/{name}/rank{rank}", vocab)  # each rank its own tokens
            heads = []
            for _ in range(2):
                head = torch.nn.Linear(hidden.shape[-1], vocab, bias=with_bias)
                with torch.no_grad():
                    head.weight.copy_(_inputs(f"fsdp2/{name}", vocab)[1])
                    if with_bias:
                        head.bias.copy_(_inputs(f"fsdp2/{name}", vocab)[2])
                fully_shard(head, mesh=mesh)
                heads.append(head)
            torch_head, flce_head = heads
            assert isinstance(flce_head.weight, DTensor), "test setup: the weight is not sharded"
            want = torch.nn.functional.cross_entropy(torch_head(hidden).flatten(0, -2), target.flatten())
            want.backward()
            loss = flce.linear_cross_entropy(hidden, flce_head.weight, target, flce_head.bias)
            loss.backward()
            torch.testing.assert_close(loss, want.detach(), **FORWARD)
            for label in ("weight", "bias") if with_bias else ("weight",):
                got, expected = getattr(flce_head, label).grad, getattr(torch_head, label).grad
                assert isinstance(got, DTensor) and got.placements == (Shard(0),), f"{label}.grad: {got!r:.80}"
                torch.testing.assert_close(got.full_tensor(), expected.full_tensor(), **GRADS)
            # The same call again: the answer about the weight is cached, the result must not change.
            again = flce.linear_cross_entropy(hidden, flce_head.weight, target, flce_head.bias)
            torch.testing.assert_close(again, loss.detach(), rtol=0, atol=0)


def section_fsdp2_inside_forward(checker: Checker, rank: int, world_size: int) -> None:
    """Pattern (a): the loss inside the model's forward, where FSDP2 has gathered the head."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    from flce.integrations import transformers as flce_hf

    mesh = _mesh("dp")
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    gen = seed_of(f"hf/rank{rank}")
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    runs = {}
    for patched in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        if patched:
            flce_hf.apply(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs[patched] = (loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
    with checker.case("HF Llama under fully_shard, patched vs unpatched"):
        torch.testing.assert_close(runs[True][0], runs[False][0], **FORWARD)
        assert runs[True][1].keys() == runs[False][1].keys()
        for key, want in runs[False][1].items():
            torch.testing.assert_close(runs[True][1][key], want, **GRADS, msg=lambda m, k=key: f"{k}: {m}")


def _fsdp2_tp_head(mesh, weight: torch.Tensor, bias: torch.Tensor | None, policy=None) -> torch.nn.Linear:
    """torchtitan's order on a (dp, tp) mesh: the head ColwiseParallel over tp, then fully_shard over dp."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    parallelize_module(head, mesh["tp"], ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    fully_shard(head, mesh=mesh["dp"], mp_policy=policy or MixedPrecisionPolicy())
    return head


def section_fsdp2_tp(checker: Checker, rank: int, world_size: int) -> None:
    """FSDP2 over a tensor-parallel head on a 2 x 2 (dp, tp) mesh, the weight used outside the head's
    forward: gradients equal the mean over the data-parallel ranks of each one's materialised loss
    gradient (FSDP2's reduction), for plain and sequence-sharded hidden states, with and without a
    bias, even and uneven vocabularies; with a bf16 / fp32-reduce mixed-precision policy, equal to
    FSDP2's own forward of the head under loss_parallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    for vocab, with_bias in ((32, False), (21, True)):
        per_dp = [_inputs(f"fsdp2_tp/V={vocab}/dp{d}", vocab) for d in range(2)]
        weight, bias = per_dp[0][1], per_dp[0][2] if with_bias else None
        grads = [_reference(h, weight, bias, t)[1] for h, _, _, t in per_dp]
        want = [(a + b) / 2 for a, b in zip(grads[0][1:], grads[1][1:], strict=True)]
        hidden, target = per_dp[dp][0], per_dp[dp][3]
        for hidden_kind in ("plain", "sequence-sharded"):
            with checker.case(f"V={vocab} bias={with_bias} hidden={hidden_kind}"):
                head = _fsdp2_tp_head(mesh, weight, bias)
                assert head.weight.device_mesh.ndim == 2, f"test setup: {head.weight.placements}"
                h = hidden.clone() if hidden_kind == "plain" else distribute_tensor(hidden, mesh["tp"], [Shard(1)])
                h.requires_grad_()
                loss = flce.linear_cross_entropy(h, head.weight, target, head.bias)
                loss.backward()
                torch.testing.assert_close(loss, _reference(hidden, weight, bias, target)[0], **FORWARD)
                params = [head.weight] + ([head.bias] if with_bias else [])
                for param, expected in zip(params, want, strict=False):
                    assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, \
                        f"grad placements {getattr(param.grad, 'placements', None)} vs {param.placements}"
                    torch.testing.assert_close(param.grad.full_tensor(), expected, **GRADS)
                grad_hidden = h.grad.full_tensor() if isinstance(h.grad, DTensor) else h.grad
                torch.testing.assert_close(grad_hidden, _reference(hidden, weight, bias, target)[1][0], **GRADS)
    with checker.case("mixed precision: bf16 parameters, fp32 reduction, as FSDP2's own forward"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        hidden, weight, _, target = _inputs(f"fsdp2_tp/mixed/dp{dp}", 32)
        weight = _inputs("fsdp2_tp/mixed/dp0", 32)[1]
        runs = {}
        for kind in ("torch", "flce"):
            head = _fsdp2_tp_head(mesh, weight, None, policy)
            h = hidden.to(torch.bfloat16)
            if kind == "torch":
                with loss_parallel():
                    loss = torch.nn.functional.cross_entropy(head(h).float().flatten(0, -2), target.flatten())
                    loss.backward()
            else:
                loss = flce.linear_cross_entropy(h, head.weight, target)
                loss.backward()
            runs[kind] = (float(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()),
                          head.weight.grad)
        assert runs["flce"][1].dtype == torch.float32, f"grad dtype {runs['flce'][1].dtype}: expected the fp32 master's"
        torch.testing.assert_close(runs["flce"][0], runs["torch"][0], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(runs["flce"][1].full_tensor(), runs["torch"][1].full_tensor(), rtol=2e-2, atol=2e-3)
    with checker.case("a plain bias beside an FSDP2 x TP weight"):
        head = _fsdp2_tp_head(mesh, _inputs("fsdp2_tp/bias", 32)[1], None)
        hidden, _, bias, target = _inputs("fsdp2_tp/bias", 32)
        _expect_error(lambda: flce.linear_cross_entropy(hidden, head.weight, target, bias), ValueError,
                      "bias: not an FSDP2 parameter")
    with checker.case("the torchtitan-style client, fsdp_tp mode"):
        client = _client()
        args = client.ModelArgs(vocab=96, dim=32, layers=2, heads=4, ffn=64, seq=16, batch=2)
        (result,) = client.run(args, steps=2, device=torch.device("cpu"), modes=("fsdp_tp",))
        assert result["max_loss_diff"] < 1e-5 and result["max_grad_rel_error"] < 1e-5, result
        assert result["max_param_rel_error"] < 1e-5, result


def section_real_client(checker: Checker, rank: int, world_size: int) -> None:
    from torch.distributed.tensor import Shard

    client = _client()
    args = client.ModelArgs(vocab=96, dim=32, layers=2, heads=4, ffn=64, seq=16, batch=2)
    for result in client.run(args, steps=2, device=torch.device("cpu")):
        with checker.case(f"{result['mode']}: flce vs torch's cross-entropy"):
            assert result["max_loss_diff"] < 1e-5, result
            assert result["max_grad_rel_error"] < 1e-5, result
            assert result["max_param_rel_error"] < 1e-5, result
            assert result["output_grad_flce"] == ["DTensor", [repr(Shard(0))]], result["output_grad_flce"]
            assert result["output_grad_torch"] == result["output_grad_flce"], result["output_grad_torch"]


def section_compile(checker: Checker, rank: int, world_size: int) -> None:
    """A compiled step over a replicated or a vocab-sharded DTensor weight is one graph with flce's
    custom ops (the sharded one carries the mesh's group into them by name), and gives the eager
    result."""
    import torch._dynamo
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()
    hidden, weight, _, target = _inputs("compile", 32)
    loss_fn = flce.get_impl("cpu")()

    def step(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(h, w, t) * 2.0

    for placement in (Replicate(), Shard(0)):
        with checker.case(f"weight {placement!r}"):
            torch._dynamo.reset()
            w = torch.nn.Parameter(distribute_tensor(weight, mesh, [placement]))
            eager = step(hidden, w, target)
            explained = torch._dynamo.explain(step)(hidden, w, target)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
            ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
            assert "flce.chunked_forward" in ops, f"flce's custom op is not in the graph: {sorted(ops)}"
            compiled = torch.compile(step, backend="eager", fullgraph=True)(hidden, w, target)
            torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
            logits = (hidden @ weight.t()).flatten(0, -2)
            torch.testing.assert_close(eager, 2.0 * torch.nn.functional.cross_entropy(logits, target.flatten()),
                                       rtol=1e-5, atol=1e-5)


def section_errors(checker: Checker, rank: int, world_size: int) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()
    hidden, weight, bias, target = _inputs("errors", 32)
    sharded = distribute_tensor(weight, mesh, [Shard(0)])
    call = flce.linear_cross_entropy
    with checker.case("process_group and a DTensor weight"):
        _expect_error(lambda: call(hidden, sharded, target, process_group=dist.group.WORLD), ValueError,
                      "pass process_group=None")
    with checker.case("weight sharded on H"):
        _expect_error(lambda: call(hidden, distribute_tensor(weight, mesh, [Shard(1)]), target), ValueError,
                      "expected Shard(0)")
    with checker.case("DTensor hidden, plain weight"):
        _expect_error(lambda: call(distribute_tensor(hidden, mesh, [Replicate()]), weight, target), TypeError,
                      "weight is a plain tensor")
    with checker.case("hidden sharded on H"):
        _expect_error(lambda: call(distribute_tensor(hidden, mesh, [Shard(2)]), sharded, target), ValueError,
                      "token dimension")
    with checker.case("plain bias with a DTensor weight"):
        _expect_error(lambda: call(hidden, sharded, target, bias), ValueError, "bias: a plain tensor")
    with checker.case("a vocabulary smaller than the mesh leaves a rank empty"):
        _expect_error(lambda: call(hidden, distribute_tensor(weight[:1], mesh, [Shard(0)]), target.clamp(max=0)),
                      ValueError, "empty vocabulary shard")


SECTIONS: dict[str, dict[str, Callable[[Checker, int, int], None]]] = {
    "2": {
        "tensor_parallel": section_tensor_parallel,
        "fsdp2_outside_forward": section_fsdp2_outside_forward,
        "fsdp2_inside_forward": section_fsdp2_inside_forward,
        "real_client": section_real_client,
        "compile": section_compile,
        "errors": section_errors,
    },
    "4": {
        "fsdp2_tp": section_fsdp2_tp,
    },
}
PRELOAD = ("flce.backends.reference", "torch.distributed.tensor", "torch.distributed.fsdp") + (
    ("transformers.models.llama.modeling_llama",) if HAS_TRANSFORMERS else ())


# --------------------------------------------------------------------------- pytest entry points

@pytest.fixture(scope="module")
def dtensor_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_ranks(2, tmp_path_factory.mktemp("dtensor"), sections_module=__name__, preload=PRELOAD)


@pytest.mark.distributed
@pytest.mark.parametrize("section", [s for s in SECTIONS["2"] if s != "fsdp2_inside_forward"])
def test_dtensor_weights(dtensor_reports: list[dict[str, dict]], section: str) -> None:
    assert_section(dtensor_reports, section)


@pytest.mark.distributed
def test_fsdp2_over_tensor_parallel_2x2_mesh(tmp_path: Path) -> None:
    assert_section(run_ranks(4, tmp_path, sections_module=__name__, preload=PRELOAD), "fsdp2_tp")


@pytest.mark.distributed
@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e '.[hf]')")
def test_fsdp2_loss_inside_hf_forward(dtensor_reports: list[dict[str, dict]]) -> None:
    assert_section(dtensor_reports, "fsdp2_inside_forward")


class _ZeroParamStatus(enum.Enum):
    """DeepSpeed's ZeroParamStatus names."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2


def _zero3_param(shape: tuple[int, ...], gathered: bool) -> torch.nn.Parameter:
    """A stand-in with the attributes DeepSpeed ZeRO-3 puts on a partitioned parameter."""
    param = torch.nn.Parameter(torch.randn(shape) if gathered else torch.empty(0))
    param.ds_id = 7
    param.ds_shape = torch.Size(shape)
    param.ds_numel = torch.Size(shape).numel()
    param.ds_status = _ZeroParamStatus.AVAILABLE if gathered else _ZeroParamStatus.NOT_AVAILABLE
    return param


def test_zero3_partitioned_weight_is_refused_before_compute() -> None:
    hidden, _, _, target = _inputs("zero3", 32)
    with pytest.raises(ValueError, match=r"weight: a DeepSpeed ZeRO-3 .*ds_status=NOT_AVAILABLE.*register_external"):
        flce.linear_cross_entropy(hidden, _zero3_param((32, 16), gathered=False), target)
    bias = _zero3_param((32,), gathered=False)
    with pytest.raises(ValueError, match=r"bias: a DeepSpeed ZeRO-3"):
        flce.linear_cross_entropy(hidden, torch.randn(32, 16), target, bias)
    # Gathered (inside the owner's forward): an ordinary weight.
    weight = _zero3_param((32, 16), gathered=True)
    loss = flce.linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(loss, _reference(hidden, weight, None, target)[0], **FORWARD)


def test_fsdp1_markers_are_refused_before_compute() -> None:
    hidden, weight, _, target = _inputs("fsdp1-markers", 32)
    flat = torch.nn.Parameter(weight.flatten())
    flat._is_flat_param = True
    with pytest.raises(ValueError, match="weight: an FSDP1 FlatParameter"):
        flce.linear_cross_entropy(hidden, flat, target)
    sharded_view = torch.nn.Parameter(weight.flatten()[:100])
    sharded_view._fsdp_flattened = True
    with pytest.raises(ValueError, match="weight: a parameter managed by FSDP1"):
        flce.linear_cross_entropy(hidden, sharded_view, target)
    gathered = torch.nn.Parameter(weight.clone())
    gathered._fsdp_flattened = True  # inside the forward: the original shape, usable
    flce.linear_cross_entropy(hidden, gathered, target).backward()
    assert gathered.grad is not None and gathered.grad.shape == weight.shape
