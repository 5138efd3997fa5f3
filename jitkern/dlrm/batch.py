"""One mini-batch in the DLRM's input format (the reference's X, lS_o, lS_i, T)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    dense: np.ndarray          # (B, n_dense) float32
    offsets: np.ndarray        # (T, B) int64, bag starts per table (lS_o)
    indices: list              # T arrays of int64 (lS_i)
    labels: np.ndarray         # (B,) float32 in [0, 1]

    @property
    def size(self) -> int:
        return self.dense.shape[0]

    @property
    def num_tables(self) -> int:
        return len(self.indices)
