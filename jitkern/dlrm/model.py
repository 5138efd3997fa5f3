"""DLRM with manual backprop, composed from jitkern.ops only (no element loops here).

One training step is a fixed schedule of stage methods, written once (jitkern.dlrm.stages, a mixin
of DLRM; this module holds construction, checks and the public API); every stage takes the
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

from typing import ClassVar

import numpy as np

from .. import ops
from ..codegen.knobs import Workload
from ..ops.embedding import empty_table
from ..ops.loss import LOSSES
from ..ops.workspace import empty_aligned
from .configs import dlrm_workload, interaction_width
from .model_state import ModelState, SplitWeight, arch_extras
from .optimizers import DEFAULT_EPS, describe, make_optimizers
from .stages import TrainStages
from .step import Buffers, NullTimer, StageTimer, StepContext
from .tables import QR, MDTable, QRTable
from .torchrng import TorchGenerator

__all__ = ["DLRM", "StageTimer", "StepContext", "arch_extras"]

INTERACTIONS = ("dot", "cat", "dcn")
PRECISIONS = ("fp32", "bf16")
ACTIVATIONS = ("relu", "sigmoid")
POOLINGS = (None, "fixed", "learned")
_INIT_CHUNK = 1 << 16          # table rows drawn per call: no float64 copy of a table; cache-sized
_LR_MAX = float(np.finfo(np.float32).max)


class DLRM(TrainStages, ModelState):
    """Deep Learning Recommendation Model (dlrm_s_pytorch.py's).

    embedding_sizes: rows per table (T tables); embedding_dim: D;
    bottom_mlp: [n_dense, ..., D]; top_mlp: [..., 1] without its input width (derived).
    interaction "dot" | "cat" | "dcn" (DLRM-DCNv2: the concatenated (B, (T+1) D) features through
    dcn_layers low-rank cross layers of rank dcn_rank, then the top MLP).
    The reference's options: optimizer "sgd" | "adagrad" | "rwsadagrad" (table_optimizer
    "sgd" | "adagrad" | "rowwise_adagrad" overrides the tables'; eps: Adagrad's), loss "bce" |
    "mse" | "wbce" (loss_weights: w0, w1) with loss_threshold, activation "relu" | "sigmoid"
    (hidden layers), weighted_pooling None | "fixed" | "learned", qr: tables.QR (quotient-
    remainder tables), md_dims: per table None or its mixed-dimension width. init_stream: the
    NumPy stream the parameters are drawn from (default RandomState(seed)).
    precision "fp32" | "bf16": the MLPs' and the interaction's (bf16: GEMMs on bf16 activations and
    Split-pair weights, fp32 accumulation and updates, fp32 logits and loss); embedding_precision:
    the tables' (None: precision).
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
                 self_interaction=False, embedding_precision=None, seed=0, comm=None, optimizer="sgd",
                 table_optimizer=None, eps=DEFAULT_EPS, loss="bce", loss_weights=None, loss_threshold=0.0,
                 activation="relu", weighted_pooling=None, qr=None, md_dims=None, init_stream=None,
                 precision="fp32", dcn_layers=3, dcn_rank=512):
        self.embedding_sizes = [int(r) for r in embedding_sizes]
        self.embedding_dim = int(embedding_dim)
        self.interaction = interaction
        self.dcn_layers, self.dcn_rank = int(dcn_layers), int(dcn_rank)
        self.cross_v, self.cross_w, self.cross_b = [], [], []   # the cross network's (dcn only)
        self.self_interaction = bool(self_interaction)
        self.precision = precision
        self.embedding_precision = precision if embedding_precision is None else embedding_precision
        self.seed = seed
        self.comm = comm
        self.dense_opt, self.table_opt = make_optimizers(optimizer, table_optimizer, eps)
        self.loss, self.loss_weights, self.loss_threshold = loss, loss_weights, float(loss_threshold)
        self.activation, self.weighted_pooling = activation, weighted_pooling
        self.qr, self.md_dims = qr, None if md_dims is None else list(md_dims)
        self._check_options()
        self._check_arch(bottom_mlp, top_mlp)
        self.bottom_mlp = [int(n) for n in bottom_mlp]
        width = interaction_width(self.num_tables, self.feature_dim, interaction, self.self_interaction)
        self.top_mlp = [width] + [int(n) for n in top_mlp]
        self.timer = NullTimer()
        self._buffers: dict[int, Buffers] = {}
        self.pool_w = None                 # learned pooling weights per table (set by _init_parameters)
        self._init_parameters(np.random.RandomState(seed) if init_stream is None else init_stream)
        self._init_optimizer_state()

    # ------------------------------------------------------------------ construction

    def _check_arch(self, bottom_mlp, top_mlp):
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"interaction must be one of {INTERACTIONS}, got {self.interaction!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
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
        if int(bottom_mlp[-1]) != self.feature_dim:
            what = "2 x embedding_dim (qr concat)" if self.feature_dim != self.embedding_dim else "embedding_dim"
            raise ValueError(f"bottom_mlp output {bottom_mlp[-1]} != {what} {self.feature_dim}: "
                             "the interaction needs equal widths")
        if int(top_mlp[-1]) != 1:
            raise ValueError(f"top_mlp must end in 1 output (the click logit), got {top_mlp[-1]}")
        if self.interaction == "dcn" and (self.dcn_layers < 0 or self.dcn_rank < 1):
            raise ValueError(f"dcn needs dcn_layers >= 0 and dcn_rank >= 1, got {self.dcn_layers}, {self.dcn_rank}")

    def _check_options(self):
        """The reference's options: names, and the combinations this model can train."""
        for name, v, allowed in (("activation", self.activation, ACTIVATIONS), ("loss", self.loss, LOSSES),
                                 ("weighted_pooling", self.weighted_pooling, POOLINGS)):
            if v not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {v!r}")
        if not 0.0 <= self.loss_threshold < 1.0:
            raise ValueError(f"loss_threshold must be in [0, 1), got {self.loss_threshold}")
        if (self.loss == "wbce") != (self.loss_weights is not None):
            raise ValueError("loss_weights (w0, w1) go with loss='wbce', and only with it")
        if self.qr is not None and not isinstance(self.qr, QR):
            raise TypeError(f"qr must be a jitkern.dlrm.tables.QR or None, got {type(self.qr).__name__}")
        if self.md_dims is not None:
            if len(self.md_dims) != len(self.embedding_sizes):
                raise ValueError(f"md_dims needs one entry per table ({len(self.embedding_sizes)}), got {len(self.md_dims)}")
            bad = [d for d in self.md_dims if d is not None and not 1 <= int(d) <= self.embedding_dim]
            if bad:
                raise ValueError(f"md_dims widths must be in [1, embedding_dim={self.embedding_dim}], got {bad[0]}")
        if self.qr is not None and self.qr.operation == "concat" and not all(map(self.qr.applies, self.embedding_sizes)):
            raise ValueError(f"qr concat doubles the width of QR tables only: every table needs more than "
                             f"{self.qr.threshold} rows (the qr threshold)")
        if self.weighted_pooling is not None and (self.qr is not None or self.md_dims is not None):
            raise ValueError("weighted_pooling with qr or md tables is not supported (nor by the reference)")
        tricks = self.weighted_pooling is not None or self.qr is not None or self.md_dims is not None
        if self.embedding_precision != "fp32" and (tricks or self.table_opt.name != "sgd"):
            raise ValueError("bf16 Split-SGD tables take SGD only, without qr, md or weighted pooling")
        if self.precision == "bf16" and self.activation != "relu":
            raise ValueError("precision='bf16' runs relu hidden layers (bf16 GEMMs with the ReLU fused), got "
                             f"interaction={self.interaction!r}, "
                             f"activation={self.activation!r}")
        if self.comm is not None and tricks:
            raise NotImplementedError("under MPI the DLRM trains plain tables (by any of its optimizers); qr, md "
                                      "and weighted pooling run in one process")

    @property
    def feature_dim(self) -> int:
        """The width every table pools to and the bottom MLP ends in (2 D for qr concat)."""
        return 2 * self.embedding_dim if self.qr is not None and self.qr.operation == "concat" else self.embedding_dim

    def _init_parameters(self, rs: np.random.RandomState):
        # Reference order and distributions: tables, then bottom, then top MLP. Its QR tables and MD
        # projections draw from torch's stream (emulated), which every table's module consumes from.
        gen = TorchGenerator(int(self.seed)) if (self.qr is not None or self.md_dims is not None) else None
        self.emb = [self._new_table(t, rs, gen) for t in range(self.num_tables)]
        self._init_dense(rs)
        learned = self.weighted_pooling == "learned"
        self.pool_w = [np.ones(r, np.float32) for r in self.embedding_sizes] if learned else None

    def _init_dense(self, rs):
        """The MLPs and the cross network, drawn after the tables in DLRM_DCN's order: dense arch,
        crossnet, over arch."""
        self.bot_w, self.bot_b = self._init_mlp(rs, self.bottom_mlp)
        if self.interaction == "dcn":
            self._init_cross(rs)
        self.top_w, self.top_b = self._init_mlp(rs, self.top_mlp)
        if self.precision == "bf16":            # weights as Split pairs; biases stay fp32 (the epilogue's)
            self.bot_w, self.top_w, self.cross_v, self.cross_w = (
                [SplitWeight(w) for w in ws] for ws in (self.bot_w, self.top_w, self.cross_v, self.cross_w))

    def _new_table(self, t, rs, gen):
        """Table t as the reference builds it: plain, quotient-remainder or mixed-dimension."""
        rows, D = self.embedding_sizes[t], self.embedding_dim
        if self.qr is not None and self.qr.applies(rows):
            low = np.sqrt(1.0 / rows)                   # uniform_(sqrt(1/R), 1): the reference's init
            wq, wr = (gen.uniform(shape, low, 1.0) for shape in QRTable.shapes(rows, D, self.qr))
            return QRTable(rows, D, self.qr, wq, wr)
        d = None if self.md_dims is None else self.md_dims[t]
        if d is None:
            if gen is not None:
                gen.skip_normal((rows, D))              # nn.EmbeddingBag's own init
            return self._init_table(rs, rows)
        gen.skip_normal((rows, d))                      # PrEmbeddingBag: its bag's init, then xavier,
        gen.skip_uniform((rows, d))                     # both overwritten by the NumPy init below
        w = self._init_table(rs, rows, int(d))
        if d == D:
            return w
        gen.skip_uniform((D, d))                        # nn.Linear's kaiming init, then xavier
        return MDTable(w, gen.xavier_uniform((D, int(d))))

    def _init_table(self, rs, rows, width=None):
        width = self.embedding_dim if width is None else width
        w = empty_table(rows, width)  # huge pages where offered: random rows miss the TLB less
        bound = np.sqrt(1.0 / rows)
        for r0 in range(0, rows, _INIT_CHUNK):
            r1 = min(rows, r0 + _INIT_CHUNK)
            w[r0:r1] = rs.uniform(low=-bound, high=bound, size=(r1 - r0, width))
        if self.embedding_precision == "bf16":
            return ops.SplitBF16Table.from_float32(w)
        return w

    def _init_optimizer_state(self):
        """Zero optimizer state for every parameter this process holds (SGD keeps none)."""
        self.opt_state = {}
        for name, p in self.mlp_parameters().items():
            self._add_state(name, self.dense_opt.state(p.shape))
        self._init_table_state()

    def _init_table_state(self):
        """Zero optimizer state of the tables and the pooling weights (a sharded model's pieces hold their own)."""
        for t, w in enumerate(self.emb):
            if isinstance(w, np.ndarray):
                self._add_state(f"emb.{t}.weight", self.table_opt.state(*w.shape))
            elif isinstance(w, QRTable):
                w.init_state(self.table_opt)
            elif isinstance(w, MDTable):
                w.init_state(self.table_opt, self.dense_opt)
        for t, v in enumerate(self.pool_w or ()):
            self._add_state(f"emb.{t}.pool_weight", self.dense_opt.state(v.shape))

    def _add_state(self, name, state):
        if state is not None:
            self.opt_state[name] = state

    def _init_cross(self, rs):
        """TorchRec's LowRankCrossNet init: v (r, n) and w (n, r) xavier-normal, b zero."""
        n, r = self.top_mlp[0], self.dcn_rank
        std = np.sqrt(2.0 / (n + r))
        for _ in range(self.dcn_layers):
            self.cross_v.append(rs.normal(0.0, std, size=(r, n)).astype(np.float32))
            self.cross_w.append(rs.normal(0.0, std, size=(n, r)).astype(np.float32))
            self.cross_b.append(np.zeros(n, np.float32))

    @staticmethod
    def _init_mlp(rs, sizes):
        ws, bs = [], []
        for n, m in zip(sizes[:-1], sizes[1:]):
            w = empty_aligned((m, n))  # a multi-MB weight streams through every step: huge pages
            w[:] = rs.normal(0.0, np.sqrt(2.0 / (m + n)), size=(m, n))
            ws.append(w)
            bs.append(rs.normal(0.0, np.sqrt(1.0 / m), size=m).astype(np.float32))
        return ws, bs

    # ------------------------------------------------------------------ properties, state

    @property
    def num_tables(self) -> int:
        return len(self.embedding_sizes)

    @property
    def num_dense(self) -> int:
        return self.bottom_mlp[0]

    def workload(self, batch: int, threads=(1,), *, pooling: int = 1) -> Workload:
        """The kernels' shapes in one training step at `batch` with `pooling` lookups per table
        and sample: what the tuner tunes for."""
        return dlrm_workload(self.embedding_sizes, self.embedding_dim, self.bottom_mlp, self.top_mlp[1:],
                             batch, threads, pooling=pooling, interaction=self.interaction,
                             self_interaction=self.self_interaction, itemsize=self.table_itemsize,
                             cross=(self.dcn_layers, self.dcn_rank) if self.interaction == "dcn" else None,
                             precision=self.precision)

    @property
    def table_itemsize(self) -> int:
        """Bytes per table element that lookups read (a bf16 split table's high halves: 2)."""
        return 2 if self.embedding_precision == "bf16" else 4

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

    def batch_loss(self, dense, offsets, indices, labels, *, check=True) -> float:
        """The batch-mean loss of one batch (forward only; parameters untouched)."""
        if check:
            self.check_batch(dense, offsets, indices, labels)
        ctx = self.step_context(dense, offsets, indices, labels)
        *_, logits = self._forward_stages(ctx)
        return self.step_loss(ctx, self.loss_forward(ctx, logits)[0])

    def train_step(self, dense, offsets, indices, labels, lr, *, check=True) -> float:
        """Forward, backward and update of every parameter by the model's optimizers; returns the
        batch-mean loss."""
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

    def arch_extras(self) -> dict:
        """What shapes the arrays beyond arch_dict's, for checkpoints: only what differs from plain SGD tables."""
        dcn = (self.dcn_layers, self.dcn_rank) if self.interaction == "dcn" else None
        return arch_extras(optimizer=describe(self.dense_opt, self.table_opt), weighted_pooling=self.weighted_pooling,
                           qr=self.qr, md_dims=self.md_dims, dcn=dcn)

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v in self.arch_extras().items())
        tables = "" if self.embedding_precision == self.precision else \
            f", embedding_precision={self.embedding_precision!r}"
        return (f"DLRM(tables={self.num_tables}, D={self.embedding_dim}, bottom={self.bottom_mlp}, "
                f"top={self.top_mlp}, interaction={self.interaction!r}, self_interaction={self.self_interaction}, "
                f"precision={self.precision!r}{tables}{extra})")
