"""The backward of a distillation call under a function transform: batched gradients
(``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.func.vmap`` over a vjp, ``jacrev``) and
``torch.func.grad``.

As cross-entropy's (:mod:`flce.engine.transformed`): the upstream gradient is a wrapped tensor, which the
backends' kernels cannot take (they write in place into plain buffers, and the scale kernel reads
grad_output's value). So gradients formed in forward are scaled out of place, and a deferred backward
(reduction "none") recomputes each chunk's two logits and forms d loss / d u with
:func:`flce.distillation.tiles.tile_gradients`, the reference backend's formula, in torch ops that have
batching rules. Per batch entry it holds a chunk's [n, V] gradients in the statistics dtype: it is for
jacobians and per-sample gradients, not for training steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flce.distillation.semantics import PairStats, pair_coefficients, row_scales
from flce.distillation.tiles import tile_gradients
from flce.engine.call import Grads
from flce.engine.distillation.call import DistillCall, PairGradTargets
from flce.engine.plans import chunk_bounds
from flce.engine.transformed import GradSums, check_unsharded


def scaled_grads(grads: tuple[Grads, Grads], scale: torch.Tensor) -> tuple[Grads, Grads]:
    """Both heads' in-forward gradients times grad_output, out of place (the unscaled ones stay intact)."""
    return tuple(tuple(None if g is None else (g.to(scale.dtype) * scale).to(g.dtype) for g in part)
                 for part in grads)


def backward(call: DistillCall, pair, state, wanted: PairGradTargets, grad_loss: torch.Tensor) -> tuple[Grads, Grads]:
    """Deferred gradients (reduction "none") for a wrapped ``grad_loss``, from the rows' statistics forward kept."""
    check_unsharded(call)
    cfg = call.cfg
    n_rows, target = pair.n_rows, pair.target
    teacher = wanted.teacher.any
    student_sums = GradSums(pair.student_hidden, pair.student_weight, pair.student_bias, wanted.student)
    teacher_sums = GradSums(pair.teacher_hidden, pair.teacher_weight, pair.teacher_bias, wanted.teacher)
    if n_rows:
        valid = None if target is None else target != cfg.ignore_index
        stats = PairStats.unstacked(state.stats, cfg)
        scale = row_scales(grad_loss, state.count, valid, n_rows, cfg)
        math = stats.teacher_max.dtype
        for rows in chunk_bounds(n_rows, call.plan.tokens_per_chunk):
            teacher_u = F.linear(pair.teacher_hidden[rows], pair.teacher_weight, pair.teacher_bias)
            student_u = F.linear(pair.student_hidden[rows], pair.student_weight, pair.student_bias)
            # The target's column, -1 where ignored (or without targets): the hard term's one-hot.
            cols = torch.full((student_u.shape[0],), -1, dtype=torch.long, device=student_u.device)
            if target is not None:
                cols = torch.where(valid[rows], target[rows], -1)
            coeffs = pair_coefficients(stats.rows(rows), scale[rows], cfg, teacher=teacher)
            student_grad, teacher_grad = tile_gradients(teacher_u.to(math), student_u.to(math), cols, coeffs, cfg)
            student_sums.add(student_grad, rows)
            if teacher:
                teacher_sums.add(teacher_grad, rows)
    return student_sums.result(), teacher_sums.result() if teacher else (None, None, None)
