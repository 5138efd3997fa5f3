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
    """How a table (or a piece of one: a sharded table's rows and columns) takes the pooled
    gradient dout (B, w) of its bags (indices, offsets), fused with the sparse backward.

    state_shape(rows, width) / state(rows, width): the state of a (rows, width) piece (None:
    stateless), sharded with the piece's rows (and columns, where it has a column per element).
    update(..., group=): None where the piece holds whole rows; for a column piece, the
    sharding.ColumnGroup of the table's column pieces, which optimizers whose row update needs the
    whole row (needs_group) sum over. Element-wise optimizers ignore it.
    """
    name = "sgd"
    needs_group = False

    def state_shape(self, rows: int, width: int):
        return None

    def state(self, rows: int, width: int):
        shape = self.state_shape(rows, width)
        return None if shape is None else np.zeros(shape, np.float32)

    def update(self, weight, state, indices, offsets, dout, lr, *, group=None, per_sample_weights=None) -> None:
        """SGD (fp32 tables, or bf16 Split-SGD pairs: exact fp32 updates), each lookup in order."""
        ops.embedding_bag_sgd_(weight, indices, offsets, dout, lr, per_sample_weights=per_sample_weights)


class TableAdagrad(TableOptimizer):
    """Element-wise Adagrad: each row's gradient coalesced, then torch.optim.Adagrad's update;
    state (rows, width). Each element's update reads only its own column, so a column piece
    updates alone (no group), bit for bit as the whole table."""
    name = "adagrad"

    def __init__(self, eps: float = DEFAULT_EPS):
        self.eps = float(eps)

    def state_shape(self, rows: int, width: int):
        return (rows, width)

    def update(self, weight, state, indices, offsets, dout, lr, *, group=None, per_sample_weights=None) -> None:
        ops.embedding_bag_adagrad_exact_(weight, state, indices, offsets, dout, lr, self.eps,
                                         per_sample_weights=per_sample_weights)


class RowwiseAdagrad(TableOptimizer):
    """Row-wise Adagrad (ops.embedding_bag_adagrad_'s): state[r] += mean over the row's D columns
    of g**2; w[r] -= lr g / (sqrt(state[r]) + eps); state (rows,). A column piece sees D/k
    columns: the per-row sums of squares are summed over the column group first (in piece order,
    identical on every member), then each piece applies the same row steps to its columns, bit for
    bit as the op on the whole table (fp32 tables)."""
    name = "rowwise_adagrad"
    needs_group = True

    def __init__(self, eps: float = DEFAULT_EPS):
        self.eps = float(eps)

    def state_shape(self, rows: int, width: int):
        return (rows,)

    def update(self, weight, state, indices, offsets, dout, lr, *, group=None, per_sample_weights=None) -> None:
        if group is None:
            ops.embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, self.eps,
                                       per_sample_weights=per_sample_weights)
            return
        rows, drows = ops.embedding_bag_backward(indices, offsets, dout, weight.shape[0],
                                                 per_sample_weights=per_sample_weights)
        g = drows.astype(np.float64)
        sq = group.sum(np.einsum("ij,ij->i", g, g))                # (U,) over all D columns
        s_new = (state[rows].astype(np.float64) + sq / group.dim).astype(np.float32)
        state[rows] = s_new
        step = (np.float32(lr) / (np.sqrt(s_new.astype(np.float64)) + self.eps)).astype(np.float32)
        # w - round(step * g): the fused op's w + round(-step * g), row by row
        ops.embedding_bag_sgd_(weight, rows, np.arange(len(rows), dtype=np.int64), drows, 1.0,
                               per_sample_weights=step)


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
