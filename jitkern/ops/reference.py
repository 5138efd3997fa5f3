"""Plain NumPy references for every jitkern op: same names and signatures, no blocking.

Short enough to be obviously right; float64 accumulation where it helps. Tests compare each
kernel with its reference here, and benchmarks take their baselines from the same place.
These do no argument validation beyond what NumPy itself does: the kernels' wrappers check.
The bf16 ops' references live in reference_bf16.py, the embedding bags' in reference_embedding.py;
both are re-exported here.
"""
from __future__ import annotations

import numpy as np

from .bf16 import BF16Array
from .reference_bf16 import (  # noqa: F401  (re-exported: every op's reference is here)
    _result,
    _values,
    bf16_join,
    bf16_round,
    bf16_split,
    bf16_to_float32,
    cross_layer_backward_bf16,
    cross_layer_forward_bf16,
    gemm_bf16,
    linear_backward_bf16,
    linear_forward_bf16,
)
from .reference_embedding import (  # noqa: F401  (re-exported, as the bf16 ones)
    _bag_bounds,
    dequantize_rowwise,
    embedding_bag_adagrad_,
    embedding_bag_adagrad_exact_,
    embedding_bag_backward,
    embedding_bag_forward,
    embedding_bag_per_sample_weights_backward,
    embedding_bag_quantized_forward,
    embedding_bag_sgd_,
    quantize_rowwise,
)


# --------------------------------------------------------------------------- GEMM family


def gemm(a, b, out=None, *, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """out = alpha * op(a) @ op(b) + beta * out; a: (M, K) or (K, M), b: (K, N) or (N, K)."""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    c = alpha * ((a64.T if trans_a else a64) @ (b64.T if trans_b else b64))
    if out is not None and beta != 0.0:
        c = c + beta * np.asarray(out, np.float64)
    return c.astype(np.float32)


def linear_forward(x, w, b=None, *, activation=None, out=None, out_mask=None):
    """y = act(x @ w.T + b); x: (N, K), w: (M, K), b: (M,) -> y: (N, M). out_mask: set to y > 0."""
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if b is not None:
        y = y + np.asarray(b, np.float64)
    if activation == "relu":
        y = np.maximum(y, 0.0)
    y = y.astype(np.float32)
    if out_mask is not None:
        out_mask[...] = y > 0
    return y


def linear_backward(dy, x, w, y=None, *, activation=None, need_dx=True, input_relu=False, x_mask=None):
    """Gradients of linear_forward; dy, y: (N, M) -> dx (N, K) (None unless need_dx), dw (M, K), db (M,).
    input_relu: dx is +0.0 where x <= 0 (x a ReLU's output: the gradient at that ReLU's input), or
    where x_mask (x > 0 as linear_forward's out_mask) is False if given."""
    g = np.asarray(dy, np.float64)
    if activation == "relu":
        g = np.where(np.asarray(y) > 0, g, 0.0)
    dx = (g @ np.asarray(w, np.float64)).astype(np.float32) if need_dx else None
    if need_dx and input_relu:
        keep = np.asarray(x) > 0 if x_mask is None else np.asarray(x_mask, bool)
        dx = np.where(keep, dx, np.float32(0.0)).astype(np.float32)
    dw = g.T @ np.asarray(x, np.float64)
    db = g.sum(axis=0)
    return dx, dw.astype(np.float32), db.astype(np.float32)


def batch_reduce_gemm(a, b, out=None, *, alpha=1.0, beta=0.0):
    """out = alpha * sum_i a[i] @ b[i] + beta * out; a: (nb, M, K), b: (nb, K, N) -> (M, N)."""
    c = alpha * np.einsum("imk,ikn->mn", np.asarray(a, np.float64), np.asarray(b, np.float64))
    if out is not None and beta != 0.0:
        c = c + beta * np.asarray(out, np.float64)
    return c.astype(np.float32)


# --------------------------------------------------------------------------- interaction


def _stack(x, ly):
    ly = np.stack(ly, axis=1) if isinstance(ly, (list, tuple)) else np.asarray(ly)
    return np.concatenate([np.asarray(x)[:, None, :], ly], axis=1)  # (B, F, D)


def _stack_values(x, ly):
    """(B, F, D) float64 values of x and ly (float32 or BF16Array)."""
    ly = np.stack([_values(a) for a in ly], axis=1) if isinstance(ly, (list, tuple)) else _values(ly)
    return np.concatenate([_values(x)[:, None, :], ly], axis=1)


def interaction_pairs(num_features, self_interaction=False):
    """(li, lj) index arrays of the reference DLRM's pair order: i ascending, then j ascending."""
    off = 1 if self_interaction else 0
    li = np.array([i for i in range(num_features) for j in range(i + off)], dtype=np.int64)
    lj = np.array([j for i in range(num_features) for j in range(i + off)], dtype=np.int64)
    return li, lj


def interaction_dot_forward(x, ly, *, self_interaction=False, out_dtype=None):
    """z = [x, tril(T T^t)] with T = [x, ly_0..]; x: (B, D), ly: (B, T, D) -> (B, D + P) (a BF16Array
    with out_dtype="bfloat16"; inputs float32 or BF16Array)."""
    t = _stack_values(x, ly)
    zz = t @ t.transpose(0, 2, 1)
    li, lj = interaction_pairs(t.shape[1], self_interaction)
    return _result(np.concatenate([t[:, 0, :], zz[:, li, lj]], axis=1), out_dtype)


def interaction_dot_backward(dz, x, ly, *, self_interaction=False):
    """Gradients of interaction_dot_forward: dx (B, D), dly (B, T, D)."""
    t = _stack_values(x, ly)
    b, f, d = t.shape
    dz = _values(dz)
    li, lj = interaction_pairs(f, self_interaction)
    dzz = np.zeros((b, f, f))
    np.add.at(dzz, (slice(None), li, lj), dz[:, d:])
    dt = dzz @ t + dzz.transpose(0, 2, 1) @ t
    dt[:, 0, :] += dz[:, :d]
    return dt[:, 0, :].astype(np.float32), dt[:, 1:, :].astype(np.float32)


def interaction_cat_forward(x, ly):
    """z = [x, ly_0, ..., ly_{T-1}] flattened; x: (B, D), ly: (B, T, D) -> (B, D * (T + 1)) float32,
    or a BF16Array of the same values for BF16Array inputs."""
    t = _stack_values(x, ly)
    z = np.ascontiguousarray(t.reshape(t.shape[0], t.shape[1] * t.shape[2]), dtype=np.float32)
    return _result(z, "bfloat16" if isinstance(x, BF16Array) else "float32")


def interaction_cat_backward(dz, x, ly):
    """Gradients of interaction_cat_forward (dz float32 or BF16Array): dx (B, D), dly (B, T, D) float32."""
    t = _stack_values(x, ly)
    dt = _values(dz).astype(np.float32).reshape(t.shape)
    return dt[:, 0, :].copy(), dt[:, 1:, :].copy()


# --------------------------------------------------------------------------- loss


def sigmoid_bce_forward(logits, labels):
    """Batch-mean BCE of sigmoid(logits), the stable form; -> (loss float, probs (B,) float32)."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    per = np.maximum(z, 0.0) - z * y + np.log1p(np.exp(-np.abs(z)))
    probs = 1.0 / (1.0 + np.exp(-z))
    return float(per.mean()) if len(z) else 0.0, probs.astype(np.float32)


def sigmoid_bce_backward(probs, labels):
    """dloss/dlogits = (probs - labels) / B."""
    p = np.asarray(probs, np.float64)
    return ((p - np.asarray(labels, np.float64)) / max(len(p), 1)).astype(np.float32)


def sigmoid_loss_forward(logits, labels, *, loss="bce", class_weights=None, threshold=0.0):
    """Batch-mean bce | mse | wbce of sigmoid(logits), p clamped to [t, 1 - t] when t > 0;
    -> (loss float, probs (B,) float32, clamped)."""
    per, _, pc = _sigmoid_loss(logits, labels, loss, class_weights, threshold)
    return float(per.mean()) if len(per) else 0.0, pc.astype(np.float32)


def sigmoid_loss_backward(logits, labels, *, loss="bce", class_weights=None, threshold=0.0):
    """dloss/dlogits of the batch mean; 0 where p was clamped."""
    _, d, _ = _sigmoid_loss(logits, labels, loss, class_weights, threshold)
    return (d / max(len(d), 1)).astype(np.float32)


def _sigmoid_loss(logits, labels, loss, class_weights, threshold):
    """(per-sample loss, per-sample dloss/dz, clamped probabilities) in float64, from the float32
    probabilities as torch computes them (bce: from the logits where not clamped)."""
    z = np.asarray(logits, np.float64)
    y = np.asarray(labels, np.float64)
    p = np.where(z >= 0, 1.0 / (1.0 + np.exp(-np.abs(z))), np.exp(-np.abs(z)) / (1.0 + np.exp(-np.abs(z))))
    with np.errstate(over="ignore"):                  # torch's float32 sigmoid, op by op (bce: rounded p)
        p32 = (1.0 / (np.float32(1.0) + np.exp(-z).astype(np.float32)).astype(np.float64)).astype(np.float32)
    if loss == "bce":
        p32 = p.astype(np.float32)
    pc, inside = p32, np.ones(len(p), bool)
    if threshold > 0:
        lo, hi = np.float32(threshold), np.float32(1.0 - threshold)
        inside = (p32 >= lo) & (p32 <= hi)
        pc = np.minimum(np.maximum(p32, lo), hi)
    dp = p32.astype(np.float64) * (1.0 - p32.astype(np.float64))
    pc64 = pc.astype(np.float64)
    if loss == "mse":
        return (pc64 - y) ** 2, np.where(inside, 2.0 * (pc64 - y) * dp, 0.0), pc
    with np.errstate(divide="ignore"):
        torch_bce = -(y * np.maximum(np.log(pc64), -100.0) +
                      (1.0 - y) * np.maximum(np.log((np.float32(1.0) - pc).astype(np.float64)), -100.0))
    if loss == "bce":
        stable = np.maximum(z, 0.0) - z * y + np.log1p(np.exp(-np.abs(z)))
        return np.where(inside, stable, torch_bce), np.where(inside, p - y, 0.0), pc
    w = np.ones_like(y) if loss == "bce_prob" else np.asarray(class_weights, np.float64)[(y >= 1.0).astype(int)]
    grad = w * (pc64 - y) / np.maximum(dp, 1e-12) * dp
    return w * torch_bce, np.where(inside, grad, 0.0), pc


def sigmoid_forward(x, *, out=None):
    """y = 1 / (1 + exp(-x)), element-wise."""
    z = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)


def sigmoid_backward(dy, y):
    """dx = dy * y * (1 - y)."""
    v = np.asarray(y, np.float64)
    return (np.asarray(dy, np.float64) * v * (1.0 - v)).astype(np.float32)


# --------------------------------------------------------------------------- low-rank cross layer


def cross_layer_forward(x0, xl, v, w, b, *, out=None, out_u=None, out_y=None):
    """(x_next, u): u = xl @ v.T, x_next = x0 * (u @ w.T + b) + xl; float64 inside."""
    x0, xl = np.asarray(x0, np.float64), np.asarray(xl, np.float64)
    u = xl @ np.asarray(v, np.float64).T
    y = u @ np.asarray(w, np.float64).T + np.asarray(b, np.float64)
    return (x0 * y + xl).astype(np.float32), u.astype(np.float32)


def cross_layer_backward(dx_next, x0, xl, u, v, w, b, *, y=None, accumulate_dx0=None, out_dxl=None):
    """(dx0, dxl, dv, dw, db) of cross_layer_forward; float64 inside."""
    d, x0, xl, u = (np.asarray(a, np.float64) for a in (dx_next, x0, xl, u))
    v, w, b = (np.asarray(a, np.float64) for a in (v, w, b))
    dy = d * x0
    du = dy @ w
    dx0 = d * (u @ w.T + b)
    if accumulate_dx0 is not None:
        dx0 = dx0 + accumulate_dx0
    f32 = np.float32
    return dx0.astype(f32), (d + du @ v).astype(f32), (du.T @ xl).astype(f32), (dy.T @ u).astype(f32), \
        dy.sum(axis=0).astype(f32)


# --------------------------------------------------------------------------- dense optimizers


def sgd_(param, grad, lr):
    """In place: param -= lr * grad. Returns param."""
    param -= np.float32(lr) * np.asarray(grad, np.float32)
    return param


def split_sgd_(hi, lo, grad, lr):
    """In place on a Split pair (hi: BF16Array, lo: uint16): the joined fp32 weight takes sgd_, then
    is split again. Returns (hi, lo)."""
    w = sgd_(bf16_join(hi.bits, lo), grad, lr)
    hi.bits[...], lo[...] = bf16_split(w)
    return hi, lo


def adagrad_(param, state, grad, lr, eps):
    """In place Adagrad (torch.optim.Adagrad): state += grad**2; param -= lr grad / (sqrt(state) + eps)."""
    g = np.asarray(grad, np.float64)
    state[...] = (state.astype(np.float64) + g * g).astype(np.float32)
    step = lr * g / (np.sqrt(state.astype(np.float64)) + eps)
    param[...] = (param.astype(np.float64) - step).astype(np.float32)
    return param


# --------------------------------------------------------------------------- row blocks


def scatter_blocks(src, dst, offsets, starts, stops):
    for o, a, b in zip(offsets, starts, stops):
        dst[o:o + (b - a) * src.shape[1]] = src[a:b].ravel()
    return dst


def gather_blocks(src, offsets, starts, stops, out):
    for o, a, b in zip(offsets, starts, stops):
        out[a:b] = src[o:o + (b - a) * out.shape[1]].reshape(b - a, out.shape[1])
    return out


def sum_blocks(src, offsets, out):
    parts = [src[o:o + out.size].reshape(out.shape) for o in offsets]
    out[...] = parts[0]
    for p in parts[1:]:
        np.add(out, p, out=out)
    return out


def copy_segments(src, starts, lens, out, at=None):
    if at is None:
        at = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if len(lens) else []
    for s, n, a in zip(starts, lens, at):
        out[a:a + n] = src[s:s + n]
    return out


def bucket_by_shard(offsets, indices, bounds, lengths=None, rows=None, ends=None, shard=None):
    """-> (lengths (k, b), rows, ends): a stable sort of the lookups by shard (row * k // R), copied
    into the outputs given (shard: the op's scratch, unused here)."""
    k, b, n, R = len(bounds) - 1, len(offsets), len(indices), bounds[-1]
    sh = indices * k // R
    bag = np.repeat(np.arange(b), np.diff(np.append(offsets, n)))
    counts = np.bincount(sh * b + bag, minlength=k * b).reshape(k, b)
    grouped = (indices - np.asarray(bounds)[sh])[np.argsort(sh, kind="stable")]
    groups = np.concatenate([[0], np.cumsum(counts.sum(axis=1))]).astype(np.int64)
    result = []
    for out, got in ((lengths, counts), (rows, grouped), (ends, groups)):
        if out is not None:
            np.copyto(out, got)
        result.append(got if out is None else out)
    return tuple(result)
