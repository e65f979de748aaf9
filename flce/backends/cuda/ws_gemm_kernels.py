"""Warp-specialised persistent Hopper GEMM in Gluon (device code only; sm_90a).

``C[M, N] = A[M, K] @ B[K, N]`` with bf16/fp16 operands, fp32 accumulation and a C of any dtype the
TMA store takes. One kernel covers the three products of the loss by the operands' memory order:

    logits      = x @ W.T   A = x [M, K] K-major,        B = W [N, K] K-major (B_KMAJOR)
    grad_hidden = G @ W     A = G [M, K] K-major,        B = W [K, N] N-major
    grad_weight = G.T @ x   A = G [K, M] M-major (A_MMAJOR), B = x [K, N] N-major

A TMA descriptor's block is the tile as it lies in memory ([BLOCK_K, BLOCK_M] for an M-major A); the
consumer hands wgmma a transposed view of the shared tile, which wgmma reads in either order.

Partitions (``warp_specialize``; gluon_compat.py maps the Gluon names that moved between Triton releases):

* **load** (1 warp, few registers): walks the program's tiles in the same order as the consumers and
  issues the TMA loads of each K step into a ring of NUM_STAGES shared-memory stages; ``ready[s]``
  completes when both tiles of stage s landed (expect-tx bytes), ``empty[s]`` when the consumers
  are done reading it. The ring runs ahead across tile boundaries, so while the consumers run one
  tile's epilogue the next tile's first stages are already loading.
* **mma** (the default partition, ``num_warps`` warps = 2 warpgroups for 8 warps, each owning
  BLOCK_M / 2 rows): one async ``warpgroup_mma`` per K step, keeping one in flight
  (``warpgroup_mma_wait(1)``), so a stage is released one step after its wgmma was issued. After
  the last step the accumulator goes to bf16 in shared memory and out by a TMA store that runs on
  while the next tile's main loop starts; the store buffer is only waited on at the next epilogue.

ACCUMULATE (C += A @ B, the weight gradient summed over token chunks): each warpgroup's C half tile
is fetched by TMA into its store buffer a few K steps into the tile's main loop (by then the previous
tile's store has left the buffer), so the read half of the read-modify-write overlaps the wgmma
instead of stalling the epilogue; the epilogue adds it to the accumulator in fp32 and rounds once.

Tile order: persistent programs (one per SM) take tiles ``pid, pid + programs, ...`` of a grouped
order (GROUP_M row blocks x all column blocks), so the ~132 tiles in flight at one time share a few
A row blocks and B column blocks in L2.

Out-of-range rows/columns/K steps need no masks: TMA loads fill them with zeros and TMA stores clip
them. Every global stride must be a multiple of 16 bytes (the launcher checks).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flce.backends.cuda.gluon_compat import cta_barrier, tma_load, tma_store, warp_specialize
from flce.backends.cuda.ws_stats_kernels import (
    STATS_CHUNKS,
    STATS_ROWS,
    _fold_chunk,
    _stats_layout,
    prefetch_first_against,
)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(row block, column block) of linear tile id ``tile`` in grouped order."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile // tiles_per_group
    first_m = group * GROUP_M
    group_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    local = tile % tiles_per_group
    return first_m + local % group_m, local // group_m


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                    A_MMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    step = 0  # K steps issued so far by this program, over all its tiles: the ring position
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_steps):
            s = step % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0, so the first
            # pass over the ring waits on parity 1 and does not block.
            mbarrier.wait(empty.index(s), ((step // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), stage_bytes)
            k = kk * BLOCK_K
            if A_MMAJOR:
                tma_load(a_desc, [k, off_m], ready.index(s), a_bufs.index(s))
            else:
                tma_load(a_desc, [off_m, k], ready.index(s), a_bufs.index(s))
            if B_KMAJOR:
                tma_load(b_desc, [off_n, k], ready.index(s), b_bufs.index(s))
            else:
                tma_load(b_desc, [k, off_n], ready.index(s), b_bufs.index(s))
            step += 1


@gluon.jit
def _k_step(a_bufs, b_bufs, ready, empty, acc, step, kk, WG: gl.constexpr, A_MMAJOR: gl.constexpr,
            B_KMAJOR: gl.constexpr, HALF_M: gl.constexpr):
    """Issue K step kk of the tile (ring position ``step``) as an async wgmma on this warpgroup's
    rows; returns the accumulator still in flight (the caller waits with _retire_step)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = step % NUM_STAGES
    mbarrier.wait(ready.index(s), (step // NUM_STAGES) & 1)
    if A_MMAJOR:
        a = a_bufs.index(s).slice(WG * HALF_M, HALF_M, dim=1).permute((1, 0))
    else:
        a = a_bufs.index(s).slice(WG * HALF_M, HALF_M, dim=0)
    b = b_bufs.index(s)
    if B_KMAJOR:
        b = b.permute((1, 0))
    return warpgroup_mma(a, b, acc, use_acc=kk > 0, is_async=True)


@gluon.jit
def _retire_step(empty, acc, step, kk):
    """Keep the newest wgmma in flight; the one before it has finished reading its stage: free it."""
    NUM_STAGES: gl.constexpr = empty.type.shape[0]
    acc = warpgroup_mma_wait(1, deps=(acc,))
    mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
    return acc


@gluon.jit
def _store_exp_tile(c_desc, tile_smem, off_m, pid_n, BLOCK_N: gl.constexpr):
    """STORE_EXP: send the half tile whose chunks just overwrote it with exponentials (first row off_m; -1:
    none waits) to HBM; the next epilogue waits for the store before it writes tile_smem again."""
    if off_m >= 0:
        fence_async_shared()  # the chunks' shared stores, visible to the TMA unit
        cta_barrier()  # every warp of this warpgroup has written its part
        tma_store(c_desc, [off_m, pid_n * BLOCK_N], tile_smem)


# ACCUMULATE: the K step at which C's tile is fetched. Step 0 would wait on the previous tile's store
# (issued just before); two steps on it has long left the buffer, and the fetch still has the rest of
# the main loop to land.
ACCUMULATE_PREFETCH_STEP = gl.constexpr(2)

@gluon.jit
def _consumer_partition(a_bufs, b_bufs, ready, empty, c_desc, c_smem, c_ready, M, N, K, stats_ptrs, y_scale, z_scale,
                        softcap, WG: gl.constexpr, A_MMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                        ROW_STATS: gl.constexpr, INTERLEAVE: gl.constexpr, STORE_TILE: gl.constexpr,
                        ACCUMULATE: gl.constexpr, SUM_EXP_DZ: gl.constexpr, ARGMAX: gl.constexpr,
                        SUM_Z: gl.constexpr, SOFTCAP: gl.constexpr, CLASS_WEIGHT: gl.constexpr,
                        HAS_BIAS: gl.constexpr, STORE_EXP: gl.constexpr, AGAINST: gl.constexpr):
    """Warpgroup WG (0 or 1): rows [WG * BLOCK_M / 2, (WG + 1) * BLOCK_M / 2) of every tile.

    Each warpgroup is its own partition, so the barriers the compiler puts around the mbarrier
    operations span its own 4 warps only; the two warpgroups meet only at ``empty`` (count 2).

    ROW_STATS: the tile (plus the bias with HAS_BIAS, added in fp32) goes to shared memory in the inputs'
    dtype (the logits PyTorch would materialise) and is reduced to statistics in STATS_CHUNKS chunks.
    With INTERLEAVE (at least STATS_CHUNKS K steps a tile) one chunk runs during each of the program's next tile's
    first K steps, while that step's wgmma runs, so the exp2s and reductions overlap the tensor cores; the last tile's
    chunks, and every tile's without INTERLEAVE, run right after its main loop. STORE_TILE: the tile in shared memory
    also goes out by a TMA store (the logits a later row kernel turns into the gradient), which reads the buffer
    beside the statistics chunks and is waited on only before the next tile overwrites it. STORE_EXP (instead of
    STORE_TILE; a gradient that is a row multiple of softmax - onehot): the chunks (_exp_chunk) overwrite the tile
    with its row-offset exponentials and take the statistics relative to that offset, and the half tile goes out by a
    TMA store once its last chunk is done.

    ACCUMULATE (not with ROW_STATS): C's half tile is fetched into tile_smem at K step
    ACCUMULATE_PREFETCH_STEP (``c_ready[WG]`` completes one phase a tile) and added in the epilogue."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    # wgmma's widest N is 256. (A conditional, not min(): Triton 3.5's min of two constexprs is a tensor.)
    INSTR_N: gl.constexpr = 256 if BLOCK_N > 256 else BLOCK_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, INSTR_N, 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    tile_smem = c_smem.index(WG)
    row_vector: gl.constexpr = gl.SliceLayout(1, _stats_layout())
    carry = (gl.zeros([STATS_ROWS], gl.float32, row_vector), gl.zeros([STATS_ROWS], gl.float32, row_vector),
             gl.zeros([STATS_ROWS], gl.float32, row_vector), gl.zeros([STATS_ROWS], gl.int64, row_vector),
             gl.zeros([STATS_ROWS], gl.float32, row_vector), gl.zeros([STATS_ROWS], gl.int64, row_vector),
             gl.zeros([STATS_ROWS], gl.float32, row_vector), gl.zeros([STATS_ROWS], gl.float32, row_vector))
    step = 0  # K steps consumed so far over all of this program's tiles: the ring position
    prev_m = -1  # ROW_STATS: first row and column tile of the tile waiting in tile_smem (-1: none)
    prev_n = 0
    tiles_done = 0  # ACCUMULATE: the phase of c_ready this tile's C fetch completes
    prefetch_at = gl.minimum(ACCUMULATE_PREFETCH_STEP, k_steps - 1)
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M + WG * HALF_M
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        first = 0
        if ROW_STATS and INTERLEAVE:
            for c in gl.static_range(STATS_CHUNKS):
                # An opaque copy of the ring position (a mov the compiler cannot see through): without it Triton
                # 3.9 computes the ring indices and wgmma descriptors of all 16 unrolled steps ahead, in vector
                # registers (R2UR before each wgmma) that spill beside the chunks' values; 3.6 kept them uniform.
                step = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [step], dtype=gl.int32, is_pure=False,
                                                 pack=1)
                acc = _k_step(a_bufs, b_bufs, ready, empty, acc, step, c, WG, A_MMAJOR, B_KMAJOR, HALF_M)
                carry = _fold_chunk(tile_smem, c, carry, prev_m, prev_n, prev_m >= 0, M, N, stats_ptrs, y_scale,
                                    z_scale, softcap, BLOCK_N, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP,
                                    CLASS_WEIGHT, STORE_EXP, AGAINST)
                acc = _retire_step(empty, acc, step, c)
                step += 1
            first = STATS_CHUNKS
            if STORE_EXP:
                _store_exp_tile(c_desc, tile_smem, prev_m, prev_n, BLOCK_N)
        for kk in range(first, k_steps):
            acc = _k_step(a_bufs, b_bufs, ready, empty, acc, step, kk, WG, A_MMAJOR, B_KMAJOR, HALF_M)
            if ACCUMULATE:
                if kk == prefetch_at:
                    tma.store_wait(0)  # the previous tile's store has left tile_smem (long since)
                    mbarrier.expect(c_ready.index(WG), c_desc.block_type.nbytes)
                    tma_load(c_desc, [off_m, pid_n * BLOCK_N], c_ready.index(WG), tile_smem)
            acc = _retire_step(empty, acc, step, kk)
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=k_steps > 0)
        if ROW_STATS:
            if HAS_BIAS:
                bias_cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                bias = gl.load(stats_ptrs[8] + bias_cols, mask=bias_cols < N, other=0.0).to(gl.float32)
                acc = acc + gl.expand_dims(bias, 0)  # in fp32, rounded once with the product (as addmm)
            out = acc.to(tile_smem.dtype)
            if STORE_TILE or STORE_EXP:
                tma.store_wait(0)  # the previous tile's store has left tile_smem
            cta_barrier()  # every warp of this warpgroup has read the previous tile's chunks
            tile_smem.store(out)
            if STORE_TILE:
                fence_async_shared()
            cta_barrier()  # the whole half tile is stored before any warp reads a chunk
            if STORE_TILE:
                tma_store(c_desc, [off_m, pid_n * BLOCK_N], tile_smem)
            if AGAINST:  # the first chunks' u_a, on its way to L2 (with INTERLEAVE while the next tile's loop starts)
                prefetch_first_against(stats_ptrs, off_m, pid_n, M, BLOCK_N)
            if INTERLEAVE:
                prev_m = off_m
                prev_n = pid_n
            else:
                for c in gl.static_range(STATS_CHUNKS):
                    carry = _fold_chunk(tile_smem, c, carry, off_m, pid_n, True, M, N, stats_ptrs, y_scale,
                                        z_scale, softcap, BLOCK_N, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP,
                                        CLASS_WEIGHT, STORE_EXP, AGAINST)
                if STORE_EXP:
                    _store_exp_tile(c_desc, tile_smem, off_m, pid_n, BLOCK_N)
        else:
            if ACCUMULATE:
                mbarrier.wait(c_ready.index(WG), tiles_done & 1)
                acc = acc + tile_smem.load(acc_layout).to(gl.float32)
                cta_barrier()  # every warp has read C before any overwrites it
            out = acc.to(c_desc.dtype)
            tma.store_wait(0)  # the previous tile's store has left tile_smem
            tile_smem.store(out)
            fence_async_shared()
            tma_store(c_desc, [off_m, pid_n * BLOCK_N], tile_smem)
        tiles_done += 1
    if ROW_STATS:
        if INTERLEAVE:
            for c in gl.static_range(STATS_CHUNKS):
                carry = _fold_chunk(tile_smem, c, carry, prev_m, prev_n, prev_m >= 0, M, N, stats_ptrs, y_scale,
                                    z_scale, softcap, BLOCK_N, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP,
                                    CLASS_WEIGHT, STORE_EXP, AGAINST)
            if STORE_EXP:
                _store_exp_tile(c_desc, tile_smem, prev_m, prev_n, BLOCK_N)
    if STORE_TILE or STORE_EXP or not ROW_STATS:
        tma.store_wait(0)


@gluon.jit
def _ws_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, part_max_ptr, part_sum_ptr, part_sum_dz_ptr, part_argmax_ptr,
                    part_sum_y_ptr, target_ptr, target_z_ptr, class_weight_ptr, bias_ptr, exp_offset_ptr,
                    against_ptr, stride_against, y_scale, z_scale, softcap,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    A_MMAJOR: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr,
                    NUM_STAGES: gl.constexpr, ROW_STATS: gl.constexpr, INTERLEAVE: gl.constexpr,
                    STORE_TILE: gl.constexpr, ACCUMULATE: gl.constexpr, SUM_EXP_DZ: gl.constexpr,
                    ARGMAX: gl.constexpr, SUM_Z: gl.constexpr, SOFTCAP: gl.constexpr, CLASS_WEIGHT: gl.constexpr,
                    HAS_BIAS: gl.constexpr, STORE_EXP: gl.constexpr, AGAINST: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """C = A @ B, or with ROW_STATS C's row statistics (_stats_chunk, BLOCK_N a multiple of 64); grid = (persistent
    programs,), launched with num_warps=4 (the first consumer warpgroup; the second and the load
    warp are workers). a_desc block [BLOCK_M, BLOCK_K] (or [BLOCK_K, BLOCK_M] with A_MMAJOR);
    b_desc [BLOCK_N, BLOCK_K] with B_KMAJOR (or [BLOCK_K, BLOCK_N]); c_desc [BLOCK_M / 2, BLOCK_N],
    one warpgroup's half tile (with ROW_STATS: the logits' descriptor under STORE_TILE, else None).
    ACCUMULATE: C += A @ B (C read through c_desc; not with ROW_STATS).

    ROW_STATS only (unused otherwise; INTERLEAVE needs >= STATS_CHUNKS K steps a tile):
    part_max_ptr, part_sum_ptr  [cdiv(N, BLOCK_N), M] fp32 partials
    part_sum_dz_ptr             the same, written with SUM_EXP_DZ (the entropy's sum exp2(y - max) * (z - max * ln 2))
    part_argmax_ptr             [cdiv(N, BLOCK_N), M] int64, written with ARGMAX: each block's first max column
    part_sum_y_ptr              [cdiv(N, BLOCK_N), M] fp32, written with SUM_Z: each block's sum of y (label smoothing;
                                with CLASS_WEIGHT of class_weight[column] * y, class_weight_ptr [N] fp32)
    target_ptr [M] int64 class ids; target_z_ptr [M] fp32, written where the target is in [0, N)
    bias_ptr [N], read with HAS_BIAS: the logits are A @ B + bias, rounded to the inputs' dtype
    exp_offset_ptr [M] fp32, read with STORE_EXP: C gets min(exp2(y - exp_offset[row]), ~2^64) instead of
    the logits (y the base-2 logit, as the statistics'), in the inputs' dtype, and the partials are relative
    to it (max = exp_offset[row], sum = the sum of C's values)
    against_ptr [M, N] (row stride stride_against), read with AGAINST (and SUM_EXP_DZ, no SOFTCAP): another head's
    logits u_a, the entropy's sum then taken against them, sum exp2(y - max) * (z - max * ln 2 - u_a * z_scale)
    y_scale = log2(e) / temperature, z_scale = 1 / temperature: the statistics of z = c / T for the
    logits u (rounded to the inputs' dtype) of a temperature T, c = u or with SOFTCAP the capped
    softcap * tanh(u / softcap); the plain loss passes T = 1."""
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[1] if B_KMAJOR else b_desc.block_type.shape[0]
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = a_desc.dtype

    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    # The output tile, one half per consumer warpgroup: read by the TMA store, and (ROW_STATS, in the
    # inputs' dtype) by the consumers' statistics chunks; under ACCUMULATE first written by C's fetch.
    if ROW_STATS and not (STORE_TILE or STORE_EXP):
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_N], dtype)
        c_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, BLOCK_N], c_layout)
    else:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # ACCUMULATE's C fetch
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(c_ready.index(i), count=1)

    stats_ptrs = (part_max_ptr, part_sum_ptr, part_sum_dz_ptr, part_argmax_ptr, part_sum_y_ptr, target_ptr,
                  target_z_ptr, class_weight_ptr, bias_ptr, exp_offset_ptr, against_ptr, stride_against)
    warp_specialize([
        (_consumer_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, c_ready, M, N, K, stats_ptrs, y_scale,
                               z_scale, softcap, 0, A_MMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               ROW_STATS, INTERLEAVE, STORE_TILE, ACCUMULATE, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP,
                               CLASS_WEIGHT, HAS_BIAS, STORE_EXP, AGAINST)),
        (_consumer_partition, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, c_ready, M, N, K, stats_ptrs, y_scale,
                               z_scale, softcap, 1, A_MMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               ROW_STATS, INTERLEAVE, STORE_TILE, ACCUMULATE, SUM_EXP_DZ, ARGMAX, SUM_Z, SOFTCAP,
                               CLASS_WEIGHT, HAS_BIAS, STORE_EXP, AGAINST)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
                           A_MMAJOR, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])
