"""The row-statistics epilogue of the warp-specialised Hopper GEMM (Gluon device code; sm_90a).

ws_gemm_kernels.py's consumer warpgroups put each logits half tile in shared memory (in the inputs'
dtype: the logits PyTorch would materialise) and fold it into per-row statistics here, one chunk at a
time, interleaved with the next tile's wgmma. The partials are base 2 as gemm_kernels' row statistics
and are merged by its _merge_splits_kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flce.backends.cuda.exp_grad_kernels import CAP as EXP_CAP  # the cap the redo kernels test rows against

LN2 = gl.constexpr(0.6931471805599453)  # online_softmax.LN2, as the merge that reads these partials


# Row statistics: a warpgroup's [64, 256] bf16 half tile is reduced in 16 chunks of 16 rows x 64
# columns (row block r = chunk // 4, column quarter q = chunk % 4), small enough for one chunk to hide
# under one K step's wgmma (~1000 cycles for the two warpgroups).
STATS_CHUNKS = gl.constexpr(16)
STATS_ROWS = gl.constexpr(16)
STATS_COLS = gl.constexpr(64)


@gluon.constexpr_function
def _stats_layout():
    # 8 bf16 (16 bytes) a lane per shared load; a row's 64 columns over 8 lanes: 3 shuffle levels.
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _softcapped(u, softcap):
    """softcap * tanh(u / softcap) by flce/backends/softcap.py's formula, within fp32 rounding of u at any
    softcap: (1 - e) / (1 + e) with e = exp2(-2 log2(e) |u| / softcap) in (0, 1] and the sign restored, below
    |u| / softcap = 0.25 tanh's Taylor series to x^9. The division is one approximate reciprocal (of 1 + e in
    [1, 2], within an ulp): the precise division's ~14 instructions a logit more did not hide under the wgmma
    (measured: docs/design-notes.md). Agrees with the gradient kernels' recomputation to fp32 rounding."""
    a = gl.abs(u) * (1.0 / softcap)
    e = gl.exp2(a * -2.8853900817779268)  # -2 log2(e)
    reciprocal = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [e + 1.0], dtype=gl.float32,
                                           is_pure=True, pack=1)
    s = a * a
    series = -0.05396825396825397 + s * 0.021869488536155203
    series = 0.13333333333333333 + s * series
    series = -0.3333333333333333 + s * series
    t = gl.where(a < 0.25, a + a * s * series, (1.0 - e) * reciprocal)
    return softcap * gl.where(u < 0.0, -t, t)


@gluon.jit
def _chunk_rows_cols(chunk: gl.constexpr, off_m, pid_n, BLOCK_N: gl.constexpr):
    """(rows, columns) of chunk ``chunk`` of a half tile: row block chunk // 4, column quarter chunk % 4 (for
    BLOCK_N = 256), in _stats_layout's slices."""
    layout: gl.constexpr = _stats_layout()
    QUARTERS: gl.constexpr = BLOCK_N // STATS_COLS
    first_row = off_m + (chunk // QUARTERS) * STATS_ROWS
    first_col = pid_n * BLOCK_N + (chunk % QUARTERS) * STATS_COLS
    rows = first_row + gl.arange(0, STATS_ROWS, layout=gl.SliceLayout(1, layout))
    cols = first_col + gl.arange(0, STATS_COLS, layout=gl.SliceLayout(0, layout))
    return rows, cols


@gluon.jit
def _chunk_view(tile_smem, chunk: gl.constexpr, off_m, pid_n, BLOCK_N: gl.constexpr):
    """(rows, columns, shared-memory view) of chunk ``chunk`` of a half tile (_chunk_rows_cols)."""
    QUARTERS: gl.constexpr = BLOCK_N // STATS_COLS
    r: gl.constexpr = chunk // QUARTERS
    q: gl.constexpr = chunk % QUARTERS
    rows, cols = _chunk_rows_cols(chunk, off_m, pid_n, BLOCK_N)
    return rows, cols, tile_smem.slice(r * STATS_ROWS, STATS_ROWS, dim=0).slice(q * STATS_COLS, STATS_COLS, dim=1)


# AGAINST: the chunks whose tile of the other head's logits is asked of L2 ahead of its load (a K step's wgmma
# apart: its HBM latency, loaded in its own chunk, held each chunk past its K step).
AGAINST_AHEAD = gl.constexpr(2)


@gluon.jit
def _against_rows(stats_ptrs, chunk: gl.constexpr, off_m, pid_n, M, BLOCK_N: gl.constexpr):
    """(rows, columns, row start pointers) of chunk ``chunk``'s tile of the other head's logits (AGAINST:
    stats_ptrs[10], row stride stats_ptrs[11]), in _stats_layout's slices."""
    rows, cols = _chunk_rows_cols(chunk, off_m, pid_n, BLOCK_N)
    against_ptr, stride_against = stats_ptrs[10:12]
    first_col = pid_n * BLOCK_N + (chunk % (BLOCK_N // STATS_COLS)) * STATS_COLS
    starts = against_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_against + first_col
    return rows, cols, starts


@gluon.jit
def _prefetch_against(stats_ptrs, chunk: gl.constexpr, off_m, pid_n, M, BLOCK_N: gl.constexpr):
    """Ask L2 for chunk ``chunk``'s tile of the other head's logits: its 16 rows' 128 bytes, one line each (a
    row's 64 columns; past N the line holds the row's padding or the next row's start, read and never used)."""
    rows, cols, starts = _against_rows(stats_ptrs, chunk, off_m, pid_n, M, BLOCK_N)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [starts], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _against_chunk(stats_ptrs, chunk: gl.constexpr, off_m, pid_n, valid, M, N, BLOCK_N: gl.constexpr):
    """Chunk ``chunk``'s [16, 64] tile of the other head's logits, 0 past M and N: one 16-byte load a thread."""
    rows, cols, starts = _against_rows(stats_ptrs, chunk, off_m, pid_n, M, BLOCK_N)
    offsets = gl.expand_dims(gl.arange(0, STATS_COLS, layout=gl.SliceLayout(0, _stats_layout())), 0)
    mask = gl.expand_dims((rows < M) & valid, 1) & gl.expand_dims(cols < N, 0)
    return gl.load(gl.expand_dims(starts, 1) + offsets, mask=mask, other=0.0)


@gluon.jit
def prefetch_first_against(stats_ptrs, off_m, pid_n, M, BLOCK_N: gl.constexpr):
    """The first AGAINST_AHEAD chunks' prefetches, as a tile leaves its main loop (the later ones' come from the
    chunks AGAINST_AHEAD before them)."""
    for c in gl.static_range(AGAINST_AHEAD):
        _prefetch_against(stats_ptrs, c, off_m, pid_n, M, BLOCK_N)


@gluon.jit
def _store_target_logit(target_z_ptr, rows, row_ok, target, target_u, z_scale, pid_n, N, BLOCK_N: gl.constexpr):
    """The row block's target logit z = target_u * z_scale, for the rows whose target is in column tile pid_n."""
    in_tile = row_ok & (target >= pid_n * BLOCK_N) & (target < (pid_n + 1) * BLOCK_N) & (target < N)
    gl.store(target_z_ptr + rows, target_u * z_scale, mask=in_tile)


@gluon.jit
def _stats_chunk(tile_smem, chunk: gl.constexpr, carry, off_m, pid_n, valid, M, N, stats_ptrs, y_scale, z_scale,
                 softcap, BLOCK_N: gl.constexpr, SUM_EXP_DZ: gl.constexpr, ARGMAX: gl.constexpr, SUM_Z: gl.constexpr,
                 SOFTCAP: gl.constexpr, CLASS_WEIGHT: gl.constexpr, AGAINST: gl.constexpr):
    """Chunk ``chunk`` of a warpgroup's logits half tile u (in the inputs' dtype; first row off_m, column tile
    pid_n; ``valid`` False: nothing waits in tile_smem, write nothing) folded into the row block's running
    ``carry``: (max of y, sum of exp2(y - max), target's c, target, sum of exp2(y - max) * (z - r), first column
    holding the max, sum of c, unused here: _exp_chunk's exponent offset) with c = u, or with SOFTCAP c = softcap *
    tanh(u / softcap), y = c * y_scale (y_scale = log2(e) / temperature > 0, so max y = y_scale * max c, at the same
    columns), z = c * z_scale the natural logit (z_scale = 1 / temperature, z exactly as the gradient kernels
    compute it) and r = max y * ln 2. The last column quarter writes the block's partials, base 2 as gemm_kernels'
    row statistics (merged by its _merge_splits_kernel): max, sum, with SUM_EXP_DZ (the entropy's statistic) the sum
    times z - r, with ARGMAX (token accuracy, predicted tokens) the first column of the max, with SUM_Z (label
    smoothing) the sum of y, weighted by class_weight[column] with CLASS_WEIGHT; and, where the target is in this
    tile, its logit z. AGAINST (with SUM_EXP_DZ, no SOFTCAP): that sum is taken against another head's logits u_a
    (stats_ptrs[10], row stride stats_ptrs[11]), sum e * (z - r - u_a * z_scale): a distillation's reverse KL
    centre, whose chunk of u_a (written by the other head's GEMM just before) was asked of L2 AGAINST_AHEAD chunks
    earlier (the first ones' by the caller: prefetch_first_against)."""
    layout: gl.constexpr = _stats_layout()
    QUARTERS: gl.constexpr = BLOCK_N // STATS_COLS
    q: gl.constexpr = chunk % QUARTERS
    part_max_ptr, part_sum_ptr, part_sum_dz_ptr, part_argmax_ptr, part_sum_y_ptr = stats_ptrs[:5]
    target_ptr, target_z_ptr, class_weight_ptr = stats_ptrs[5:8]
    rows, cols, chunk_smem = _chunk_view(tile_smem, chunk, off_m, pid_n, BLOCK_N)
    # The row block's per-row operands come from HBM once, at its first column quarter, and ride in the carry
    # to the other three: a global load in every chunk put its latency into each chunk's critical path.
    row_ok = (rows < M) & valid
    if AGAINST:  # asked of L2 AGAINST_AHEAD chunks before; the chunk as many after is asked for now
        other = _against_chunk(stats_ptrs, chunk, off_m, pid_n, valid, M, N, BLOCK_N)
        if chunk + AGAINST_AHEAD < STATS_CHUNKS:
            _prefetch_against(stats_ptrs, chunk + AGAINST_AHEAD, off_m, pid_n, M, BLOCK_N)
    target = carry[3]
    if q == 0:
        target = gl.load(target_ptr + rows, mask=row_ok, other=-1)
    u = chunk_smem.load(layout).to(gl.float32)
    if SOFTCAP:
        u = _softcapped(u, softcap)  # kernels._capped_scaled's cap
    if SUM_Z:
        if CLASS_WEIGHT:
            weight = gl.load(class_weight_ptr + cols, mask=cols < N, other=0.0)
            part_sum_u = gl.sum(u * gl.expand_dims(weight, 0), axis=1)
        else:
            # The columns past N hold 0 (the TMA load of W's rows past V fills zeros, so their logits are
            # 0, and so is their softcap): the unmasked sum is the sum over the valid columns, without a
            # select per column.
            part_sum_u = gl.sum(u, axis=1)
    z = gl.where(gl.expand_dims(cols < N, 0), u, float("-inf"))
    top = gl.max(z, axis=1)
    part_max = top * y_scale
    shift = gl.where(part_max > float("-inf"), part_max, 0.0)  # a quarter past N: all -inf, sum 0
    e = gl.exp2(z * y_scale - gl.expand_dims(shift, 1))
    part_sum = gl.sum(e, axis=1)
    if not SUM_Z:
        part_sum_u = part_sum
    part_target = gl.sum(gl.where(gl.expand_dims(cols, 0) == gl.expand_dims(target, 1), z, 0.0), axis=1)
    if ARGMAX:
        first = gl.where(z == gl.expand_dims(top, 1), gl.expand_dims(cols, 0), 2147483647)
        part_arg = gl.min(first, axis=1).to(gl.int64)
    else:
        part_arg = target
    if SUM_EXP_DZ:
        # sum e * (z - r) as sum e * (u - max u) * z_scale + (max z - r) * sum e: u - max u is exact (16-bit
        # logits; with a softcap, the capped ones are fp32), so the max column's term is the gradient kernels'
        # max z - r exactly (this form and order spill least: docs/design-notes.md). Columns past N: e = 0
        # and u - max u = -inf, floored at -3e38 so their product is 0, not NaN; a quarter past N has
        # max u = r = 0 (shift): no inf - inf there.
        top_u = gl.where(top > float("-inf"), top, 0.0)
        du = gl.maximum(z - gl.expand_dims(top_u, 1), -3.0e38)
        if AGAINST:  # u_a is 0 past N, where e is
            du = du - other.to(gl.float32)
        part_sum_dz = gl.sum(e * du, axis=1) * z_scale + (top_u * z_scale - shift * LN2) * part_sum
    else:
        part_sum_dz = part_sum
    if q == 0:
        running_max, running_sum, target_u = part_max, part_sum, part_target
        running_sum_dz, best, running_sum_u = part_sum_dz, part_arg, part_sum_u
    else:
        if ARGMAX:  # strictly greater: an earlier quarter keeps a tie, so the first maximal column wins
            best = gl.where(part_max > carry[0], part_arg, carry[5])
        else:
            best = part_arg
        running_max = gl.maximum(carry[0], part_max)
        carry_scale = gl.exp2(carry[0] - running_max)
        part_scale = gl.exp2(gl.where(part_max > float("-inf"), part_max, running_max) - running_max)
        if SUM_EXP_DZ:
            # Both sums move to the new r (the carry's max is finite: quarter 0 is never past N; a
            # later quarter past N has part_sum 0).
            reference = running_max * LN2
            carry_dz = carry[4] + (carry[0] * LN2 - reference) * carry[1]
            part_dz = part_sum_dz + (shift * LN2 - reference) * part_sum
            running_sum_dz = carry_dz * carry_scale + part_dz * part_scale
        running_sum = carry[1] * carry_scale + part_sum * part_scale
        target_u = carry[2] + part_target
        if not SUM_EXP_DZ:
            running_sum_dz = running_sum
        if SUM_Z:
            running_sum_u = carry[6] + part_sum_u
        else:
            running_sum_u = running_sum
    if q == QUARTERS - 1:
        part = pid_n.to(gl.int64) * M + rows
        gl.store(part_max_ptr + part, running_max, mask=row_ok)
        gl.store(part_sum_ptr + part, running_sum, mask=row_ok)
        if SUM_EXP_DZ:
            gl.store(part_sum_dz_ptr + part, running_sum_dz, mask=row_ok)
        if ARGMAX:
            gl.store(part_argmax_ptr + part, best, mask=row_ok)
        if SUM_Z:
            gl.store(part_sum_y_ptr + part, running_sum_u * y_scale, mask=row_ok)
        _store_target_logit(target_z_ptr, rows, row_ok, target, target_u, z_scale, pid_n, N, BLOCK_N)
    return running_max, running_sum, target_u, target, running_sum_dz, best, running_sum_u, carry[7]


@gluon.jit
def _exp_chunk(tile_smem, chunk: gl.constexpr, carry, off_m, pid_n, valid, M, N, stats_ptrs, y_scale, z_scale,
               BLOCK_N: gl.constexpr):
    """A loss keeping exponentials (exp_grad_ops.py): chunk ``chunk`` of the half tile u, as in
    _stats_chunk, overwritten in tile_smem by E = min(exp2(y - offset), 2^EXP_CAP) in the same dtype (0 past N;
    the caller stores it to HBM once all chunks of the half tile are done), offset = exp_offset[row] (base 2),
    the same for every tile of a row.

    The statistics are taken relative to that offset instead of a running maximum: each column tile's partials
    are max = offset and sum = the sum of E, which _merge_splits_kernel merges as any others. So a chunk needs no
    max reduction and no rescaling exponentials, and the sum adds the values stored. A row whose logits exceed
    offset + EXP_CAP sums capped values (finite, never inf, whose 0 * inf would be NaN in the gradient GEMMs); its
    sum is then at least 2^EXP_CAP, and exp_grad_ops.finish_exp_rows lists it for redo_exp_rows, which recomputes
    its exponentials and its lse. carry: (unused, sum of E, target's u, target, unused, unused, unused, offset)."""
    layout: gl.constexpr = _stats_layout()
    QUARTERS: gl.constexpr = BLOCK_N // STATS_COLS
    q: gl.constexpr = chunk % QUARTERS
    part_max_ptr, part_sum_ptr = stats_ptrs[:2]
    target_ptr, target_z_ptr = stats_ptrs[5:7]
    rows, cols, chunk_smem = _chunk_view(tile_smem, chunk, off_m, pid_n, BLOCK_N)
    row_ok = (rows < M) & valid
    target = carry[3]
    offset = carry[7]
    if q == 0:  # the row block's operands once, riding in the carry to its other quarters (as _stats_chunk)
        target = gl.load(target_ptr + rows, mask=row_ok, other=-1)
        offset = gl.load(stats_ptrs[9] + rows, mask=row_ok, other=0.0)
    u = chunk_smem.load(layout).to(gl.float32)
    y = gl.minimum(u * y_scale - gl.expand_dims(offset, 1), EXP_CAP)
    e = gl.where(gl.expand_dims(cols < N, 0), gl.exp2(y), 0.0)  # past N the TMA load filled logits of 0
    chunk_smem.store(e.to(chunk_smem.dtype))
    part_sum = gl.sum(e, axis=1)
    part_target = gl.sum(gl.where(gl.expand_dims(cols, 0) == gl.expand_dims(target, 1), u, 0.0), axis=1)
    if q == 0:
        running_sum, target_u = part_sum, part_target
    else:
        running_sum, target_u = carry[1] + part_sum, carry[2] + part_target
    if q == QUARTERS - 1:
        part = pid_n.to(gl.int64) * M + rows
        gl.store(part_max_ptr + part, offset, mask=row_ok)
        gl.store(part_sum_ptr + part, running_sum, mask=row_ok)
        _store_target_logit(target_z_ptr, rows, row_ok, target, target_u, z_scale, pid_n, N, BLOCK_N)
    return carry[0], running_sum, target_u, target, carry[4], carry[5], carry[6], offset


@gluon.jit
def _fold_chunk(tile_smem, chunk: gl.constexpr, carry, off_m, pid_n, valid, M, N, stats_ptrs, y_scale, z_scale,
                softcap, BLOCK_N: gl.constexpr, SUM_EXP_DZ: gl.constexpr, ARGMAX: gl.constexpr, SUM_Z: gl.constexpr,
                SOFTCAP: gl.constexpr, CLASS_WEIGHT: gl.constexpr, STORE_EXP: gl.constexpr, AGAINST: gl.constexpr):
    """One statistics chunk: _exp_chunk with STORE_EXP (exp_grad_ops.py), else _stats_chunk."""
    if STORE_EXP:
        carry = _exp_chunk(tile_smem, chunk, carry, off_m, pid_n, valid, M, N, stats_ptrs, y_scale, z_scale, BLOCK_N)
    else:
        carry = _stats_chunk(tile_smem, chunk, carry, off_m, pid_n, valid, M, N, stats_ptrs, y_scale, z_scale,
                             softcap, BLOCK_N, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP, CLASS_WEIGHT, AGAINST)
    return carry
