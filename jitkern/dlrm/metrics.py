"""Evaluation metrics for click prediction: exact ROC AUC, log loss, accuracy (no scikit-learn).

Labels may be soft (the reference's `random` data draws them uniformly): AUC and accuracy use
the rounded label (>= 0.5 is a click), log loss the label as given.
"""
from __future__ import annotations

import numpy as np


def _as_1d(name, a):
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def _check_pair(labels, scores):
    labels, scores = _as_1d("labels", labels), _as_1d("scores", scores)
    if labels.shape != scores.shape:
        raise ValueError(f"labels {labels.shape} and scores {scores.shape} differ in length")
    if np.isnan(scores).any():
        raise ValueError(f"scores hold NaN (first at position {int(np.argmax(np.isnan(scores)))})")
    return labels, scores


def roc_auc(labels, scores) -> float:
    """Area under the ROC curve, ties counted as half (Mann-Whitney U / (P N)), O(n log n).

    Returns NaN when only one class is present.
    """
    labels, scores = _check_pair(labels, scores)
    pos = labels >= 0.5
    n_pos = int(pos.sum())
    n_neg = len(pos) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    # average 1-based rank of each tie group: groups start where the sorted score changes
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    ends = np.append(starts[1:], len(s))
    avg_rank = (starts + ends + 1) / 2.0
    group = np.repeat(np.arange(len(starts)), ends - starts)
    rank_sum = avg_rank[group][pos[order]].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(labels, probs, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps]) against labels."""
    labels, probs = _check_pair(labels, probs)
    if len(labels) == 0:
        return float("nan")
    y = labels.astype(np.float64)
    p = np.clip(probs.astype(np.float64), eps, 1.0 - eps)
    return float(-(y * np.log(p) + (1.0 - y) * np.log1p(-p)).mean())


def accuracy(labels, probs) -> float:
    """Fraction of samples whose rounded probability equals the rounded label."""
    labels, probs = _check_pair(labels, probs)
    if len(labels) == 0:
        return float("nan")
    return float(((probs >= 0.5) == (labels >= 0.5)).mean())


def evaluate_scores(labels, probs) -> dict:
    """All three metrics plus the sample count, as the trainer prints and checkpoints them."""
    return {"loss": log_loss(labels, probs), "auc": roc_auc(labels, probs),
            "accuracy": accuracy(labels, probs), "samples": int(len(labels))}
