"""A kernel family of the CUDA backend as one object: the roles it can take in a call, whether it serves a call
on a device (and why not), whether the heuristic takes it, the launcher of each role, the kernel functions the
record names, the family that takes its place and its tuning candidates.

The kernel choice (cuda/choice.py) picks one family per role; the launchers (cuda/ops.py) hand each role's work to
its family, and a family whose kernel fails to compile hands it to its fallback (cuda/fallback.py); the record
(cuda/steps.py), explain and flce-autotune read names, fallbacks and candidates from the objects. Nothing else
branches on a family's name. A family module imports Triton only inside its launchers, so the choice can be made
and printed where Triton is absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flce.backends.cuda.hardware import has_16bit_tensor_cores
from flce.engine.call import grads_in_forward_allowed
from flce.engine.choice import CallDescription, DeviceDescription
from flce.engine.rows import logits_dtype
from flce.gradients import gradient_is_row_scaled_softmax

if TYPE_CHECKING:
    from flce.autotune.spaces import TuneShape
    from flce.backends.cuda.configs import LaunchSettings
    from flce.config import LCEConfig
    from flce.gradients import GradCoefficients
    from flce.semantics import PartialRowStats

# The roles a family may take in a call, each one launcher method of the family.
STATISTICS = "statistics"  # all rows' statistics in one pass, nothing [N, V] written (plans.AllRows "fused")
CHUNK_LOGITS = "chunk_logits"  # a token chunk's statistics, writing its logits (TokenChunks forward_logits "fused")
EXPONENTIALS = "exponentials"  # a token chunk's statistics, writing kept exponentials (TokenChunks chunk_grad)
PRODUCTS = "products"  # the gradient products G @ W and G.T @ x
GRADIENT = "gradient"  # a recomputed chunk's or vocabulary block's d loss / d u (plans' backward_grad "fused")
ROLES = (STATISTICS, CHUNK_LOGITS, EXPONENTIALS, PRODUCTS, GRADIENT)
# Roles a call may run without (a chunk's gradient from its logits instead of kept exponentials); every other role
# always has a family, cuBLAS and the row kernels at the least.
OPTIONAL_ROLES = frozenset({EXPONENTIALS})
# The kept exponentials hold a row without a redo while its loss at the call's temperature is under ~84.6 nats
# (exp_grad_kernels.OFFSET_ABOVE_TARGET + CAP bits), i.e. the row's logits u within 84.6 * temperature nats above
# the target's. A redone row recomputes its logits twice in a slow kernel, so colder calls, where wrong targets
# cross that line (a gap of 8.5 nats at 0.1), keep their logits instead; from 0.5 on it takes a gap of 42 nats.
EXP_MIN_TEMPERATURE = 0.5


# Below this many tokens the fused statistics GEMM has few row blocks to spread over the SMs and its fixed
# costs (target logits, split merge) weigh more; measured on the H200 at 4096 x 4096 x 32000 it is
# still ahead (1.070x one GEMM against 1.096x for cuBLAS and the row kernel); smaller calls are
# unmeasured and stay on cuBLAS.
FUSED_FORWARD_MIN_ROWS = 4096


def fused_statistics_unpreferred(device: DeviceDescription, call: CallDescription) -> str | None:
    """Why the heuristic leaves all rows' statistics to cuBLAS and the row kernel (every fused family's rule):
    fp32 inputs, the interpreter, a GPU without 16-bit tensor cores, or fewer than FUSED_FORWARD_MIN_ROWS tokens."""
    if device.type != "cuda" or device.interpreter:
        return "the interpreter: cuBLAS"
    if not sixteen_bit(call):
        return f"{str(call.dtype).removeprefix('torch.')} inputs: cuBLAS"
    if not has_16bit_tensor_cores(device):
        return f"{device.arch}: no 16-bit tensor cores a Triton dot reaches at full rate (sm_80 and later)"
    if call.n_rows < FUSED_FORWARD_MIN_ROWS:
        return f"fewer than {FUSED_FORWARD_MIN_ROWS} tokens: cuBLAS"
    return None


def tuning_call(shape: TuneShape) -> CallDescription:
    """The description of a plain training call of a tuning shape (aligned operands, default options)."""
    from flce.config import LCEConfig
    from flce.engine.plans import PlanRequest

    return CallDescription(n_rows=shape.tokens, hidden=shape.hidden, vocab=shape.vocab, dtype=shape.dtype, bias=False,
                           rows_aligned=True, cfg=LCEConfig(), variant="plain", request=PlanRequest(training=True))


def sixteen_bit(call: CallDescription) -> bool:
    return call.dtype in (torch.bfloat16, torch.float16)


def fused_statistics_unfit(call: CallDescription) -> str | None:
    """Why no GEMM epilogue can take a call's statistics (every fused family's rule), or None."""
    if call.cfg.return_logit_stats:
        return "return_logit_stats: the fused GEMMs keep no row min or sum of z"
    if logits_dtype(call.dtype, call.cfg) != call.dtype:
        return 'precision="accurate": fp32 logits come from cuBLAS'
    return None


def exponentials_unfit(call: CallDescription) -> str | None:
    """Why a chunk's gradient cannot come from kept exponentials (capability KEPT_EXPONENTIALS), or None: it can
    for a call whose gradient is a row multiple of softmax - onehot (the plain loss, a temperature, token weights:
    gradient_is_row_scaled_softmax) and whose scalar loss is its only differentiable output, bf16 or fp32 inputs
    (fp16 cannot hold exponentials up to 2^64) in the compute dtype, no bias (whose gradient the path does not
    make), on one device (a vocabulary shard's rows need the other shards' statistics first), a temperature of at
    least EXP_MIN_TEMPERATURE."""
    cfg = call.cfg
    if not (call.request.training and grads_in_forward_allowed(cfg)):
        return "no gradient formed in the forward"
    if not gradient_is_row_scaled_softmax(cfg):
        return f"the gradient of {', '.join(cfg.full_feature_options())} is not a row multiple of softmax - onehot"
    if call.bias:
        return "a bias, whose gradient the kept exponentials do not make"
    if call.request.sharded:
        return "a vocabulary shard: its rows need the other shards' statistics first"
    if cfg.temperature < EXP_MIN_TEMPERATURE:
        return f"temperature {cfg.temperature} < {EXP_MIN_TEMPERATURE}: rows past the exponentials' range"
    if call.dtype not in (torch.bfloat16, torch.float32) or logits_dtype(call.dtype, cfg) != call.dtype:
        return f"{str(call.dtype).removeprefix('torch.')} logits cannot hold exponentials up to 2^64"
    return None


class KernelFamily:
    """One way of doing a call's GEMM work (module docstring). Subclasses set the class attributes and
    implement the launchers of their ``roles``; ``fused`` families compute the loss's statistics or gradient
    in a GEMM's epilogue (the plans' "fused" path), the others are cuBLAS and the row kernels."""

    name: str  # the autotune knobs' value for it, e.g. stats_kernel=warp_specialized
    title: str  # what ``python -m flce info`` calls it
    roles: frozenset[str]
    fused: bool
    fallback: str | None  # the family that takes its place where it does not compile; None: nothing can fail
    uses_gemm_tiles: bool = False  # its launches read LaunchSettings.gemm (the autotune cache's gemm_* knobs)
    # The functions a product that adds into its output runs beside ``kernels(PRODUCTS)`` (none: the same kernel).
    accumulate_kernels: tuple[str, ...] = ()
    # Its statistics epilogue reads a second head's logits tile beside its own (``statistics``' ``against``).
    reads_other_logits: bool = False

    def unfit(self, device: DeviceDescription, call: CallDescription, role: str) -> str | None:
        """Why this family cannot take ``role`` in this call on this device, or None where it can."""
        return None if role in self.roles else f"it has no {role} kernel"

    def unpreferred(self, device: DeviceDescription, call: CallDescription, role: str) -> str | None:
        """Why the heuristic (nothing cached for the shape) passes over this family where it fits, or None where
        it takes it. Measured reasons only: flce-autotune still times what the heuristic passes over."""
        return None

    def available(self, gpu: DeviceDescription | None) -> tuple[bool, str]:
        """Whether this process can build and run the family's kernels on this GPU (None: no GPU here, the
        interpreter at most), for ``python -m flce info``."""
        return True, "always"

    def kernels(self, role: str, settings: LaunchSettings, call: CallDescription) -> tuple[str, ...]:
        """The functions a launch of ``role`` runs, as the record names them (dotted paths)."""
        raise NotImplementedError(f"{self.name} names no kernels for {role}")

    def launch_text(self, role: str, settings: LaunchSettings) -> str:
        """The launch configuration the record prints for ``role``."""
        return ""

    def compile_key(self, role: str, settings: LaunchSettings) -> str:
        """What a compile failure of ``role``'s kernel is recorded under (cuda/fallback.py): launches with the same
        key share the failure."""
        return role

    def tuning_candidates(self, device: DeviceDescription, shape: TuneShape, quick: bool) -> list[dict]:
        """Knob sets (autotune params) that put this family in the role flce-autotune times it in."""
        return []

    # The launchers, one per role. ``settings``: the launch configuration the choice made (cuda/configs.py).

    def statistics(self, settings: LaunchSettings, hidden: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
                   logits_out: torch.Tensor | None, against: torch.Tensor | None = None) -> PartialRowStats:
        """STATISTICS (logits_out None) and CHUNK_LOGITS: the partial row statistics of hidden @ weight.T + bias,
        the logits written into ``logits_out`` where given, with ``against`` (families that ``reads_other_logits``)
        its sum_exp_dz against those logits (engine.kernels.FusedStatsGemm)."""
        raise NotImplementedError(self.name)

    def exponentials(self, settings: LaunchSettings, hidden: torch.Tensor, weight: torch.Tensor,
                     target: torch.Tensor, cfg: LCEConfig, offsets: torch.Tensor,
                     exp_out: torch.Tensor) -> PartialRowStats:
        """EXPONENTIALS: the chunk's partial statistics, relative to the base-2 row ``offsets``, with ``exp_out``
        holding min(exp2(y - offset), cap) of its base-2 logits y (cuda/exp_grad_ops.py's steps 2)."""
        raise NotImplementedError(self.name)

    def products(self, settings: LaunchSettings, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 accumulate: bool) -> None:
        """PRODUCTS: out = a @ b (accumulate: out += a @ b), fp32 sums rounded once (RowKernels.matmul_)."""
        raise NotImplementedError(self.name)

    def gradient(self, settings: LaunchSettings, hidden: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, target: torch.Tensor, cfg: LCEConfig, vocab_offset: int,
                 lse: torch.Tensor, coeffs: GradCoefficients) -> torch.Tensor:
        """GRADIENT: d loss / d u of hidden @ weight.T + bias from the row lse and coefficients
        (engine.kernels.FusedGradGemm)."""
        raise NotImplementedError(self.name)

    def __repr__(self) -> str:
        return self.name
