"""Forward + backward through the CUDA backend captured in a CUDA graph and replayed.

The step is captured once on static inputs; each replay, after new data has been copied into
those inputs, must give what an eager call on that data gives. Also the compiled form that
captures graphs itself (``torch.compile(mode="reduce-overhead")``). GPU only (marker ``cuda``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import Upstream, backward_surrogate, random_upstream, relative_error

import flce

pytestmark = pytest.mark.cuda

N, H, V = 1024, 256, 8192
# Small enough that the plan splits the 1024 rows into several chunks: the captured loop is the real one.
BUDGET = 4 << 20

CASES = {
    "plain-mean": {"memory_budget": BUDGET},
    # No budget: the deferred schedule keeps forward's logits (32 MiB) for backward.
    "full-none-logprobs-entropy-saved-logits": {"reduction": "none", "return_logprobs": True,
                                                "return_entropy": True, "temperature": 0.8},
    "full-none-recomputed-logits": {"reduction": "none", "return_entropy": True, "memory_budget": BUDGET},
    "full-math": {"label_smoothing": 0.1, "softcap": 15.0, "lse_square_scale": 1e-4, "return_z_loss": True,
                  "memory_budget": BUDGET},
}


def _data(generator: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(N, H, generator=generator).to("cuda", dtype)
    w = (torch.randn(V, H, generator=generator) / H**0.5).to("cuda", dtype)
    t = torch.randint(0, V, (N,), generator=generator)
    t[torch.rand(N, generator=generator) < 0.1] = -100
    return x, w, t.cuda()


def _outputs(out: torch.Tensor | flce.LCEOutput) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"loss": out}
    return {name: value for name, value in out._asdict().items() if value is not None}


def _eager(loss_fn, x, w, t, upstream):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss_fn(x, w, t)
    backward_surrogate(out, upstream).backward()
    return {k: v.detach() for k, v in _outputs(out).items()}, (x.grad, w.grad)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    else:
        # Same kernels on the same data: only reduction order may differ between the two runs.
        assert relative_error(got, want) < 1e-2, f"{name}: relative error {relative_error(got, want):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_captured_step_replays_with_new_data(case: str, dtype: torch.dtype, generator: torch.Generator) -> None:
    loss_fn = flce.get_impl("cuda", backend="cuda")(**CASES[case])
    static_x, static_w, static_t = _data(generator, dtype)
    static_x.requires_grad_()
    static_w.requires_grad_()
    # Everything that touches the static leaves runs on one side stream, capture included: autograd
    # records a leaf's gradient-accumulator stream at its first use, and an accumulator on the legacy
    # default stream cannot be waited on while another stream captures (cudaErrorStreamCaptureImplicit).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        probe = loss_fn(static_x, static_w, static_t)
    loss_shape = (probe if isinstance(probe, torch.Tensor) else probe.loss).shape
    extras = not isinstance(probe, torch.Tensor)
    upstream = random_upstream(loss_shape, static_t.shape, logprobs=extras and probe.logprobs is not None,
                               entropy=extras and probe.entropy is not None, generator=generator)
    static_upstream = Upstream(*(None if u is None else u.cuda() for u in
                                 (upstream.loss, upstream.logprobs, upstream.entropy)))
    del probe

    # Warm up on the side stream (allocator pools, Triton compilation), then capture one step.
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            static_x.grad = static_w.grad = None
            backward_surrogate(loss_fn(static_x, static_w, static_t), static_upstream).backward()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = static_w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_result = loss_fn(static_x, static_w, static_t)
        backward_surrogate(static_result, static_upstream).backward()
    static_out = _outputs(static_result)

    for replay in range(3):
        x, w, t = _data(generator, dtype)
        fresh = random_upstream(loss_shape, t.shape, logprobs=static_upstream.logprobs is not None,
                                entropy=static_upstream.entropy is not None, generator=generator)
        with torch.no_grad():
            static_x.copy_(x)
            static_w.copy_(w)
            static_t.copy_(t)
            for target, source in zip((static_upstream.loss, static_upstream.logprobs, static_upstream.entropy),
                                      (fresh.loss, fresh.logprobs, fresh.entropy), strict=True):
                if target is not None:
                    target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        want_out, (want_gx, want_gw) = _eager(loss_fn, x, w, t, static_upstream)
        for name, value in want_out.items():
            _assert_close(static_out[name].detach(), value, dtype, f"replay {replay}: {name}")
        _assert_close(static_x.grad, want_gx, dtype, f"replay {replay}: grad hidden")
        _assert_close(static_w.grad, want_gw, dtype, f"replay {replay}: grad weight")


def test_compiled_step_with_cuda_graphs(generator: torch.Generator) -> None:
    """torch.compile's own graph capture ("reduce-overhead") around the custom op."""
    loss_fn = flce.get_impl("cuda", backend="cuda")(memory_budget=BUDGET, label_smoothing=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        x, w, t = _data(generator, torch.float32)
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = compiled(xc, wc, t)
        loss.backward()
        unit = Upstream(loss=torch.ones((), dtype=torch.float64, device="cuda"))  # what loss.backward() feeds
        want_out, (want_gx, want_gw) = _eager(loss_fn, x, w, t, unit)
        _assert_close(loss.detach(), want_out["loss"], torch.float32, f"step {step}: loss")
        _assert_close(xc.grad, want_gx, torch.float32, f"step {step}: grad hidden")
        _assert_close(wc.grad, want_gw, torch.float32, f"step {step}: grad weight")
