"""Embedding tables other than one (R, D) array: the reference DLRM's tricks/.

- Quotient-remainder (Shi et al., "Compositional Embeddings Using Complementary Partitions",
  KDD 2020; the reference's QREmbeddingBag): id i reads row i // c of a quotient table
  (ceil(R / c) rows) and row i % c of a remainder table (c rows); the two pooled vectors are
  combined by mult, add or concat (concat doubles the width). The reference computes i / c in
  float32 and truncates; for ids below 2**24 that is i // c, which this uses for every id.
- Mixed dimensions (Ginart et al., "Mixed Dimension Embeddings with Application to
  Memory-Efficient Recommendation Systems", 2019; the reference's md_solver and PrEmbeddingBag):
  table t has width d_t from a power law in its row count, and a (D, d_t) projection, no bias,
  brings its pooled rows to D.

Each table pools with forward(indices, offsets, out) and takes its gradient with
update(indices, offsets, dout, lr, table_opt, dense_opt) after a forward of the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import ops

QR_OPERATIONS = ("mult", "add", "concat")


@dataclass(frozen=True)
class QR:
    """Quotient-remainder tables for every table with more than `threshold` rows."""
    threshold: int = 200
    collisions: int = 4
    operation: str = "mult"

    def __post_init__(self):
        if self.operation not in QR_OPERATIONS:
            raise ValueError(f"qr operation must be one of {QR_OPERATIONS}, got {self.operation!r}")
        if self.collisions < 1:
            raise ValueError(f"qr collisions must be >= 1, got {self.collisions}")

    def applies(self, rows: int) -> bool:
        return rows > self.threshold


class QRTable:
    """A quotient-remainder table: weight_q (ceil(R / c), D), weight_r (c, D); pools to (B, D),
    or (B, 2 D) for concat. Its state arrays are the table optimizer's, one per weight."""

    def __init__(self, rows: int, dim: int, qr: QR, weight_q, weight_r):
        self.rows, self.dim, self.c, self.operation = rows, dim, qr.collisions, qr.operation
        self.weight_q, self.weight_r = weight_q, weight_r
        self.state_q = self.state_r = None
        self._last = None              # (iq, ir, pooled q, pooled r) of the last forward

    @staticmethod
    def shapes(rows: int, dim: int, qr: QR):
        return (-(-rows // qr.collisions), dim), (qr.collisions, dim)

    @property
    def width(self) -> int:
        return 2 * self.dim if self.operation == "concat" else self.dim

    def arrays(self) -> dict:
        return {"weight_q": self.weight_q, "weight_r": self.weight_r}

    def states(self) -> dict:
        return {k: v for k, v in (("weight_q", self.state_q), ("weight_r", self.state_r)) if v is not None}

    def init_state(self, table_opt) -> None:
        self.state_q = table_opt.state(*self.weight_q.shape)
        self.state_r = table_opt.state(*self.weight_r.shape)

    def forward(self, indices, offsets, out) -> None:
        """out (B, width) = the combined pooled quotient and remainder rows."""
        idx = np.asarray(indices, np.int64)
        iq, ir = idx // self.c, idx % self.c
        pq = ops.embedding_bag_forward(self.weight_q, iq, offsets)
        pr = ops.embedding_bag_forward(self.weight_r, ir, offsets)
        if self.operation == "mult":
            np.multiply(pq, pr, out=out)
        elif self.operation == "add":
            np.add(pq, pr, out=out)
        else:
            out[:, :self.dim], out[:, self.dim:] = pq, pr
        self._last = (iq, ir, pq, pr)

    def update(self, indices, offsets, dout, lr, table_opt, dense_opt) -> None:
        """Both tables take their share of dout (B, width), the gradient of the last forward."""
        iq, ir, pq, pr = self._last
        if self.operation == "mult":
            dq, dr = dout * pr, dout * pq
        elif self.operation == "add":
            dq = dr = dout
        else:
            dq, dr = dout[:, :self.dim], dout[:, self.dim:]
        table_opt.update(self.weight_q, self.state_q, iq, offsets, np.ascontiguousarray(dq), lr)
        table_opt.update(self.weight_r, self.state_r, ir, offsets, np.ascontiguousarray(dr), lr)
        self._last = None


class MDTable:
    """A mixed-dimension table: weight (R, d), projection proj (D, d) (nn.Linear's layout, no bias)."""

    def __init__(self, weight, proj):
        self.weight, self.proj = weight, proj
        self.state = self.proj_state = None
        self._pooled = None

    @property
    def width(self) -> int:
        return self.proj.shape[0]

    def arrays(self) -> dict:
        return {"weight": self.weight, "proj": self.proj}

    def states(self) -> dict:
        return {k: v for k, v in (("weight", self.state), ("proj", self.proj_state)) if v is not None}

    def init_state(self, table_opt, dense_opt) -> None:
        self.state = table_opt.state(*self.weight.shape)
        self.proj_state = dense_opt.state(self.proj.shape)

    def forward(self, indices, offsets, out) -> None:
        self._pooled = ops.embedding_bag_forward(self.weight, indices, offsets)
        ops.linear_forward(self._pooled, self.proj, None, out=out)

    def update(self, indices, offsets, dout, lr, table_opt, dense_opt) -> None:
        dout = np.ascontiguousarray(dout)
        dpooled, dproj, _ = ops.linear_backward(dout, self._pooled, self.proj)
        table_opt.update(self.weight, self.state, indices, offsets, dpooled, lr)
        dense_opt.step(self.proj, self.proj_state, dproj, lr)
        self._pooled = None


def md_solver(rows, alpha: float, d0: int, round_dims: bool = False) -> list:
    """Widths per table by the reference's md_solver: d_t = d0 * (R_min / R_t) ** alpha in float32
    (the smallest table gets d0, none less than 1), rounded; with round_dims to a power of 2."""
    n = np.asarray(rows, np.int64)
    order = np.argsort(n, kind="stable")
    ns = n[order].astype(np.float32)
    a = np.float32(alpha)
    lamb = np.float32(d0) * ns[0] ** a
    d = np.float32(1.0) * lamb * ns ** -a
    d[0] = d0
    d = np.where(d < 1, np.float32(1.0), d)
    d = np.round(d).astype(np.int64)
    if round_dims:
        d = (2.0 ** np.round(np.log2(d.astype(np.float32)))).astype(np.int64)
    out = np.empty_like(d)
    out[order] = d
    return [int(v) for v in out]
