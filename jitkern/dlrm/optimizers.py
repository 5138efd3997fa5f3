"""Optimizers of the DLRM: a dense one for the MLPs (and other dense parameters), a fused sparse
one for the tables, each with the state it keeps per parameter (checkpointed with the model).

    --optimizer   dense      tables
    sgd           SGD        SGD (each lookup's gradient applied in order)
    adagrad       Adagrad    Adagrad, element-wise (torch.optim.Adagrad on a sparse gradient)
    rwsadagrad    Adagrad    row-wise Adagrad (the reference's RWSAdagrad)

Adagrad is torch.optim.Adagrad's (lr_decay 0, initial accumulator 0): sum += g*g,
p -= lr * g / (sqrt(sum) + eps), eps 1e-10 by default as torch's.
"""
from __future__ import annotations

import numpy as np

from .. import ops

OPTIMIZERS = ("sgd", "adagrad", "rwsadagrad")
TABLE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DEFAULT_EPS = 1e-10                 # torch.optim.Adagrad's and the reference's RWSAdagrad's


class DenseOptimizer:
    """How a dense parameter takes its gradient. state(shape): its state (None: stateless)."""
    name = "sgd"

    def state(self, shape):
        return None

    def step(self, param, state, grad, lr) -> None:
        ops.sgd_(param, grad, lr)


class DenseAdagrad(DenseOptimizer):
    """torch.optim.Adagrad on a dense parameter; state: the sum of squared gradients."""
    name = "adagrad"

    def __init__(self, eps: float = DEFAULT_EPS):
        self.eps = float(eps)

    def state(self, shape):
        return np.zeros(shape, np.float32)

    def step(self, param, state, grad, lr) -> None:
        ops.adagrad_(param, state, grad, lr, self.eps)


class TableOptimizer:
    """How a table takes the pooled gradient dout (B, D) of its bags (indices, offsets), fused
    with the sparse backward. state(rows, width): its state (None: stateless). needs_group:
    whether a column piece's update needs the other column pieces (a sharded table)."""
    name = "sgd"
    needs_group = False

    def state(self, rows: int, width: int):
        return None

    def update(self, weight, state, indices, offsets, dout, lr, *, per_sample_weights=None) -> None:
        ops.embedding_bag_sgd_(weight, indices, offsets, dout, lr, per_sample_weights=per_sample_weights)


class TableAdagrad(TableOptimizer):
    """Element-wise Adagrad: each row's gradient coalesced, then torch.optim.Adagrad's update;
    state (rows, width)."""
    name = "adagrad"

    def __init__(self, eps: float = DEFAULT_EPS):
        self.eps = float(eps)

    def state(self, rows: int, width: int):
        return np.zeros((rows, width), np.float32)

    def update(self, weight, state, indices, offsets, dout, lr, *, per_sample_weights=None) -> None:
        ops.embedding_bag_adagrad_exact_(weight, state, indices, offsets, dout, lr, self.eps,
                                         per_sample_weights=per_sample_weights)


class RowwiseAdagrad(TableOptimizer):
    """Row-wise Adagrad: state[r] += mean of the row's coalesced g**2; w[r] -= lr g / (sqrt(state[r]) + eps)."""
    name = "rowwise_adagrad"
    needs_group = True

    def __init__(self, eps: float = DEFAULT_EPS):
        self.eps = float(eps)

    def state(self, rows: int, width: int):
        return np.zeros(rows, np.float32)

    def update(self, weight, state, indices, offsets, dout, lr, *, per_sample_weights=None) -> None:
        ops.embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, self.eps,
                                   per_sample_weights=per_sample_weights)


_DENSE = {"sgd": DenseOptimizer, "adagrad": DenseAdagrad, "rwsadagrad": DenseAdagrad}
_TABLE = {"sgd": TableOptimizer, "adagrad": TableAdagrad, "rowwise_adagrad": RowwiseAdagrad}
_TABLE_OF = {"sgd": "sgd", "adagrad": "adagrad", "rwsadagrad": "rowwise_adagrad"}


def make_optimizers(optimizer: str = "sgd", table_optimizer: str | None = None, eps: float = DEFAULT_EPS):
    """(dense, table) optimizers for --optimizer; table_optimizer overrides the tables' (None:
    the one --optimizer implies)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    table = _TABLE_OF[optimizer] if table_optimizer is None else table_optimizer
    if table not in TABLE_OPTIMIZERS:
        raise ValueError(f"table_optimizer must be one of {TABLE_OPTIMIZERS} (or None), got {table_optimizer!r}")
    eps = float(eps)
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    dense_cls, table_cls = _DENSE[optimizer], _TABLE[table]
    dense = dense_cls(eps) if dense_cls is not DenseOptimizer else dense_cls()
    return dense, (table_cls(eps) if table_cls is not TableOptimizer else table_cls())


def describe(dense: DenseOptimizer, table: TableOptimizer) -> str:
    """The pair's name as checkpoints record it ("sgd" for plain SGD)."""
    return "sgd" if dense.name == table.name == "sgd" else f"{dense.name}/{table.name}"
