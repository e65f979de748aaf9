"""Shared test helpers: docs/design.md's tolerances, upstream gradients, the float64 oracle
(flce.testing.reference_loss, re-exported here), and tools/ scripts loaded as modules.

Import them from other test files as ``from helpers import reference_loss``: tests/ has no
``__init__.py``, so pytest puts it on ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from flce import LCEOutput
from flce.testing import reference_loss
from flce.testing.measure import relative_difference as relative_error  # the tests import it from here

# docs/design.md, "Correctness tolerances": (rtol, atol) per case.
DESIGN_TOLERANCES: dict[str, tuple[float, float]] = {
    "forward_float32": (1e-5, 1e-5),
    "forward_bfloat16": (2e-2, 2e-2),
    "forward_float16": (1e-2, 1e-2),
    # float64 inputs compute the logits and softmax in float64, but the per-call scalars of
    # flce.semantics (mean denominators, class-weight sums) are float32.
    "forward_float64": (1e-7, 1e-7),
    "temperature_float32": (1e-5, 1e-5),
    "grad_hidden_float32": (1e-4, 1e-4),
    "grad_weight_float32": (1e-4, 1e-4),
    "grad_weight_large_float32": (1e-4, 5e-4),
    "grad_float64": (1e-7, 1e-7),
}

def tolerance(kind: str, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) from docs/design.md for ``kind`` in {"forward", "temperature", "grad_hidden",
    "grad_weight", "grad_weight_large"} at ``dtype``; low-precision gradients are compared
    by relative norm instead (see :func:`relative_error`)."""
    name = dtype_name(dtype)
    if name == "float64":
        return DESIGN_TOLERANCES["forward_float64" if kind in ("forward", "temperature") else "grad_float64"]
    key = f"{kind}_{name}"
    if key not in DESIGN_TOLERANCES:
        if kind.startswith("grad") and name in ("bfloat16", "float16"):
            raise ValueError(f"{kind} at {name}: docs/design.md compares these by relative norm, use relative_error")
        if kind == "temperature":
            return DESIGN_TOLERANCES[f"forward_{name}"]
        raise ValueError(f"no docs/design.md tolerance for kind={kind!r} dtype={name}")
    return DESIGN_TOLERANCES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_close_per_design(
    actual: torch.Tensor | None, expected: torch.Tensor | None, *, kind: str, dtype: torch.dtype, name: str
) -> None:
    """Compare ``actual`` (any dtype) to the float64 ``expected`` with docs/design.md's tolerance for
    (kind, dtype); the failure message names the output and the tolerance used."""
    assert actual is not None, f"{name}: got None, expected a tensor"
    assert expected is not None, f"{name}: the oracle produced None"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    rtol, atol = tolerance(kind, dtype)
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=atol,
        msg=lambda m: f"{name} ({kind}, {dtype_name(dtype)}, rtol={rtol}, atol={atol}): {m}",
    )


@dataclass
class Upstream:
    """Gradients flowing into the differentiable outputs (None: that output is not used)."""

    loss: torch.Tensor | None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def random_upstream(output_shape: torch.Size, token_shape: torch.Size, *, logprobs: bool, entropy: bool,
                    generator: torch.Generator) -> Upstream:
    """Random (never constant) upstream gradients, in float64."""
    def draw(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64) + 0.5

    return Upstream(
        loss=draw(output_shape),
        logprobs=draw(token_shape) if logprobs else None,
        entropy=draw(token_shape) if entropy else None,
    )


def backward_surrogate(outputs: torch.Tensor | LCEOutput, upstream: Upstream) -> torch.Tensor:
    """sum(output * upstream) over the differentiable outputs: its backward feeds exactly
    ``upstream`` into each one."""
    if isinstance(outputs, torch.Tensor):
        outputs = LCEOutput(loss=outputs)
    device = outputs.loss.device
    total = (outputs.loss.double() * upstream.loss.to(device)).sum()
    if upstream.logprobs is not None:
        total = total + (outputs.logprobs.double() * upstream.logprobs.to(device)).sum()
    if upstream.entropy is not None:
        total = total + (outputs.entropy.double() * upstream.entropy.to(device)).sum()
    return total


@dataclass
class Grads:
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def reference_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    upstream: Upstream,
    **options: Any,
) -> tuple[LCEOutput, Grads]:
    """The oracle's outputs and its float64 gradients for the given upstream gradients."""
    leaves = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_(),
              None if bias is None else bias.detach().double().requires_grad_()]
    out = reference_loss(leaves[0], leaves[1], target, leaves[2], **options)
    inputs = [t for t in leaves if t is not None]
    surrogate = backward_surrogate(out, upstream)
    grads = [None] * len(inputs)
    if surrogate.requires_grad:
        grads = list(torch.autograd.grad(surrogate, inputs, allow_unused=True))
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True)]
    return out, Grads(grads[0], grads[1], grads[2] if bias is not None else None)


def flce_grads(
    fn: Any,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    upstream: Upstream,
) -> tuple[torch.Tensor | LCEOutput, Grads]:
    """Run ``fn(hidden, weight, target, bias)`` (a flce module or functional form) on fresh
    leaves and backpropagate ``upstream``; returns the outputs and the leaves' gradients."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    out = fn(h, w, target, b)
    backward_surrogate(out, upstream).backward()
    return out, Grads(h.grad, w.grad, None if b is None else b.grad)


def make_inputs(
    token_shape: tuple[int, ...],
    hidden_size: int,
    vocab: int,
    *,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    ignore_fraction: float = 0.2,
    ignore_index: int = -100,
    generator: torch.Generator,
    logit_scale: float = 2.0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random hidden [*token_shape, H], weight [V, H], target and optional bias [V].

    Logits have a standard deviation near ``logit_scale`` (so softmax is neither flat nor
    one-hot); about ``ignore_fraction`` of the targets equal ``ignore_index``.
    """
    n = 1
    for s in token_shape:
        n *= s
    hidden = torch.randn(*token_shape, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    weight *= logit_scale / max(hidden_size, 1) ** 0.5
    target = torch.randint(0, vocab, (n,), generator=generator)
    ignored = torch.rand(n, generator=generator) < ignore_fraction
    target = torch.where(ignored, ignore_index, target).reshape(token_shape)
    b = torch.randn(vocab, generator=generator, dtype=torch.float64) * 0.5 if bias else None

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return place(hidden), place(weight), target.to(device), None if b is None else place(b)


def leaf_inputs(generator: torch.Generator, shape: tuple[int, ...], hidden_size: int, vocab: int,
                dtype: torch.dtype, bias: bool = False, target_key: str = "target") -> dict[str, Any]:
    """make_inputs (logits of std ~2, no ignored targets) as the keywords of a call, the target under
    ``target_key`` (the trainers call it "targets"), hidden / weight / bias as leaves requiring grad."""
    hidden, weight, target, b = make_inputs(shape, hidden_size, vocab, dtype=dtype, bias=bias, ignore_fraction=0.0,
                                            generator=generator)
    return {
        "hidden": hidden.requires_grad_(),
        "weight": weight.requires_grad_(),
        "bias": None if b is None else b.requires_grad_(),
        target_key: target,
    }


def random_class_weight(vocab: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Positive class weights in [0.25, 2), never all equal."""
    return (torch.rand(vocab, generator=generator, dtype=torch.float64) * 1.75 + 0.25).to(dtype)


# Option sets every backend's contract test runs (each with every reduction): each full-feature
# option alone, class weights with and without smoothing, the metrics, and everything at once.
# "random" class weights are drawn by the test for its vocabulary size.
OPTION_CASES = [
    {},
    {"label_smoothing": 0.1},
    {"lse_square_scale": 1e-3, "return_z_loss": True},
    {"softcap": 2.5},
    {"temperature": 0.7, "return_logprobs": True, "return_entropy": True},
    {"token_scaling": True},
    {"entropy_weight": 0.05, "temperature": 0.7},
    {"class_weight": "random", "label_smoothing": 0.05},
    {"class_weight": "random"},
    {"return_token_accuracy": True, "return_predicted_tokens": True},
    {"softcap": 3.0, "temperature": 1.3, "label_smoothing": 0.2, "lse_square_scale": 1e-2, "token_scaling": True,
     "class_weight": "random", "return_logprobs": True, "return_entropy": True, "return_z_loss": True,
     "return_token_accuracy": True, "return_predicted_tokens": True},
]


def assert_same_argmax(got: torch.Tensor, want: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, options: dict, tol: float = 1e-5,
                       logits_dtype: torch.dtype = torch.float32) -> None:
    """Predicted tokens (any shape; hidden [..., H] to match) equal the oracle's, except on rows
    whose two candidates are closer than the kernel can order them: within ``tol`` (relative) in
    float64 after capping and temperature, as a float32 kernel rounds them (soft-capping at a
    small cap squashes the top logits together); or, for logits rounded to ``logits_dtype``
    (bf16/fp16 inputs), within that dtype's eps of the larger one before capping, since each
    rounding moves a logit by up to half an eps relative and can swap two such candidates."""
    got, want = got.reshape(-1), want.reshape(-1)
    rows = (got != want).nonzero().flatten()
    if rows.numel() == 0:
        return
    assert bool((got[rows] >= 0).all() and (want[rows] >= 0).all()), "ignored rows must predict -1"
    u = hidden.detach().double().reshape(-1, weight.shape[1])[rows] @ weight.detach().double().t()
    if bias is not None:
        u = u + bias.detach().double()
    softcap, temperature = options.get("softcap"), options.get("temperature", 1.0)
    z = (softcap * torch.tanh(u / softcap) if softcap else u) / temperature
    picked, best = z.gather(1, got[rows, None]), z.gather(1, want[rows, None])
    u_picked, u_best = u.gather(1, got[rows, None]), u.gather(1, want[rows, None])
    z_tie = (best - picked) <= tol * best.abs().clamp_min(1.0)
    rounding_tie = (u_best - u_picked).abs() <= torch.finfo(logits_dtype).eps * torch.maximum(u_best.abs(),
                                                                                            u_picked.abs())
    assert bool((z_tie | rounding_tie).all()), (
        f"rows {rows.tolist()}: predicted {got[rows].tolist()} but float64 argmax {want[rows].tolist()} "
        f"is larger by {(best - picked).flatten().tolist()}")


def lm_head_inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str | torch.device, with_bias: bool,
                   ignore_some: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Fresh (hidden [n, h], weight [v, h], bias [v] or None, target [n]) leaves from the global RNG,
    with about a fifth of the targets ignored (-100) unless ignore_some is False."""
    x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(v, h, device=device) / h**0.25).to(dtype).requires_grad_()
    b = torch.randn(v, device=device, dtype=dtype, requires_grad=True) if with_bias else None
    t = torch.randint(0, v, (n,), device=device)
    if ignore_some:
        t[torch.rand(n, device=device) < 0.2] = -100
    return x, w, b, t


def materialise_options(options: dict, v: int, device: str | torch.device) -> dict:
    """OPTION_CASES entries with "random" class weights drawn for this vocabulary."""
    options = dict(options)
    if options.get("class_weight") == "random":
        options["class_weight"] = torch.rand(v, device=device) + 0.5
    return options


# The large-logits entropy checks (test_precision, test_ascend_contract): at temperature 0.25 the logits of
# large_logits_inputs reach |z| ~ 400-500 and the softmax is peaked (entropies 0-0.7).
TEMPERATURE = 0.25


def large_logits_inputs(generator: torch.Generator, n: int = 384, h: int = 16, v: int = 300, scale: float = 6.0,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden ~ N(0, scale^2), weight ~ N(0, 1), target with every 7th ignored), CPU leaves, for the
    precision tests. The defaults are the entropy check's: enough rows that the relative errors are
    stable (at 48 rows one draw's eager error alone varied 7x)."""
    x = (torch.randn(n, h, generator=generator) * scale).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=generator).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=generator)
    t[::7] = -100
    return x, w, t


def entropy_errors(loss_fn, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
                   temperature: float) -> dict[str, tuple[float, float]]:
    """(loss_fn's, eager's) relative errors against float64 of the entropy and the gradients of
    sum(entropy * upstream); loss_fn(x, w, t) returns an LCEOutput with the per-token entropy at
    ``temperature``; eager is the materialised torch computation in the inputs' dtype with an fp32
    softmax."""
    upstream = torch.rand(t.shape[0], device=x.device, dtype=torch.float64) + 0.5
    out = loss_fn(x, w, t)
    got = (out.entropy.double(), *torch.autograd.grad((out.entropy * upstream.to(out.entropy.dtype)).sum(), (x, w)))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want_entropy = reference_loss(xd, wd, t, reduction="none", return_entropy=True, temperature=temperature).entropy
    want = (want_entropy.detach(), *torch.autograd.grad((want_entropy * upstream).sum(), (xd, wd)))
    xe, we = x.detach().requires_grad_(), w.detach().requires_grad_()
    log_p = torch.log_softmax((xe @ we.t()).float() / temperature, 1)
    eager_entropy = torch.where(t != -100, -(log_p.exp() * log_p).sum(1), 0.0)
    eager = (eager_entropy.detach(), *torch.autograd.grad((eager_entropy * upstream.float()).sum(), (xe, we)))
    return {name: (relative_error(g.detach(), r), relative_error(e.detach(), r))
            for name, g, e, r in zip(("entropy", "grad hidden", "grad weight"), got, eager, want, strict=True)}


def assert_entropy_near_eager(errors: dict[str, tuple[float, float]], gradient_factor: float = 2.5) -> None:
    """The entropy within 1.5x and the gradients within ``gradient_factor`` x of eager's error (entropy_errors)."""
    for name, (err, eager_err) in errors.items():
        assert err <= (1.5 if name == "entropy" else gradient_factor) * eager_err + 1e-7, (name, errors)


def load_tool(relative_path: str) -> ModuleType:
    """A script under tools/ (no package) loaded as a module, for tests of its arithmetic on the CPU."""
    path = Path(__file__).resolve().parents[1] / relative_path
    spec = importlib.util.spec_from_file_location("flce_tools_" + path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- what ran on a GPU

KERNEL_MODULES = ("kernels", "gemm_kernels", "exp_grad_kernels", "ws_gemm_kernels", "target_kernels", "distill_kernels")
TORCH_GEMMS = {"torch.mm", "torch.addmm", "torch.Tensor.addmm_", "torch.matmul"}
CUBLAS_NAME = re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.IGNORECASE)


# The torch functions of TORCH_GEMMS' names, as count_launches wraps them.
_GEMM_FUNCTIONS = {"torch.mm": (torch, "mm"), "torch.addmm": (torch, "addmm"),
                   "torch.Tensor.addmm_": (torch.Tensor, "addmm_"), "torch.matmul": (torch.Tensor, "__matmul__")}


class _CountedKernel:
    """A Triton kernel whose launches (``kernel[grid](...)``) are noted by name."""

    def __init__(self, kernel: Any, name: str, sink: set[str]) -> None:
        self.kernel, self.name, self.sink, self.fn = kernel, name, sink, kernel.fn

    def __getitem__(self, grid: Any) -> Any:
        self.sink.add(self.name)
        return self.kernel[grid]


def _counted_function(function: Callable, name: str, sink: set[str]) -> Callable:
    def counted(*args, **kwargs):
        sink.add(name)
        return function(*args, **kwargs)

    return counted


def count_launches(monkeypatch: Any, kernel_modules: tuple[str, ...], gemms: set[str] = TORCH_GEMMS) -> set[str]:
    """The names (as a call's record gives them) of the Triton kernels of ``flce.backends.cuda.<kernel_modules>``
    and of the torch GEMMs ``gemms`` that run from here on: a set filled as they launch, until ``monkeypatch``
    undoes the wrapping. Where there is no GPU, the kernels run under the interpreter."""
    ran: set[str] = set()
    for module_name in kernel_modules:
        module = importlib.import_module(f"flce.backends.cuda.{module_name}")
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel") and hasattr(value, "fn"):
                monkeypatch.setattr(module, attr, _CountedKernel(value, f"{module.__name__}.{attr}", ran))
    for label in gemms:
        owner, attr = _GEMM_FUNCTIONS[label]
        monkeypatch.setattr(owner, attr, _counted_function(getattr(owner, attr), label, ran))
    return ran


def flce_kernel_names() -> set[str]:
    """Every kernel function of the CUDA backend (Triton and Gluon), by name."""
    names = set()
    for module in KERNEL_MODULES:
        mod = importlib.import_module(f"flce.backends.cuda.{module}")
        names |= {name for name, value in vars(mod).items() if name.endswith("_kernel") and hasattr(value, "fn")}
    return names


def launches_against_record(names: list[str], record: Any) -> tuple[set[str], set[str], bool]:
    """From the CUDA kernels a step launched (:func:`launched`) and that call's record: the backend's kernels that
    ran, the backend's kernels the record names, and whether a kernel that is not the backend's (cuBLAS) ran."""
    flce_names = flce_kernel_names()

    def flce_kernels_in(launched_name: str) -> set[str]:
        return {k for k in flce_names if re.match(rf"{re.escape(k)}\b", launched_name)}

    ran = set().union(*map(flce_kernels_in, names))
    named = {k.rsplit(".", 1)[1] for k in record.kernel_names() if k.startswith("flce.backends.cuda.")}
    cublas_ran = any(CUBLAS_NAME.search(n) and not flce_kernels_in(n) for n in names)
    return ran, named, cublas_ran


def launched(step: Callable[[], None]) -> list[str]:
    """The CUDA kernels ``step`` launched, by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def nested_second_derivatives(loss: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Callable]:
    """Second derivatives of a scalar ``loss(h)`` by nested torch.func transforms, by name: what flce refuses with
    its first-order message (nested transforms would see its gradients as constants and return zeros)."""
    return {
        "hessian": torch.func.hessian(loss),
        "jacrev-of-jacrev": torch.func.jacrev(torch.func.jacrev(loss)),
        "grad-of-grad": torch.func.grad(lambda h: torch.func.grad(loss)(h).square().sum()),
    }


def skip_unless_interpreter_runs() -> None:
    """Skip a test that runs Triton kernels under the interpreter in processes of its own where the interpreter
    cannot run: Triton 3.6's fails on numpy >= 2.3 (the test extra pins numpy < 2.3; a GPU image's may be newer)."""
    import pytest

    version = tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("numpy"))[:2])
    if version >= (2, 3):
        pytest.skip(f"Triton's interpreter needs numpy < 2.3 (numpy {importlib.metadata.version('numpy')} here)")
