"""Plain NumPy references for the embedding-bag ops (float32 and row-wise quantized tables): pooling,
its gradients and the fused sparse updates. Re-exported by reference.py, where every op's reference
is found; the same conventions hold (no argument validation beyond NumPy's own)."""
from __future__ import annotations

import numpy as np


# --------------------------------------------------------------------------- embedding bags


def _bag_bounds(offsets, nnz, include_last_offset):
    offsets = np.asarray(offsets, np.int64)
    if include_last_offset:
        return offsets[:-1], offsets[1:]
    ends = np.append(offsets[1:], nnz)
    return offsets, ends


def _bag_scale(starts, ends, nnz, mode, per_sample_weights):
    """Per-index scale (nnz,): per-sample weight times 1/bag size for mean."""
    scale = np.ones(nnz) if per_sample_weights is None else np.asarray(per_sample_weights, np.float64).copy()
    if mode == "mean":
        for s, e in zip(starts, ends):
            if e > s:
                scale[s:e] /= e - s
    return scale


def embedding_bag_forward(weight, indices, offsets, *, mode="sum", per_sample_weights=None,
                          include_last_offset=False, out=None):
    """Pooled rows per bag; weight: (R, D), indices: (nnz,), offsets: (B,) or (B+1,) -> (B, D)."""
    w = np.asarray(weight, np.float64)
    idx = np.asarray(indices, np.int64)
    starts, ends = _bag_bounds(offsets, len(idx), include_last_offset)
    scale = _bag_scale(starts, ends, len(idx), mode, per_sample_weights)
    res = np.zeros((len(starts), w.shape[1]))
    for bag, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            res[bag] = (w[idx[s:e]] * scale[s:e, None]).sum(axis=0)
    return res.astype(np.float32)


def embedding_bag_backward(indices, offsets, dout, num_rows, *, mode="sum", per_sample_weights=None,
                           include_last_offset=False):
    """Coalesced sparse gradient: rows (U,) sorted unique int64, drows (U, D) float32."""
    idx = np.asarray(indices, np.int64)
    g = np.asarray(dout, np.float64)
    starts, ends = _bag_bounds(offsets, len(idx), include_last_offset)
    scale = _bag_scale(starts, ends, len(idx), mode, per_sample_weights)
    bag_of = np.repeat(np.arange(len(starts)), ends - starts)
    contrib = g[bag_of] * scale[:, None]
    rows, inverse = np.unique(idx, return_inverse=True)
    drows = np.zeros((len(rows), g.shape[1]))
    np.add.at(drows, inverse, contrib)
    return rows.astype(np.int64), drows.astype(np.float32)


def embedding_bag_per_sample_weights_backward(weight, indices, offsets, dout, *, mode="sum",
                                              include_last_offset=False):
    """dloss/dpsw (nnz,): dot(dout[bag of j], weight[indices[j]]), over the bag size for mean."""
    idx = np.asarray(indices, np.int64)
    starts, ends = _bag_bounds(offsets, len(idx), include_last_offset)
    scale = _bag_scale(starts, ends, len(idx), mode, None)
    bag_of = np.repeat(np.arange(len(starts)), ends - starts)
    dots = (np.asarray(dout, np.float64)[bag_of] * np.asarray(weight, np.float64)[idx]).sum(axis=1)
    return (dots * scale).astype(np.float32)


def embedding_bag_sgd_(weight, indices, offsets, dout, lr, *, mode="sum", per_sample_weights=None,
                       include_last_offset=False):
    """In place, entry by entry in position order: weight[indices[j]] -= lr * g_j, g_j = scale_j *
    dout[bag of j], all in float32 (np.add.at's rounding; "coalesce, then update" to float rounding)."""
    idx = np.asarray(indices, np.int64)
    starts, ends = _bag_bounds(offsets, len(idx), include_last_offset)
    bag_of = np.repeat(np.arange(len(starts)), ends - starts)
    g = np.asarray(dout, np.float32)[bag_of]
    if per_sample_weights is not None or mode == "mean":
        scale = np.ones(len(idx), np.float32) if per_sample_weights is None else np.asarray(per_sample_weights,
                                                                                           np.float32)
        if mode == "mean":
            scale = scale * (np.float32(1) / np.maximum(ends - starts, 1).astype(np.float32))[bag_of]
        g = scale[:, None] * g
    np.add.at(weight, idx, -(np.float32(lr) * g))
    return weight


def embedding_bag_adagrad_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                           per_sample_weights=None, include_last_offset=False):
    """In place row-wise Adagrad (FBGEMM's): state[r] += mean(g_r**2); w_r -= lr g_r / (sqrt(state[r]) + eps)."""
    rows, drows = embedding_bag_backward(indices, offsets, dout, weight.shape[0], mode=mode,
                                         per_sample_weights=per_sample_weights,
                                         include_last_offset=include_last_offset)
    g = drows.astype(np.float64)
    state[rows] = (state[rows] + (g * g).mean(axis=1)).astype(state.dtype)
    step = lr * g / (np.sqrt(state[rows].astype(np.float64))[:, None] + eps)
    weight[rows] = (weight[rows] - step).astype(weight.dtype)
    return weight


def embedding_bag_adagrad_exact_(weight, state, indices, offsets, dout, lr, eps=1e-8, *, mode="sum",
                                 per_sample_weights=None, include_last_offset=False):
    """In place element-wise Adagrad (FBGEMM's EXACT_ADAGRAD, torch.optim.Adagrad on the coalesced sparse
    gradient): state[r] += g_r**2; w_r -= lr g_r / (sqrt(state[r]) + eps); state (R, D)."""
    rows, drows = embedding_bag_backward(indices, offsets, dout, weight.shape[0], mode=mode,
                                         per_sample_weights=per_sample_weights,
                                         include_last_offset=include_last_offset)
    g = drows.astype(np.float64)
    state[rows] = (state[rows] + g * g).astype(state.dtype)
    step = lr * g / (np.sqrt(state[rows].astype(np.float64)) + eps)
    weight[rows] = (weight[rows] - step).astype(weight.dtype)
    return weight


# --------------------------------------------------------------------------- quantized embedding bags


def quantize_rowwise(weight, bits):
    """FBGEMM's row-wise quantization (torch's embedding_bag_{byte,4bit}_prepack) in float32 NumPy ops
    -> QuantizedTable: per row the values, then scale and bias (float32 for 8-bit, float16 for 4-bit)."""
    from .embedding.quantized import QuantizedTable
    w = np.asarray(weight, np.float32)
    lo, hi = w.min(axis=1), w.max(axis=1)
    if bits == 8:
        scale, bias = (hi - lo) / np.float32(255), lo
        q = np.rint((w - bias[:, None]) * (np.float32(255) / (hi - lo + np.float32(1e-8)))[:, None]).astype(np.uint8)
        tail = np.stack([scale, bias], axis=1).view(np.uint8)
    else:
        bias = lo.astype(np.float16).astype(np.float32)  # the bias is stored as float16: scale from that
        scale = np.where(hi == bias, np.float32(1), (hi - bias) / np.float32(15)).astype(np.float16).astype(np.float32)
        scale[scale == 0] = 1
        q = np.clip(np.rint((w - bias[:, None]) * (np.float32(1) / scale)[:, None]), 0, 15).astype(np.uint8)
        q = np.pad(q, ((0, 0), (0, q.shape[1] % 2)))  # odd D: a zero high nibble in the last byte
        q = q[:, 0::2] | (q[:, 1::2] << 4)
        tail = np.stack([scale, bias], axis=1).astype(np.float16).view(np.uint8)
    return QuantizedTable(np.ascontiguousarray(np.concatenate([q, tail], axis=1)), bits, w.shape[1])


def dequantize_rowwise(table):
    """(R, D) float64 values scale * q + bias of a QuantizedTable."""
    data, D = np.asarray(table.data), table.dim
    if table.bits == 8:
        q, sb = data[:, :D], data[:, D:D + 8].copy().view(np.float32)
    else:
        nq = (D + 1) // 2
        q = np.stack([data[:, :nq] & 15, data[:, :nq] >> 4], axis=2).reshape(len(data), 2 * nq)[:, :D]
        sb = data[:, nq:nq + 4].copy().view(np.float16)
    return q * sb[:, :1].astype(np.float64) + sb[:, 1:].astype(np.float64)


def embedding_bag_quantized_forward(table, indices, offsets, *, mode="sum", per_sample_weights=None,
                                    include_last_offset=False, out=None):
    """Pooled dequantized rows per bag: embedding_bag_forward over dequantize_rowwise(table) -> (B, D)."""
    return embedding_bag_forward(dequantize_rowwise(table), indices, offsets, mode=mode,
                                 per_sample_weights=per_sample_weights, include_last_offset=include_last_offset)
