"""Sigmoid + loss, fused and computed from the logits: BCE (sigmoid_bce_*), and the reference
DLRM's other losses (sigmoid_loss_*: mse, class-weighted wbce, probabilities clamped to a threshold).

BCE per sample = max(z, 0) - z*y + log1p(exp(-|z|)): never takes log of a rounded probability,
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


# --------------------------------------------------------------------------- the reference's losses

LOSSES = ("bce", "bce_prob", "mse", "wbce")
_KIND = {"bce": 0, "mse": 1, "bce_prob": 2, "wbce": 2}
_LOG_FLOOR = -100.0            # torch's BCELoss clamps each log term at -100
_BCE_EPS = 1e-12               # and its gradient's denominator p (1 - p) at 1e-12


@jit(inline="always")
def _sigmoid(z):
    """sigmoid(z) in float64, without overflow for any z."""
    e = math.exp(-abs(z))
    return 1.0 / (1.0 + e) if z >= 0.0 else e / (1.0 + e)


@jit(inline="always")
def _torch_sigmoid(z):
    """torch's float32 sigmoid, 1 / (1 + exp(-z)) step by step in float32: near 1 the rounding of
    1 + exp(-z) decides 1 - p, which BCE's log(1 - p) magnifies; exp(-z) overflows to 0 below -88.7."""
    e = np.float32(math.exp(-z)) if -z < 89.0 else np.float32(np.inf)
    return np.float32(1.0 / np.float64(np.float32(np.float32(1.0) + e)))


@jit(inline="always")
def _clamp(p32, t):
    """(clamped p, whether the gradient passes): torch.clamp(p, t, 1 - t) on float32 p; t = 0: off."""
    if t <= 0.0:
        return p32, True
    lo, hi = np.float32(t), np.float32(1.0 - t)
    return min(max(p32, lo), hi), (p32 >= lo and p32 <= hi)


@jit(inline="always")
def _bce_of_prob(p, y):
    """BCE of a float32 probability, each log clamped at -100 (torch's BCELoss)."""
    q = np.float32(1.0) - p
    lp = max(math.log(p), _LOG_FLOOR) if p > 0.0 else _LOG_FLOOR
    lq = max(math.log(q), _LOG_FLOOR) if q > 0.0 else _LOG_FLOOR
    return -(y * lp + (1.0 - y) * lq)


@jit(inline="always")
def _sample(z, y, kind, w, t):
    """(loss, dloss/dz, reported probability) of one sample. kind 0: BCE from the logit where
    the probability is not clamped; 1: MSE; 2: BCE of the float32 probability, weighted by w
    (torch's BCELoss after sigmoid, as the reference computes it)."""
    p = _sigmoid(z)
    p32 = np.float32(p) if kind == 0 else _torch_sigmoid(z)      # bce: sigmoid_bce_forward's probabilities
    pc, inside = _clamp(p32, t)
    dp = np.float64(p32) * (1.0 - np.float64(p32))     # torch's sigmoid backward: p (1 - p) in float32's p
    if kind == 1:
        d = np.float64(pc) - y
        return d * d, (2.0 * d * dp if inside else 0.0), pc
    if kind == 0:
        if inside:
            return max(z, 0.0) - z * y + math.log1p(math.exp(-abs(z))), p - y, pc
        return _bce_of_prob(pc, y), 0.0, pc
    grad = 0.0
    if inside:
        grad = w * (np.float64(pc) - y) / max(dp, _BCE_EPS) * dp
    return w * _bce_of_prob(pc, y), grad, pc


@kernel_factory("sigmoid_loss")
def _loss_factory(spec):
    @jit()
    def sigmoid_loss(logits, labels, class_weights, kind, t, probs, dlogits):
        # logits, labels: (B,) float32; class_weights: (2,) float64; probs, dlogits: (B,) outputs
        total = 0.0
        inv = 1.0 / max(logits.shape[0], 1)
        for b in range(logits.shape[0]):
            y = np.float64(labels[b])
            w = class_weights[1] if y >= 1.0 else class_weights[0]
            loss, d, pc = _sample(np.float64(logits[b]), y, kind, w, t)
            total += loss
            probs[b] = pc
            dlogits[b] = d * inv
        return total
    return sigmoid_loss


def _loss_args(loss, class_weights, threshold):
    _check.choice("loss", loss, LOSSES)
    t = _check.finite("threshold", threshold, minimum=0.0)
    if not t < 1.0:
        raise ValueError(f"threshold must be in [0, 1), got {t}")
    w = np.ones(2, np.float64)
    if loss == "wbce":
        if class_weights is None:
            raise ValueError("loss='wbce' needs class_weights (the weights of labels 0 and 1)")
        w = np.asarray(class_weights, np.float64).reshape(-1)
        if w.shape != (2,) or not np.isfinite(w).all():
            raise ValueError(f"class_weights must be 2 finite numbers (labels 0 and 1), got {class_weights!r}")
    elif class_weights is not None:
        raise ValueError(f"class_weights apply to loss='wbce' only, got loss={loss!r}")
    return _KIND[loss], t, w


def _sigmoid_loss(logits, labels, loss, class_weights, threshold):
    kind, t, w = _loss_args(loss, class_weights, threshold)
    logits = _check.float_array("logits", logits, ndim=1)
    labels = _check_labels(labels, logits.shape[0], "logits")
    probs, dlogits = np.empty_like(logits), np.empty_like(logits)
    total = get_kernel(KernelSpec.make("sigmoid_loss"))(logits, labels, w, kind, t, probs, dlogits)
    return (total / logits.shape[0] if logits.shape[0] else 0.0), probs, dlogits


def sigmoid_loss_forward(logits, labels, *, loss="bce", class_weights=None, threshold=0.0):
    """Batch-mean loss of p = sigmoid(logits), the reference DLRM's --loss-function: "bce" (from
    the logits, as sigmoid_bce_forward), "bce_prob" (torch's BCELoss on the float32 p: logs
    clamped at -100, no gradient where p rounds to 0 or 1), "mse" ((p - y)**2) or "wbce"
    (bce_prob times class_weights[label >= 1]); threshold > 0 first clamps p to [threshold,
    1 - threshold] (its --loss-threshold). logits, labels: (B,) float32 -> (loss float, probs
    (B,) float32, clamped)."""
    total, probs, _ = _sigmoid_loss(logits, labels, loss, class_weights, threshold)
    return total, probs


def sigmoid_loss_backward(logits, labels, *, loss="bce", class_weights=None, threshold=0.0):
    """dloss/dlogits (B,) float32 of sigmoid_loss_forward's batch mean (0 where p was clamped)."""
    return _sigmoid_loss(logits, labels, loss, class_weights, threshold)[2]
