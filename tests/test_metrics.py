"""Evaluation metrics against brute-force definitions."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jitkern.dlrm.metrics import accuracy, evaluate_scores, log_loss, roc_auc


def auc_by_pairs(labels, scores):
    """P(score of a random positive > score of a random negative), ties counted half: O(n^2)."""
    pos = scores[labels >= 0.5]
    neg = scores[labels < 0.5]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / (len(pos) * len(neg))


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=80))
def test_auc_equals_pair_counting_with_ties(pairs):
    labels = np.array([p[0] for p in pairs], np.float32)
    scores = np.array([p[1] for p in pairs], np.float32) / 6       # few distinct values: many ties
    got = roc_auc(labels, scores)
    if labels.min() == labels.max():
        assert math.isnan(got)
    else:
        assert got == pytest.approx(auc_by_pairs(labels, scores), abs=1e-12)


def test_auc_edge_cases():
    y = np.array([0, 0, 1, 1], np.float32)
    assert roc_auc(y, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(y, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert roc_auc(y, np.full(4, 0.5)) == 0.5
    assert roc_auc(np.array([0.2, 0.4, 0.6, 0.9]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0   # soft labels rounded
    assert math.isnan(roc_auc(np.ones(3), np.arange(3.0)))
    with pytest.raises(ValueError, match="differ in length"):
        roc_auc(y, np.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        roc_auc(y, np.array([0.1, np.nan, 0.3, 0.4]))


def test_auc_large_input_matches_sampled_definition():
    rng = np.random.default_rng(0)
    n = 200_000
    labels = (rng.random(n) < 0.3).astype(np.float32)
    scores = np.round(rng.random(n) + 0.3 * labels, 3).astype(np.float32)   # ties across classes
    pos, neg = scores[labels == 1], scores[labels == 0]
    # exact by counting through sorted negatives (independent of roc_auc's rank formula)
    s = np.sort(neg)
    below = np.searchsorted(s, pos, side="left")
    equal = np.searchsorted(s, pos, side="right") - below
    want = (below.sum() + 0.5 * equal.sum()) / (len(pos) * len(neg))
    assert roc_auc(labels, scores) == pytest.approx(want, abs=1e-12)


def test_log_loss_and_accuracy():
    y = np.array([1, 0, 1, 0.25], np.float32)
    p = np.array([0.9, 0.2, 0.4, 0.5], np.float32)
    want = -np.mean(y * np.log(p.astype(np.float64)) + (1 - y) * np.log(1 - p.astype(np.float64)))
    assert log_loss(y, p) == pytest.approx(want, rel=1e-12)
    assert math.isfinite(log_loss(np.array([1.0, 0.0]), np.array([0.0, 1.0])))    # clipped, not inf
    assert accuracy(y, p) == 0.5            # 0.9 ok, 0.2 ok, 0.4 wrong, 0.5 vs 0.25 wrong
    m = evaluate_scores(y, p)
    assert set(m) == {"loss", "auc", "accuracy", "samples"} and m["samples"] == 4
