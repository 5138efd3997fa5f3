"""Sigmoid + binary cross-entropy, fused and computed from the logits.

per-sample loss = max(z, 0) - z*y + log1p(exp(-|z|)): never takes log of a rounded probability,
so it stays finite and exact for any finite logit (|z| = 1e4 included), unlike log(sigmoid(z)).
Accumulated in float64 in a fixed order, so the batch mean is deterministic.
"""
from __future__ import annotations

import math

import numpy as np

from ..codegen import KernelSpec, get_kernel, jit, kernel_factory
from . import _check


@kernel_factory("sigmoid_bce_forward")
def _forward_factory(spec):
    @jit()
    def sigmoid_bce_forward(logits, labels, probs):
        # logits, labels: (B,) float32; probs: (B,) float32 output; -> sum of per-sample losses
        total = 0.0
        for b in range(logits.shape[0]):
            z = np.float64(logits[b])
            e = math.exp(-abs(z))  # in (0, 1]: no overflow for any z
            total += max(z, 0.0) - z * np.float64(labels[b]) + math.log1p(e)
            probs[b] = 1.0 / (1.0 + e) if z >= 0.0 else e / (1.0 + e)
        return total
    return sigmoid_bce_forward


@kernel_factory("sigmoid_bce_backward")
def _backward_factory(spec):
    @jit()
    def sigmoid_bce_backward(probs, labels, dlogits):
        # probs, labels: (B,) float32; dlogits: (B,) output = (probs - labels) / B
        inv = 1.0 / max(probs.shape[0], 1)
        for b in range(probs.shape[0]):
            dlogits[b] = (np.float64(probs[b]) - np.float64(labels[b])) * inv
    return sigmoid_bce_backward


def _check_labels(labels, b, ref_name):
    labels = _check.float_array("labels", labels, ndim=1)
    if labels.shape[0] != b:
        raise ValueError(f"labels has B={labels.shape[0]} but {ref_name} has B={b}")
    bad = ~((labels >= 0) & (labels <= 1))  # NaN fails both comparisons
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"labels must lie in [0, 1] (soft labels allowed), got labels[{i}] = {labels[i]}")
    return labels


def sigmoid_bce_forward(logits, labels):
    """Batch-mean BCE of sigmoid(logits); logits, labels: (B,) float32 -> (loss float, probs (B,) float32)."""
    logits = _check.float_array("logits", logits, ndim=1)
    labels = _check_labels(labels, logits.shape[0], "logits")
    probs = np.empty_like(logits)
    total = get_kernel(KernelSpec.make("sigmoid_bce_forward"))(logits, labels, probs)
    return (total / logits.shape[0] if logits.shape[0] else 0.0), probs


def sigmoid_bce_backward(probs, labels):
    """dloss/dlogits of the batch-mean loss: (probs - labels) / B; probs, labels: (B,) float32."""
    probs = _check.float_array("probs", probs, ndim=1)
    labels = _check_labels(labels, probs.shape[0], "probs")
    dlogits = np.empty_like(probs)
    get_kernel(KernelSpec.make("sigmoid_bce_backward"))(probs, labels, dlogits)
    return dlogits
