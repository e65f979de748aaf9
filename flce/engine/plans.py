"""The named plans a backend's planner chooses from; each is run by the schedule module of its name.

Knobs carry the names they have in the autotune cache (``forward_stats``, ``forward_logits``,
``backward_grad``, ``grad_vocab_block``, ``tokens_per_chunk``), with the cache's values: ``"fused"``
(a capability's fused GEMM) or ``"cublas"`` (a plain GEMM, then row kernels over its logits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flce.engine.kernels import FUSED_GRAD_GEMM, FUSED_STATS_GEMM, KEPT_EXPONENTIALS

# Batch-invariant calls (``batch_invariant=True``) run token tiles of exactly this many rows (the
# last one padded with ignored rows), so each tile's GEMMs and row kernels have one shape whatever
# the batch: a token's results then depend on its own row alone.
BATCH_INVARIANT_TOKENS = 128
FUSED = "fused"
CUBLAS = "cublas"
GEMM_PATHS = (FUSED, CUBLAS)
# What a chunk's in-forward gradient is made from: its kept logits (a row kernel turns them into the gradient) or,
# where the gradient is a row multiple of softmax - onehot (gradients.gradient_is_row_scaled_softmax), the
# row-offset exponentials the statistics GEMM keeps instead (capability KEPT_EXPONENTIALS).
LOGITS = "logits"
EXPONENTIALS = "exponentials"
CHUNK_GRADS = (LOGITS, EXPONENTIALS)


@dataclass(frozen=True)
class PlanRequest:
    """What a planner must know about a call beyond its inputs and options.

    training: gradients follow (the plan may compute them in forward, or keep logits for backward);
    sharded: the weight is one vocabulary shard (vocab parallelism), so schedules that need the
    whole vocabulary's rows at once (vocabulary blocks, the inference scan by blocks) are out;
    statistics_first: a row's gradient needs every row's statistics first (a policy loss at a sequence level,
    flce.engine.objective), so forward takes them all, keeping the plan's saved rows of logits, then the
    gradients."""

    training: bool
    sharded: bool = False
    statistics_first: bool = False


@dataclass(frozen=True)
class AllRows:
    """Statistics of all rows at once; nothing is accumulated across columns but [tokens] statistics,
    so every GEMM keeps all rows (full speed where a few hundred token rows would not be).

    forward_stats "fused": one statistics GEMM over the whole vocabulary (no logits in memory);
    "cublas": a GEMM and a row scan per block of ``scan_block`` columns."""

    forward_stats: str = FUSED
    scan_block: int | None = None

    def __post_init__(self) -> None:
        if self.forward_stats not in GEMM_PATHS:
            raise ValueError(f"forward_stats={self.forward_stats!r}: expected one of {GEMM_PATHS}")
        if self.forward_stats == CUBLAS and not (self.scan_block and self.scan_block > 0):
            raise ValueError(f"scan_block={self.scan_block!r}: the cublas scan needs a positive block width")

    @property
    def requires(self) -> frozenset[str]:
        return frozenset({FUSED_STATS_GEMM}) if self.forward_stats == FUSED else frozenset()


@dataclass(frozen=True)
class TokenChunks:
    """Token chunks of ``tokens_per_chunk`` rows against the whole vocabulary.

    With gradients in forward (a scalar loss is the only differentiable output) each chunk's logits
    become its gradient at once. Otherwise (deferred) forward keeps the logits of the first
    ``saved_rows`` rows (0, whole chunks, or all rows) and backward recomputes the rest chunk by
    chunk. forward_logits: how each chunk's logits and statistics are made; backward_grad: how a
    recomputed chunk's gradient is made (None: no chunk is recomputed); stats_first: where a deferred forward
    keeps no logits,
    the statistics of all rows at once instead of chunk by chunk; chunk_grad: what a chunk's in-forward
    gradient is made from (LOGITS, or EXPONENTIALS where gradients.gradient_is_row_scaled_softmax)."""

    tokens_per_chunk: int
    saved_rows: int = 0
    forward_logits: str = CUBLAS
    backward_grad: str | None = None
    stats_first: AllRows | None = None
    chunk_grad: str = LOGITS

    def __post_init__(self) -> None:
        if self.forward_logits not in GEMM_PATHS:
            raise ValueError(f"forward_logits={self.forward_logits!r}: expected one of {GEMM_PATHS}")
        if self.backward_grad not in (*GEMM_PATHS, None):
            raise ValueError(f"backward_grad={self.backward_grad!r}: expected one of {GEMM_PATHS} or None")
        if self.chunk_grad not in CHUNK_GRADS:
            raise ValueError(f"chunk_grad={self.chunk_grad!r}: expected one of {CHUNK_GRADS}")

    @property
    def requires(self) -> frozenset[str]:
        needs = set() if self.stats_first is None else set(self.stats_first.requires)
        if self.chunk_grad == EXPONENTIALS:
            needs.add(KEPT_EXPONENTIALS)
        if self.forward_logits == FUSED:
            needs.add(FUSED_STATS_GEMM)
        if self.backward_grad == FUSED:
            needs.add(FUSED_GRAD_GEMM)
        return frozenset(needs)


@dataclass(frozen=True)
class VocabBlocks:
    """Vocabulary blocks of ``grad_vocab_block`` columns over all rows: the statistics of all rows
    first (``stats``), then each block's logits recomputed and turned into its gradient (in forward
    for a scalar loss, else in backward). Each block's rows of the weight gradient are written once,
    where token chunks would read-modify-write all of it once per chunk; the price is one more GEMM
    and a read-modify-write of grad_hidden per block. Never keeps logits."""

    grad_vocab_block: int
    stats: AllRows
    backward_grad: str = CUBLAS

    def __post_init__(self) -> None:
        if self.backward_grad not in GEMM_PATHS:
            raise ValueError(f"backward_grad={self.backward_grad!r}: expected one of {GEMM_PATHS}")

    @property
    def requires(self) -> frozenset[str]:
        return self.stats.requires | ({FUSED_GRAD_GEMM} if self.backward_grad == FUSED else frozenset())


Plan = AllRows | TokenChunks | VocabBlocks


def recomputing(plan: Plan) -> Plan:
    """The plan with no logits kept from forward for backward (what the compile path runs: how many
    rows are kept is decided inside the op, where output shapes must be known beforehand)."""
    return replace(plan, saved_rows=0) if isinstance(plan, TokenChunks) else plan


def kept_rows(plan: TokenChunks, n_rows: int) -> int:
    """Rows whose logits a deferred forward keeps: whole chunks only, or all rows."""
    kept = min(plan.saved_rows, n_rows)
    return kept if kept == n_rows else kept - kept % max(1, plan.tokens_per_chunk)


def describe(plan: Plan, n_rows: int, training: bool, in_forward: bool, statistics_first: bool = False) -> str:
    """What a plan runs, in words, for a call of ``n_rows`` tokens: only the parts that run (a deferred plan's
    recompute where rows are recomputed, its statistics pass where it keeps no logits). ``statistics_first``: the
    gradients are formed in the forward after every row's statistics, as a deferred plan's backward forms them."""
    own_words = getattr(plan, "words", None)
    if own_words is not None:  # a schedule that says it itself (flce.engine.distillation's DistillChunks)
        return own_words(n_rows, training, in_forward)
    if isinstance(plan, AllRows):
        return f"all {n_rows} rows at once: {_statistics_words(plan)}"
    if isinstance(plan, VocabBlocks):
        when = "in the forward" if in_forward else "in backward"
        return (f"vocabulary blocks of {plan.grad_vocab_block} columns over all {n_rows} rows: statistics first "
                f"({_statistics_words(plan.stats)}), then each block's gradient {when} from "
                f"{_GRADIENT_WORDS[plan.backward_grad]}")
    chunks = -(-n_rows // max(1, plan.tokens_per_chunk)) if n_rows else 0
    words = [f"token chunks: {chunks} of up to {plan.tokens_per_chunk} rows"]
    two_pass = in_forward and statistics_first
    deferred = training and (not in_forward or two_pass)
    keep = kept_rows(plan, n_rows) if deferred else 0
    later = "after every row's statistics" if two_pass else "in backward"
    if deferred and keep == 0 and plan.stats_first is not None:
        words.append(f"forward: all rows' statistics at once ({_statistics_words(plan.stats_first)})")
    elif two_pass and plan.chunk_grad == EXPONENTIALS:
        words.append("each kept chunk's statistics and exponentials from the fused statistics GEMM (its gradient up "
                     "to a row scale known once every row's statistics are)")
        if keep < n_rows:
            words.append("the other chunks' statistics from " + (
                "the fused statistics GEMM" if plan.forward_logits == FUSED else "a GEMM and the row kernels"))
    elif in_forward and not two_pass and plan.chunk_grad == EXPONENTIALS:
        words.append("each chunk's statistics and kept exponentials from the fused statistics GEMM, which are its "
                     "gradient up to a row scale")
    else:
        words.append("each chunk's logits and statistics from " + (
            "the fused statistics GEMM" if plan.forward_logits == FUSED else "a GEMM and the row kernels"))
        if in_forward and not two_pass:
            words.append("its gradient formed in the forward over its logits")
    if deferred:
        kept = "exponentials" if two_pass and plan.chunk_grad == EXPONENTIALS else "logits"
        rows = "all" if keep == n_rows else f"the first {keep}"
        if keep:
            words.append(f"the {kept} of {rows} rows kept, their gradient formed {later}" if two_pass
                         else f"the logits of {rows} rows kept for backward")
        if keep < n_rows:
            words.append(f"the other chunks recomputed {later} by {_GRADIENT_WORDS[plan.backward_grad]}")
    return "; ".join(words)


_GRADIENT_WORDS = {FUSED: "the fused gradient GEMM", CUBLAS: "a GEMM and the row kernel",
                   None: "a GEMM and the row kernel"}


def _statistics_words(plan: AllRows) -> str:
    if plan.forward_stats == FUSED:
        return "one fused statistics GEMM over the vocabulary"
    return f"vocabulary blocks of {plan.scan_block} columns, each a GEMM and the row kernel"


def chunk_bounds(n_rows: int, tokens_per_chunk: int) -> list[slice]:
    step = max(1, tokens_per_chunk)
    return [slice(s, min(s + step, n_rows)) for s in range(0, n_rows, step)]
