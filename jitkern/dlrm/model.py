"""DLRM with manual backprop, composed from jitkern.ops only (no element loops here).

One training step is a fixed schedule of stage methods, written once here; every stage takes the
step's context (StepContext: this process's rows, the batch's lookups, buffers, and whatever a
subclass carries from one stage to a later one) and explicit arrays:

    embedding_forward_start -> bottom_forward -> embedding_forward -> interaction_forward
    -> top_forward -> loss_forward -> loss_backward -> top_backward -> interaction_backward
    -> embedding_backward_start -> bottom_backward -> embedding_update -> dense_update

The `*_start` stages and the `layer_done` hook do nothing in one process; the hybrid-parallel
DLRM (jitkern.dlrm.dist) overrides them and the stages that communicate, so its exchanges overlap
the MLPs. Activation buffers are allocated once per batch size and reused across steps; the
tables are never copied (state_dict returns the live fp32 arrays, as torch's does).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .. import ops
from ..codegen.knobs import Workload
from ..ops.embedding import empty_table
from .configs import dlrm_workload, interaction_width

INTERACTIONS = ("dot", "cat")
PRECISIONS = ("fp32", "bf16")
_INIT_CHUNK = 1 << 16          # table rows drawn per call: no float64 copy of a table; cache-sized
_LR_MAX = float(np.finfo(np.float32).max)


class StageTimer:
    """Accumulated wall time per stage name (the trainer's --profile table); clock: another clock
    (time.thread_time: this thread's CPU time, what a stage costs on a core of its own)."""

    def __init__(self, clock=time.perf_counter):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.clock = clock

    @contextmanager
    def __call__(self, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class _NullTimer:
    @contextmanager
    def __call__(self, name):
        yield


class _Buffers:
    """Activations of one batch size, reused by every step with that size."""

    def __init__(self, model: "DLRM", b: int):
        self.size = b
        self.bot = [np.empty((b, n), np.float32) for n in model.bottom_mlp[1:]]
        self.top = [np.empty((b, n), np.float32) for n in model.top_mlp[1:]]
        # pooled embeddings, one contiguous (B, D) block per table written in place via out=,
        # handed to the interaction as a list of T views (no stacking copy)
        self.pooled = np.empty((model.num_tables, b, model.embedding_dim), np.float32)
        self.ly = list(self.pooled)
        self.zero_labels = np.zeros(b, np.float32)


@dataclass
class StepContext:
    """What one forward or training step passes through its stages.

    dense, labels: the rows this process runs the MLPs on ((b, n_dense), (b,); labels None in
    inference); offsets, indices: the lookups of the whole batch ((T, B), T arrays); lr: None in
    inference; buf: the activation buffers for b rows.
    """
    dense: np.ndarray
    offsets: np.ndarray
    indices: list
    labels: np.ndarray | None
    lr: float | None
    buf: _Buffers


class DLRM:
    """Deep Learning Recommendation Model (dlrm_s_pytorch.py's), trained by plain SGD.

    embedding_sizes: rows per table (T tables); embedding_dim: D;
    bottom_mlp: [n_dense, ..., D]; top_mlp: [..., 1] without its input width (derived).
    """

    # the subclass that serves DLRM(..., comm=...): it declares itself with `comm_variant=True`
    # (jitkern.dlrm.dist, which jitkern.dlrm imports), so this module never imports it
    _comm_variant: ClassVar[type | None] = None

    def __init_subclass__(cls, *, comm_variant: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if comm_variant:
            DLRM._comm_variant = cls

    def __new__(cls, *args, comm=None, **kwargs):
        if comm is not None and cls is DLRM:
            if DLRM._comm_variant is None:
                raise NotImplementedError(
                    "DLRM(comm=...) needs the hybrid-parallel model jitkern.dlrm.dist.DistributedDLRM, "
                    "which is not loaded (import jitkern.dlrm.dist); use comm=None for one process")
            return super().__new__(DLRM._comm_variant)     # Python then runs its __init__
        return super().__new__(cls)

    def __init__(self, embedding_sizes, embedding_dim, bottom_mlp, top_mlp, *, interaction="dot",
                 self_interaction=False, embedding_precision="fp32", seed=0, comm=None):
        self.embedding_sizes = [int(r) for r in embedding_sizes]
        self.embedding_dim = int(embedding_dim)
        self.interaction = interaction
        self.self_interaction = bool(self_interaction)
        self.embedding_precision = embedding_precision
        self.seed = seed
        self.comm = comm
        self._check_arch(bottom_mlp, top_mlp)
        self.bottom_mlp = [int(n) for n in bottom_mlp]
        width = interaction_width(self.num_tables, self.embedding_dim, interaction, self.self_interaction)
        self.top_mlp = [width] + [int(n) for n in top_mlp]
        self.timer = _NullTimer()
        self._buffers: dict[int, _Buffers] = {}
        self._init_parameters(np.random.RandomState(seed))

    # ------------------------------------------------------------------ construction

    def _check_arch(self, bottom_mlp, top_mlp):
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.embedding_precision not in PRECISIONS:
            raise ValueError(f"embedding_precision must be one of {PRECISIONS}, got {self.embedding_precision!r}")
        if not self.embedding_sizes:
            raise ValueError("embedding_sizes must name at least one table")
        for t, r in enumerate(self.embedding_sizes):
            if r < 1:
                raise ValueError(f"embedding_sizes[{t}] (table {t}) must be >= 1 rows, got {r}")
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {self.embedding_dim}")
        if len(bottom_mlp) < 2 or len(top_mlp) < 1:
            raise ValueError("bottom_mlp needs [n_dense, ..., D] (>= 2 sizes), top_mlp at least [1]")
        if any(int(n) < 1 for n in list(bottom_mlp) + list(top_mlp)):
            raise ValueError(f"layer sizes must be >= 1: bottom {list(bottom_mlp)}, top {list(top_mlp)}")
        if int(bottom_mlp[-1]) != self.embedding_dim:
            raise ValueError(f"bottom_mlp output {bottom_mlp[-1]} != embedding_dim {self.embedding_dim}: "
                             "the interaction needs equal widths")
        if int(top_mlp[-1]) != 1:
            raise ValueError(f"top_mlp must end in 1 output (the click logit), got {top_mlp[-1]}")

    def _init_parameters(self, rs: np.random.RandomState):
        # Reference order and distributions: tables, then bottom, then top MLP.
        self.emb = [self._init_table(rs, r) for r in self.embedding_sizes]
        self.bot_w, self.bot_b = self._init_mlp(rs, self.bottom_mlp)
        self.top_w, self.top_b = self._init_mlp(rs, self.top_mlp)

    def _init_table(self, rs, rows):
        w = empty_table(rows, self.embedding_dim)  # huge pages where offered: random rows miss the TLB less
        bound = np.sqrt(1.0 / rows)
        for r0 in range(0, rows, _INIT_CHUNK):
            r1 = min(rows, r0 + _INIT_CHUNK)
            w[r0:r1] = rs.uniform(low=-bound, high=bound, size=(r1 - r0, self.embedding_dim))
        if self.embedding_precision == "bf16":
            return ops.SplitBF16Table.from_float32(w)
        return w

    @staticmethod
    def _init_mlp(rs, sizes):
        ws, bs = [], []
        for n, m in zip(sizes[:-1], sizes[1:]):
            ws.append(rs.normal(0.0, np.sqrt(2.0 / (m + n)), size=(m, n)).astype(np.float32))
            bs.append(rs.normal(0.0, np.sqrt(1.0 / m), size=m).astype(np.float32))
        return ws, bs

    # ------------------------------------------------------------------ properties, state

    @property
    def num_tables(self) -> int:
        return len(self.embedding_sizes)

    @property
    def num_dense(self) -> int:
        return self.bottom_mlp[0]

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this process holds (a bf16 split table counts both halves)."""
        dense = sum(a.nbytes for a in self.bot_w + self.bot_b + self.top_w + self.top_b)
        return dense + sum(_table_nbytes(w) for w in self.emb if w is not None)

    def workload(self, batch: int, threads=(1,), *, pooling: int = 1) -> Workload:
        """The kernels' shapes in one training step at `batch` with `pooling` lookups per table
        and sample: what the tuner tunes for."""
        return dlrm_workload(self.embedding_sizes, self.embedding_dim, self.bottom_mlp, self.top_mlp[1:],
                             batch, threads, pooling=pooling, interaction=self.interaction,
                             self_interaction=self.self_interaction, itemsize=self.table_itemsize)

    @property
    def table_itemsize(self) -> int:
        """Bytes per table element that lookups read (a bf16 split table's high halves: 2)."""
        return 2 if self.embedding_precision == "bf16" else 4

    def mlp_state_dict(self) -> dict:
        """name -> live array of every MLP weight and bias."""
        sd = {}
        for prefix, ws, bs in (("bot", self.bot_w, self.bot_b), ("top", self.top_w, self.top_b)):
            for l, (w, b) in enumerate(zip(ws, bs)):
                sd[f"{prefix}.{l}.weight"] = w
                sd[f"{prefix}.{l}.bias"] = b
        return sd

    def state_dict(self) -> dict:
        """name -> array; fp32 tables and all MLP arrays are the live parameters (no copies)."""
        sd = {f"emb.{t}.weight": w if isinstance(w, np.ndarray) else w.to_float32() for t, w in enumerate(self.emb)}
        sd.update(self.mlp_state_dict())
        return sd

    def table_regions(self) -> dict:
        """table -> (r0, r1, c0, c1): the rows and columns of it this process holds (all, here)."""
        return {t: (0, r, 0, self.embedding_dim) for t, r in enumerate(self.embedding_sizes)}

    def saves_region(self, t: int) -> bool:
        """Whether this process writes its region of table t to a sharded checkpoint."""
        return True

    def read_region(self, t: int) -> np.ndarray:
        """Table t's region as fp32 (the live table where it is fp32)."""
        w = self.emb[t]
        return w if isinstance(w, np.ndarray) else w.to_float32()

    def write_region(self, t: int, block) -> None:
        """Set table t's region from an fp32 block of its shape."""
        if isinstance(self.emb[t], np.ndarray):
            np.copyto(self.emb[t], block)
        else:
            self.emb[t] = ops.SplitBF16Table.from_float32(np.ascontiguousarray(block, np.float32))

    def state_shapes(self) -> dict:
        """name -> shape of every parameter (what load_state_dict expects), without building copies."""
        shapes = {f"emb.{t}.weight": (r, self.embedding_dim) for t, r in enumerate(self.embedding_sizes)}
        for prefix, sizes in (("bot", self.bottom_mlp), ("top", self.top_mlp)):
            for l, (n, m) in enumerate(zip(sizes[:-1], sizes[1:])):
                shapes[f"{prefix}.{l}.weight"] = (m, n)
                shapes[f"{prefix}.{l}.bias"] = (m,)
        return shapes

    def load_state_dict(self, sd: dict) -> None:
        """Copy every parameter from `sd` (the full model) after checking names, dtypes and shapes,
        all before any copy; tables this process does not hold are skipped."""
        shapes = self.state_shapes()
        missing = sorted(set(shapes) - set(sd))
        extra = sorted(set(sd) - set(shapes))
        if missing or extra:
            raise KeyError(f"state_dict does not match this model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in shapes.items():
            a = sd[name]
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise TypeError(f"state_dict[{name!r}] must be a float32 ndarray, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")
            if a.shape != shape:
                raise ValueError(f"state_dict[{name!r}] has shape {a.shape}, expected {shape}")
        self.load_local(sd)

    def load_local(self, sd: dict) -> None:
        """Copy the given, already checked arrays into the parameters; tables this process does not
        hold are ignored (a sharded checkpoint gives each rank only its own)."""
        for name, a in sd.items():
            kind, idx, what = name.split(".")
            if kind == "emb":
                t = int(idx)
                if isinstance(self.emb[t], np.ndarray):
                    np.copyto(self.emb[t], a)
                elif self.emb[t] is not None:
                    self.emb[t] = ops.SplitBF16Table.from_float32(a)
            else:
                ws, bs = (self.bot_w, self.bot_b) if kind == "bot" else (self.top_w, self.top_b)
                np.copyto((ws if what == "weight" else bs)[int(idx)], a)

    # ------------------------------------------------------------------ input checks

    def check_batch(self, dense, offsets, indices, labels=None):
        """Validate one batch; raises a one-line error naming the table/feature and sample."""
        if not isinstance(dense, np.ndarray) or dense.ndim != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (B, {self.num_dense}), got {getattr(dense, 'shape', type(dense))}")
        b = dense.shape[0]
        if b < 1:
            raise ValueError("empty batch (B = 0)")
        if dense.dtype != np.float32:
            raise TypeError(f"dense must be float32, got {dense.dtype}")
        if not np.isfinite(dense).all():
            row, col = np.argwhere(~np.isfinite(dense))[0]
            raise ValueError(f"dense feature {col} of sample {row} is {dense[row, col]} (not finite)")
        offsets = np.asarray(offsets)
        if offsets.shape != (self.num_tables, b) or offsets.dtype != np.int64:
            raise ValueError(f"offsets must be ({self.num_tables}, {b}) int64, got {offsets.shape} {offsets.dtype}")
        if len(indices) != self.num_tables:
            raise ValueError(f"indices must hold {self.num_tables} arrays (one per table), got {len(indices)}")
        for t, (idx, rows) in enumerate(zip(indices, self.embedding_sizes)):
            self._check_table_input(t, offsets[t], idx, rows)
        if labels is not None:
            labels = np.asarray(labels)
            if labels.shape != (b,) or labels.dtype != np.float32:
                raise ValueError(f"labels must be ({b},) float32, got {labels.shape} {labels.dtype}")
            bad = ~((labels >= 0) & (labels <= 1))
            if bad.any():
                row = int(np.argmax(bad))
                raise ValueError(f"label of sample {row} is {labels[row]}, outside [0, 1]")

    @staticmethod
    def _check_table_input(t, off, idx, rows):
        if not isinstance(idx, np.ndarray) or idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(f"indices[{t}] (table {t}) must be a 1-D integer array")
        nnz = len(idx)
        if off[0] != 0 or (len(off) > 1 and (np.diff(off) < 0).any()) or off[-1] > nnz:
            raise ValueError(f"offsets[{t}] (table {t}) must start at 0, not decrease, and stay <= {nnz}")
        if nnz == 0:
            return
        lo, hi = idx.min(), idx.max()
        if lo < 0 or hi >= rows:
            pos = int(np.argmax((idx < 0) | (idx >= rows)))
            sample = int(np.searchsorted(off, pos, side="right") - 1)
            raise IndexError(f"table {t}: index {idx[pos]} of sample {sample} (position {pos}) is out of "
                             f"range [0, {rows})")

    # ------------------------------------------------------------------ stages (forward)

    def _buffers_for(self, b: int) -> _Buffers:
        buf = self._buffers.get(b)
        if buf is None:
            if len(self._buffers) >= 2:        # train + eval sizes; drop the oldest otherwise
                self._buffers.pop(next(iter(self._buffers)))
            buf = self._buffers[b] = _Buffers(self, b)
        return buf

    def step_context(self, dense, offsets, indices, labels=None, lr=None) -> StepContext:
        """The context of one step on this batch (one process: all its rows)."""
        return StepContext(dense, offsets, indices, labels, lr, self._buffers_for(dense.shape[0]))

    def embedding_forward_start(self, ctx: StepContext) -> None:
        """Embedding work that can run ahead of the bottom MLP and overlap it (one process: none)."""

    def bottom_forward(self, ctx: StepContext):
        """x = bottom MLP(dense); dense: (b, n_dense) -> x: (b, D), ReLU after every layer."""
        with self.timer("bottom_fwd"):
            h = ctx.dense
            for w, b, out in zip(self.bot_w, self.bot_b, ctx.buf.bot):
                h = ops.linear_forward(h, w, b, activation="relu", out=out)
                self.layer_done(ctx, "bottom", None)
            return h

    def embedding_forward(self, ctx: StepContext) -> list:
        """ly[t] = sum-pooled rows of table t for this process's rows; -> ly: T arrays (b, D)."""
        with self.timer("embedding_fwd"):
            for t, w in enumerate(self.emb):
                ops.embedding_bag_forward(w, ctx.indices[t], ctx.offsets[t], out=ctx.buf.ly[t])
            return ctx.buf.ly

    def interaction_forward(self, ctx: StepContext, x, ly):
        """z: (b, top_mlp[0]) from x: (b, D) and ly: T arrays (b, D)."""
        with self.timer("interaction"):
            if self.interaction == "dot":
                return ops.interaction_dot_forward(x, ly, self_interaction=self.self_interaction)
            return ops.interaction_cat_forward(x, ly)

    def top_forward(self, ctx: StepContext, z):
        """logits: (b,) from z; ReLU on hidden layers, none on the last (the loss applies sigmoid)."""
        with self.timer("top_fwd"):
            h = z
            last = len(self.top_w) - 1
            for l, (w, b, out) in enumerate(zip(self.top_w, self.top_b, ctx.buf.top)):
                h = ops.linear_forward(h, w, b, activation=None if l == last else "relu", out=out)
            return h.reshape(-1)

    def loss_forward(self, ctx: StepContext, logits):
        """(batch-mean BCE loss of this process's rows, probs (b,)) from logits; inference: probs only."""
        labels = ctx.buf.zero_labels if ctx.labels is None else ctx.labels
        with self.timer("loss"):
            return ops.sigmoid_bce_forward(logits, labels)

    # ------------------------------------------------------------------ stages (backward, update)

    def loss_backward(self, ctx: StepContext, probs):
        """dloss/dlogits: (b,)."""
        with self.timer("loss"):
            return ops.sigmoid_bce_backward(probs, ctx.labels)

    def top_backward(self, ctx: StepContext, dlogits, z):
        """Top MLP backward; -> (dz, [(dw, db) per layer])."""
        with self.timer("top_bwd"):
            dy = dlogits.reshape(-1, 1)
            grads = [None] * len(self.top_w)
            last = len(self.top_w) - 1
            for l in range(last, -1, -1):
                x = z if l == 0 else ctx.buf.top[l - 1]
                act = None if l == last else "relu"
                dy, dw, db = ops.linear_backward(dy, x, self.top_w[l], ctx.buf.top[l], activation=act)
                grads[l] = (dw, db)
                self.layer_done(ctx, "top", (l, dw, db))
            return dy, grads

    def interaction_backward(self, ctx: StepContext, dz, x, ly):
        """-> (dx (b, D), dly (b, T, D))."""
        with self.timer("interaction"):
            if self.interaction == "dot":
                return ops.interaction_dot_backward(dz, x, ly, self_interaction=self.self_interaction)
            return ops.interaction_cat_backward(dz, x, ly)

    def embedding_backward_start(self, ctx: StepContext, dly) -> None:
        """Embedding-gradient work that can run ahead of the bottom MLP backward and overlap it
        (one process: none; embedding_update fuses the backward into the update)."""

    def bottom_backward(self, ctx: StepContext, dx):
        """Bottom MLP backward; -> [(dw, db) per layer] (the gradient w.r.t. dense is not needed)."""
        with self.timer("bottom_bwd"):
            dy = dx
            grads = [None] * len(self.bot_w)
            for l in range(len(self.bot_w) - 1, -1, -1):
                x = ctx.dense if l == 0 else ctx.buf.bot[l - 1]
                dy, dw, db = ops.linear_backward(dy, x, self.bot_w[l], ctx.buf.bot[l], activation="relu",
                                                 need_dx=l > 0)
                grads[l] = (dw, db)
                self.layer_done(ctx, "bottom", (l, dw, db))
            return grads

    def layer_done(self, ctx: StepContext, mlp: str, grads) -> None:
        """Called after each MLP layer ("bottom" or "top"; grads None in forward, (layer, dw, db) in
        backward): where the distributed model progresses and buckets its communication."""

    def embedding_update(self, ctx: StepContext, dly) -> None:
        """Fused sparse backward + SGD per table: each lookup's gradient applied to its row in place."""
        with self.timer("embedding_upd"):
            for t, w in enumerate(self.emb):
                ops.embedding_bag_sgd_(w, ctx.indices[t], ctx.offsets[t], dly[:, t], ctx.lr)

    def dense_update(self, ctx: StepContext, bot_grads, top_grads) -> None:
        """Plain SGD on every MLP weight and bias."""
        with self.timer("dense_upd"):
            for ws, bs, grads in ((self.bot_w, self.bot_b, bot_grads), (self.top_w, self.top_b, top_grads)):
                for w, b, (dw, db) in zip(ws, bs, grads):
                    ops.sgd_(w, dw, ctx.lr)
                    ops.sgd_(b, db, ctx.lr)

    def step_loss(self, ctx: StepContext, loss) -> float:
        """The batch-mean loss train_step returns."""
        return float(loss)

    def forward_result(self, ctx: StepContext, probs):
        """The click probabilities of the whole batch that forward returns."""
        return probs

    # ------------------------------------------------------------------ public API

    def _forward_stages(self, ctx: StepContext):
        """-> (x, ly, z, logits) of this process's rows."""
        self.embedding_forward_start(ctx)
        x = self.bottom_forward(ctx)
        ly = self.embedding_forward(ctx)
        z = self.interaction_forward(ctx, x, ly)
        return x, ly, z, self.top_forward(ctx, z)

    def forward(self, dense, offsets, indices, *, check=True):
        """Click probabilities (B,) float32 for one batch (inference; parameters untouched)."""
        if check:
            self.check_batch(dense, offsets, indices)
        ctx = self.step_context(dense, offsets, indices)
        *_, logits = self._forward_stages(ctx)
        _, probs = self.loss_forward(ctx, logits)
        return self.forward_result(ctx, probs)

    def _check_step(self, dense, offsets, indices, labels, lr, check) -> float:
        """Validate a training batch (unless check=False) and the learning rate; -> lr as float."""
        if check:
            self.check_batch(dense, offsets, indices, labels)
        lr = float(lr)
        if not (0 <= lr <= _LR_MAX):                 # NaN fails too
            raise ValueError(f"lr must be finite and >= 0 (in float32, the precision updates apply it in), "
                             f"got {lr}")
        return lr

    def train_step(self, dense, offsets, indices, labels, lr, *, check=True) -> float:
        """Forward, backward and SGD update of every parameter; returns the batch-mean BCE loss."""
        lr = self._check_step(dense, offsets, indices, labels, lr, check)
        ctx = self.step_context(dense, offsets, indices, labels, lr)
        x, ly, z, logits = self._forward_stages(ctx)
        loss, probs = self.loss_forward(ctx, logits)
        dlogits = self.loss_backward(ctx, probs)
        dz, top_grads = self.top_backward(ctx, dlogits, z)
        dx, dly = self.interaction_backward(ctx, dz, x, ly)
        self.embedding_backward_start(ctx, dly)
        bot_grads = self.bottom_backward(ctx, dx)
        self.embedding_update(ctx, dly)
        self.dense_update(ctx, bot_grads, top_grads)
        return self.step_loss(ctx, loss)

    def __repr__(self):
        return (f"DLRM(tables={self.num_tables}, D={self.embedding_dim}, bottom={self.bottom_mlp}, "
                f"top={self.top_mlp}, interaction={self.interaction!r}, self_interaction={self.self_interaction}, "
                f"precision={self.embedding_precision!r})")


def _table_nbytes(w) -> int:
    if isinstance(w, np.ndarray):
        return w.nbytes
    return w.hi.nbytes + w.lo.nbytes
