"""What one DLRM step carries through its stages: the context (StepContext), the activation
buffers of a batch size (reused step after step), and the per-stage timer of --profile."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..codegen import host_target
from ..ops import BF16Array
from ..ops.workspace import empty_aligned, staggered_blocks


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


class NullTimer:
    @contextmanager
    def __call__(self, name):
        yield


def _bf16(*shape) -> BF16Array:
    return BF16Array(np.empty(shape, np.uint16))


class Buffers:
    """Activations of one batch size, reused by every step with that size.

    precision "bf16": every MLP activation is a BF16Array but the logits (fp32 for the loss), and
    the bf16 copies of the dense input (dense16) and of the pooled embeddings (ly16) feed the GEMM
    and the interaction."""

    def __init__(self, model, b: int):
        # model: the DLRM (its layer widths, table count and precision)
        self.size = b
        bf16 = model.precision == "bf16"
        act = _bf16 if bf16 else (lambda *shape: empty_aligned(shape))  # tiles' C rows on whole lines
        self.bot = [act(b, n) for n in model.bottom_mlp[1:]]
        self.top = [act(b, n) for n in model.top_mlp[1:-1]] + [empty_aligned((b, model.top_mlp[-1]))]
        # pooled embeddings, one contiguous (B, D) block per table written in place via out=,
        # handed to the interaction as a list of T views (no stacking copy); the blocks on
        # staggered cache sets for the interaction, which reads a sample's row of each together.
        # bf16 models round the whole array into pooled16 in one call, and the interaction reads that
        shape = (model.num_tables, b, model.feature_dim)
        self.pooled = np.empty(shape, np.float32) if bf16 else staggered_blocks(shape[0], shape[1:])
        self.ly = list(self.pooled)
        # the cross network's (dcn): each layer's output x_{l+1} (b, n), u_l (b, r) (bf16 in bf16
        # models: GEMM operands) and y_l + b_l (b, n), kept for the backward
        self.cross_x = [act(b, v.shape[1]) for v in model.cross_v]
        self.cross_u = [act(b, v.shape[0]) for v in model.cross_v]
        self.cross_y = [np.empty((b, v.shape[1]), np.float32) for v in model.cross_v]
        # fp32 ReLU MLPs: a hidden layer's output mask y > 0, written by the forward's epilogue for
        # the backward's dx epilogue, which reads it in place of y (a quarter of the bytes). Only
        # where y outgrows half the L2 (the rest holds the GEMM's blocks): a y that stays cached
        # is read for free, and there writing the mask costs the forward more than it saves.
        def masks(widths):
            if bf16 or model.activation != "relu":
                return None
            return [np.empty((b, n), np.bool_) if b * n * 4 > host_target().l2 // 2 else None for n in widths]
        self.relu_masks = {"bottom": masks(model.bottom_mlp[1:]), "top": masks(model.top_mlp[1:-1])}
        self.zero_labels = np.zeros(b, np.float32)
        self.dense16 = _bf16(b, model.num_dense) if bf16 else None
        self.pooled16 = _bf16(model.num_tables, b, model.feature_dim) if bf16 else None
        self.ly16 = [self.pooled16[t] for t in range(model.num_tables)] if bf16 else None
        self._act, self._grads = act, {}

    def grads(self, mlp: str, layer: int, shape: tuple, need_dx: bool) -> tuple:
        """(out_dx, out_dw) of one MLP layer's backward (shape: its weight's (out, in)); dx of the
        activations' type, None without need_dx. Made at first use: inference never needs them."""
        key = (mlp, layer, need_dx)
        got = self._grads.get(key)
        if got is None:
            dx = self._act(self.size, shape[1]) if need_dx else None
            got = self._grads[key] = (dx, empty_aligned(shape))  # written whole every step, as the weight
        return got


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
    buf: Buffers
    logits: np.ndarray | None = None      # set by loss_forward (the general losses' backward reads them)
    psw: list | None = None               # learned pooling: each table's per-lookup weights
    cross_x0: np.ndarray | None = None    # dcn: the cross network's input (b, n)
    cross_grads: list | None = None       # dcn: (dv, dw, db) per cross layer
