"""Fused embedding-bag element-wise Adagrad (FBGEMM's EXACT_ADAGRAD, what TorchRec runs for
torch.optim.Adagrad on the tables): the backward and the update in one pass.

One fp32 state per table entry, state (R, D). Each row touched by the batch takes its coalesced
gradient g (its occurrences' scaled dout rows, added in position order), then
state += g*g; w -= lr * g / (sqrt(state) + eps), all in float32 as FBGEMM applies it. The
grouping, the paths (hashed, hashed in position ranges, sorted) and their knobs are the row-wise
Adagrad's (adagrad.py): only the row update and its state prefetch differ, so results are
deterministic and independent of the path and thread count as there.
"""
from __future__ import annotations

import numpy as np

from ...codegen import kernel_factory
from .._check import finite, float_array, no_overlap
from . import adagrad
from ._validate import check_bag_args, check_table

OP = "embedding_bag_adagrad_exact"


@kernel_factory(OP)
def _adagrad_exact_factory(spec):
    return adagrad.build(spec, True)


def embedding_bag_adagrad_exact_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                                 per_sample_weights=None, include_last_offset=False):
    """In place, fused element-wise Adagrad; weight, state: (R, D) float32. Returns weight."""
    w, _ = check_table(weight, writeable=True, bf16_ok=False)
    R, D = w.shape
    state = float_array("state", state, shape=(R, D), copy=False, writeable=True)
    lr = finite("lr", lr)
    eps = np.float32(finite("eps", eps, minimum=0.0))  # applied in float32, as FBGEMM's
    bags, nbags = check_bag_args(indices, offsets, mode, per_sample_weights, include_last_offset)
    dout = float_array("dout", dout, shape=(nbags, D))
    # the update writes rows and state while it reads dout and the per-sample weights
    no_overlap("state", state, w, what="weight")
    no_overlap("dout", dout, w, state, what="weight or state (the arrays the update writes)")
    no_overlap("per_sample_weights", bags[2], w, state, what="weight or state (the arrays the update writes)")
    adagrad.update(bags, nbags, dout, lr, eps, (w, state), OP)
    return weight
