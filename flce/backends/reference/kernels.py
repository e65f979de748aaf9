"""Pure-PyTorch chunk kernels: the ground truth and the CPU production path.

Each function works on one chunk of rows and the full vocabulary; the math is
done in float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

import torch

from flce.config import LCEConfig
from flce.semantics import (
    GradCoefficients,
    PartialRowStats,
    needs_argmax,
    needs_expected_z,
    needs_weighted_sum_z,
)

# Rows of grad_weight upcast at a time when accumulating in fp32: bounds the temporary.
_FP32_ACCUMULATE_ROWS = 8192


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _target_onehot_index(target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, target, 0).unsqueeze(1)


class ReferenceKernels:
    """Implements flce.backends.chunk_driver.ChunkKernels with torch ops."""

    def plain_loss(self, logits, target, ignore_index, grad_scale):  # noqa: ANN001, ANN201
        z = logits.to(math_dtype(logits.dtype))
        valid = target != ignore_index
        index = _target_onehot_index(target, valid)
        # One fused softmax-family kernel gives both the loss and, after exp, the probabilities.
        log_probs = torch.log_softmax(z, dim=1)
        target_log_prob = log_probs.gather(1, index).squeeze(1)
        loss = torch.where(valid, -target_log_prob, 0.0)
        lse = z.gather(1, index).squeeze(1) - target_log_prob
        grad = None
        if grad_scale is not None:
            grad = _plain_grad(logits, log_probs.exp_(), index, valid, grad_scale)
        return loss, lse, grad

    def plain_grad_(self, logits, target, ignore_index, lse, grad_scale):  # noqa: ANN001, ANN201
        valid = target != ignore_index
        # .to() returns logits itself in fp32: then the grad is written in place.
        probs = logits.to(math_dtype(logits.dtype)).sub_(lse.unsqueeze(1)).exp_()
        return _plain_grad(logits, probs, _target_onehot_index(target, valid), valid, grad_scale)

    def row_stats(self, logits, target, cfg: LCEConfig, vocab_offset: int) -> PartialRowStats:  # noqa: ANN001
        z = capped_scaled(logits.to(math_dtype(logits.dtype)), cfg)
        row_max, argmax = z.max(dim=1)
        exp = torch.exp(z - row_max.unsqueeze(1))
        local = target - vocab_offset
        in_shard = (local >= 0) & (local < z.shape[1])
        target_z = torch.where(in_shard, z.gather(1, _target_onehot_index(local, in_shard)).squeeze(1), 0.0)
        stats = PartialRowStats(row_max=row_max, sum_exp=exp.sum(1), target_z=target_z)
        if needs_expected_z(cfg):
            stats.sum_exp_z = (exp * z).sum(1)
        if needs_weighted_sum_z(cfg):
            stats.weighted_sum_z = z.sum(1) if cfg.class_weight is None else z @ _shard_weight(cfg, z, vocab_offset)
        if needs_argmax(cfg):
            # torch.argmax returns the first maximal index, as the kernels do.
            stats.argmax = torch.argmax(z, dim=1) + vocab_offset
        return stats

    def full_grad_(self, logits, target, cfg: LCEConfig, vocab_offset: int, lse, coeffs: GradCoefficients):  # noqa: ANN001, ANN201
        z = capped_scaled(logits.to(math_dtype(logits.dtype)), cfg)
        probs = torch.exp(z - lse.unsqueeze(1))
        if coeffs.h is None:
            grad = probs * coeffs.a.unsqueeze(1)
        else:
            grad = probs * (coeffs.a.unsqueeze(1) - coeffs.h.unsqueeze(1) * z)
        local = target - vocab_offset
        in_shard = (local >= 0) & (local < z.shape[1])
        d = torch.where(in_shard, coeffs.d, 0.0).to(grad.dtype)
        grad.scatter_add_(1, _target_onehot_index(local, in_shard), -d.unsqueeze(1))
        if coeffs.e is not None:
            weight = 1.0 if cfg.class_weight is None else _shard_weight(cfg, z, vocab_offset).unsqueeze(0)
            grad -= coeffs.e.unsqueeze(1) * weight
        return _in_dtype(chain_through_cap(grad, z, cfg), logits)

    def scale_(self, tensor, scale):  # noqa: ANN001, ANN201
        return tensor.mul_(scale.to(tensor.dtype))

    def accumulate_fp32_(self, acc, a, b) -> None:  # noqa: ANN001
        for start in range(0, acc.shape[0], _FP32_ACCUMULATE_ROWS):
            rows = slice(start, start + _FP32_ACCUMULATE_ROWS)
            acc[rows] += (a[rows] @ b).float()


def _plain_grad(logits, probs, index, valid, grad_scale) -> torch.Tensor:  # noqa: ANN001
    """(probs - onehot) * scale, in place in probs, returned in the logits' dtype."""
    scale = torch.where(valid, grad_scale.to(probs.dtype), 0.0)
    probs.mul_(scale.unsqueeze(1))
    probs.scatter_add_(1, index, -scale.unsqueeze(1))
    return _in_dtype(probs, logits)


def _in_dtype(grad: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The GEMMs after the grad kernel run in the logits' (compute) dtype, as eager torch would."""
    if grad.dtype == logits.dtype:
        return grad
    return logits.copy_(grad)


def capped_scaled(u: torch.Tensor, cfg: LCEConfig) -> torch.Tensor:
    """z = cap(u) / temperature."""
    if cfg.softcap is not None:
        u = cfg.softcap * torch.tanh(u / cfg.softcap)
    if cfg.temperature != 1.0:
        u = u / cfg.temperature
    return u


def chain_through_cap(grad_z: torch.Tensor, z: torch.Tensor, cfg: LCEConfig) -> torch.Tensor:
    """d/du from d/dz: cap'(u) = 1 - tanh(u/softcap)^2 with tanh(u/softcap) = z*T/softcap."""
    if cfg.softcap is not None:
        tanh = z * (cfg.temperature / cfg.softcap)
        grad_z = grad_z * (1.0 - tanh * tanh)
    if cfg.temperature != 1.0:
        grad_z = grad_z / cfg.temperature
    return grad_z


def _shard_weight(cfg: LCEConfig, z: torch.Tensor, vocab_offset: int) -> torch.Tensor:
    assert cfg.class_weight is not None
    return cfg.class_weight[vocab_offset:vocab_offset + z.shape[1]].to(z.dtype)
