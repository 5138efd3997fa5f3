"""Row-wise quantized embedding tables (8-bit and 4-bit) and their fused dequantizing bag forward.

Layout and rounding are FBGEMM's, as torch's `quantized.embedding_bag_{byte,4bit}_prepack` and
`..._rowwise_offsets` use them, so tables move between the two unchanged (`QuantizedTable(
prepacked.numpy(), bits)`): row r of the (R, bytes_per_row) uint8 array holds D quantized values,
then its scale and bias; a value stands for scale * q + bias.
- 8-bit: D bytes, then float32 scale = (max - min) / 255 and bias = min; q = rint((x - min) * 255 /
  (max - min + 1e-8)).
- 4-bit: ceil(D / 2) bytes (element 2k in the low nibble of byte k), then float16 scale and bias:
  bias = min rounded to float16, scale = (max - bias) / 15 rounded to float16 (1 if that is 0);
  q = clamp(rint((x - bias) / scale), 0, 15).

The forward pools dequantized rows without materialising them: per row one <D x float>
fma(scale, q, acc + bias) (FBGEMM's order of operations, so sums round as torch's do), the row's
lines prefetched a knob-chosen distance ahead. Bags follow torch.nn.functional.embedding_bag
(offsets, include_last_offset, per_sample_weights scaling scale and bias of each row, mean =
sum * (1 / count)); parallel over chunks of bags, deterministic for any thread count.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import prange

from ...codegen import KernelSpec, get_kernel, jit, kernel_factory, num_threads, tunedb
from ...codegen.knobs import knob, pow2_class
from ...codegen.prefetch import prefetch_l2
from ...codegen.qrowvec import fma_f32, qrow_fma, qrow_store, row_scale_bias
from ...codegen.rowvec import stack_f32
from .._check import I64, choice, float_array, index_array, output
from ._knobs import cycle, draw_batches
from ._rows import SPECIALISED_D, bag_end, empty_table, prefetch_distance
from ._validate import check_bags, raise_bag_error, validate_bags
from .forward import SERIAL_WORK

BITS = (8, 4)
_MODES = ("sum", "mean")
_CHUNKS = 64                        # bag chunks of the parallel forward
_FP16_MAX = 65504.0                 # 4-bit rows store their bias (the row minimum) as float16
_EPS8 = np.float32(1e-8)            # FBGEMM's kEpsilon in the 8-bit inverse scale
_NO_PSW = np.empty(0, np.float32)   # stand-in for absent per-sample weights (kernels never read it)
_STRICT = frozenset()               # no fast-math: every rounding as FBGEMM's scalar code does it


def q_bytes(dim: int, bits: int) -> int:
    """Bytes of a row's quantized values."""
    return dim if bits == 8 else (dim + 1) // 2


def row_bytes(dim: int, bits: int) -> int:
    """Bytes per packed row: the values, then scale and bias (float32 for 8-bit, float16 for 4-bit)."""
    return q_bytes(dim, bits) + (8 if bits == 8 else 4)


class QuantizedTable:
    """An (R, D) embedding table quantized row-wise: data (R, row_bytes(D, bits)) uint8 in FBGEMM's layout.

    `dim` defaults to what the row width implies (for 4-bit the even one: torch packs only even D)."""

    __slots__ = ("data", "bits", "dim")

    def __init__(self, data, bits, dim=None):
        choice("bits", bits, BITS)
        data = float_array("data", data, ndim=2, dtype=np.uint8, copy=False)
        extra = 8 if bits == 8 else 4
        width = data.shape[1]
        if dim is None:
            dim = width - extra if bits == 8 else 2 * (width - extra)
        dim = int(dim)
        if dim < 1 or row_bytes(dim, bits) != width:
            raise ValueError(f"data rows of {width} bytes do not hold {bits}-bit rows of dim {dim} "
                             f"(those take {row_bytes(max(dim, 1), bits)} bytes)")
        self.data, self.bits, self.dim = data, int(bits), dim

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple:
        """(R, D) of the float table it stands for."""
        return self.data.shape[0], self.dim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @classmethod
    def from_float32(cls, weight, bits) -> "QuantizedTable":
        """Quantize a float32 (R, D) table (quantize_rowwise)."""
        return quantize_rowwise(weight, bits)

    def to_float32(self) -> np.ndarray:
        """The (R, D) float32 table it stands for: fma(scale, q, 0 + bias), a one-row bag's result."""
        out = np.empty(self.shape, np.float32)
        get_kernel(KernelSpec.make("embedding_dequantize", bits=self.bits))(self.data, out)
        return out

    def __repr__(self) -> str:
        return f"QuantizedTable({self.num_rows} x {self.dim}, {self.bits}-bit, {self.nbytes} bytes)"


# ----------------------------------------------------------------------------- quantization


def _row_params(lo, hi, bits):
    """Per-row (scale, bias, inverse scale) in float32 as FBGEMM computes them; lo, hi: (R,) float32
    row minima and maxima. Values are quantized as rint((x - bias) * inverse)."""
    if bits == 8:
        spread = hi - lo
        return spread / np.float32(255), lo, np.float32(255) / (spread + _EPS8)
    bias = lo.astype(np.float16).astype(np.float32)  # stored as float16: the scale is taken from that
    spread = hi - bias
    scale = np.where(spread == 0, np.float32(1), spread / np.float32(15)).astype(np.float16).astype(np.float32)
    scale[scale == 0] = 1  # a spread below float16's range: any scale will do, every q is 0
    return scale, bias, np.float32(1) / scale  # finite: float16 scales are >= 2**-24


@jit(inline="always", fastmath=_STRICT)
def _quant(x, lo, inv, top):
    return np.uint8(min(max(np.rint((x - lo) * inv), np.float32(0)), top))


@kernel_factory("embedding_quantize")
def _quantize_factory(spec):
    FOUR = spec["bits"] == 4

    @jit(parallel=True, fastmath=_STRICT)
    def quantize(weight, biases, invs, data):
        # weight: (R, D) float32, biases, invs: (R,) float32, data: (R, row bytes) uint8 (values only written)
        R, D = weight.shape
        for r in prange(R):
            lo, inv = biases[r], invs[r]
            if FOUR:
                for k in range(D // 2):
                    data[r, k] = (_quant(weight[r, 2 * k], lo, inv, np.float32(15))
                                  | (_quant(weight[r, 2 * k + 1], lo, inv, np.float32(15)) << np.uint8(4)))
                if D % 2:
                    data[r, D // 2] = _quant(weight[r, D - 1], lo, inv, np.float32(15))
            else:
                for d in range(D):
                    data[r, d] = _quant(weight[r, d], lo, inv, np.float32(255))
    return quantize


@kernel_factory("embedding_dequantize")
def _dequantize_factory(spec):
    BITS_ = spec["bits"]

    @jit(parallel=True, fastmath=_STRICT)
    def dequantize(data, out):
        # data: (R, row bytes) uint8, out: (R, D) float32
        R, D = out.shape
        QB = _row_layout(D, BITS_)[0]
        for r in prange(R):
            s, b = row_scale_bias(data, r, QB, BITS_)
            _dequant_row(out, r, data, r, s, b, D, BITS_, True)
    return dequantize


def quantize_rowwise(weight, bits) -> QuantizedTable:
    """Quantize weight: (R, D) float32, finite (|w| <= 65504 for 4-bit) -> QuantizedTable, bit for bit as
    torch's embedding_bag_byte_prepack (bits=8) / embedding_bag_4bit_prepack (bits=4), except for the
    sign of a zero bias in rows whose minimum is a zero of both signs (FBGEMM's SIMD lane order picks one)."""
    choice("bits", bits, BITS)
    w = float_array("weight", weight, ndim=2)
    R, D = w.shape
    if D < 1:
        raise ValueError(f"weight must have at least one column, got shape {w.shape}")
    lo, hi = w.min(axis=1), w.max(axis=1)
    bad = ~(np.isfinite(lo) & np.isfinite(hi))
    if bad.any():
        raise ValueError(f"weight row {int(np.argmax(bad))} holds a NaN or infinity")
    if bits == 4 and R and max(-float(lo.min()), float(hi.max())) > _FP16_MAX:
        raise ValueError(f"4-bit rows store their minimum and scale as float16: |weight| must be <= {_FP16_MAX:g}, "
                         f"got values in [{float(lo.min()):g}, {float(hi.max()):g}]")
    scale, bias, inv = _row_params(lo, hi, bits)
    data = empty_table(R, row_bytes(D, bits), np.uint8)
    get_kernel(KernelSpec.make("embedding_quantize", bits=bits))(w, bias, inv, data)
    pair = np.stack([scale, bias], axis=1).astype(np.float32 if bits == 8 else np.float16)
    data[:, q_bytes(D, bits):] = pair.view(np.uint8)
    return QuantizedTable(data, bits, D)


# ----------------------------------------------------------------------------- forward


@jit(inline="always", fastmath=_STRICT)
def _dequant_row(acc, a, table, r, s, b, D, BITS_, fresh):
    """acc[a, :D] = fma(s, q, (0 if fresh else acc[a, :D]) + b) over row r's quantized values (runtime D)."""
    if BITS_ == 8:
        for d in range(D):
            acc[a, d] = fma_f32(s, np.float32(table[r, d]), (np.float32(0) if fresh else acc[a, d]) + b)
    else:
        for k in range(D // 2):
            v = table[r, k]
            lo, hi = np.float32(v & np.uint8(15)), np.float32(v >> np.uint8(4))
            acc[a, 2 * k] = fma_f32(s, lo, (np.float32(0) if fresh else acc[a, 2 * k]) + b)
            acc[a, 2 * k + 1] = fma_f32(s, hi, (np.float32(0) if fresh else acc[a, 2 * k + 1]) + b)
        if D % 2:
            last = np.float32(table[r, D // 2] & np.uint8(15))
            acc[a, D - 1] = fma_f32(s, last, (np.float32(0) if fresh else acc[a, D - 1]) + b)


@jit(inline="always")
def _row_layout(D, BITS_):
    """(bytes of values, bytes per row) of a packed row, as q_bytes and row_bytes (njit)."""
    qb = D if BITS_ == 8 else (D + 1) // 2
    return qb, qb + (8 if BITS_ == 8 else 4)


@jit(inline="always")
def _prefetch_qrow(table, r, rb):
    """Prefetch every line of row r (rb bytes) into L2: its first and last byte and every 64 bytes
    between (packed rows are rarely whole lines, so they straddle one more line than rb / 64)."""
    prefetch_l2(table, r, 0)
    for k in range(64, rb - 64, 64):
        prefetch_l2(table, r, k)
    prefetch_l2(table, r, rb - 1)


@jit(inline="always", fastmath=_STRICT)
def _pool_qbag(acc, table, indices, psw, s, e, nnz, PF, D, DC, BITS_, weighted):
    """acc[0] = sum over j in [s, e) of psw[j]-scaled dequantized rows indices[j], prefetching PF ahead."""
    QB, rb = _row_layout(D, BITS_)
    far = np.uint64(nnz - 1)
    for d in range(D):
        acc[0, d] = 0.0
    for j in range(s, e):
        u = np.uint64(j)  # validated and non-negative: unsigned indexing skips numba's wraparound code
        _prefetch_qrow(table, indices[min(u + np.uint64(PF), far)], rb)
        r = indices[u]
        sc, bi = row_scale_bias(table, r, QB, BITS_)
        if weighted:  # FBGEMM scales scale and bias, not the dequantized row
            sc, bi = sc * psw[u], bi * psw[u]
        if DC:
            qrow_fma(acc, table, r, sc, bi, DC, BITS_)
        else:
            _dequant_row(acc, 0, table, r, sc, bi, D, BITS_, False)


@jit(inline="always", fastmath=_STRICT)
def _pool_qbags(table, indices, offsets, psw, mean, last, out, b0, b1, DC, PF, BITS_):
    """out[b] = the pooled dequantized rows of bag b, for b0 <= b < b1 (one work unit)."""
    nbags, nnz, D = out.shape[0], indices.shape[0], DC if DC else out.shape[1]
    acc = stack_f32(DC) if DC else np.empty((1, D), np.float32)
    if b0 < b1:  # the first PF rows: the row loop prefetches PF ahead of itself only
        rb = _row_layout(D, BITS_)[1]
        for j in range(offsets[b0], min(offsets[b0] + PF, bag_end(offsets, b1 - 1, nbags, nnz, last))):
            _prefetch_qrow(table, indices[j], rb)
    for b in range(b0, b1):
        s, e = offsets[b], bag_end(offsets, b, nbags, nnz, last)
        if psw.shape[0] > 0:  # two copies of the row loop, so the common unweighted one has no per-row test
            _pool_qbag(acc, table, indices, psw, s, e, nnz, PF, D, DC, BITS_, True)
        else:
            _pool_qbag(acc, table, indices, psw, s, e, nnz, PF, D, DC, BITS_, False)
        inv = np.float32(1.0) / np.float32(e - s) if mean and e > s else np.float32(1.0)
        _store_bag(out, b, acc, inv, D, DC, BITS_)


@jit(inline="always", fastmath=_STRICT)
def _store_bag(out, b, acc, inv, D, DC, BITS_):
    """out[b] = acc[0] * inv, acc in qrow_fma's element order."""
    if DC:
        qrow_store(out, b, acc, inv, DC, BITS_)
    else:
        for d in range(D):
            out[b, d] = acc[0, d] * inv


@kernel_factory("embedding_bag_quantized_forward")
def _forward_factory(spec):
    DC, PF, BITS_ = spec["D"], spec["pf"], spec["bits"]

    @jit(parallel=True, fastmath=_STRICT)
    def forward(table, indices, offsets, psw, mean, last, nchunks, out):
        # table: (R, row bytes) uint8, indices: (nnz,), offsets: (B,)|(B+1,), psw: (nnz,)|(0,), out: (B, D)
        nbags = out.shape[0]
        code, bad, value = check_bags((indices, offsets, psw, mean, last), nbags, table.shape[0])
        if code:
            return code, bad, value
        for c in prange(nchunks):
            _pool_qbags(table, indices, offsets, psw, mean, last, out, c * nbags // nchunks,
                        (c + 1) * nbags // nchunks, DC, PF, BITS_)
        return 0, 0, 0

    @jit(fastmath=_STRICT)
    def pool(table, indices, offsets, psw, mean, last, out):
        _pool_qbags(table, indices, offsets, psw, mean, last, out, 0, out.shape[0], DC, PF, BITS_)

    @jit(fastmath=_STRICT)
    def forward_serial(table, indices, offsets, psw, mean, last, nchunks, out):
        # the same on the calling thread: starting a parallel region costs ~1.5 us
        code, bad, value = validate_bags((indices, offsets, psw, mean, last), out.shape[0], table.shape[0])
        if code:
            return code, bad, value
        pool(table, indices, offsets, psw, mean, last, out)
        return 0, 0, 0
    return forward_serial if spec["serial"] else forward


# ----------------------------------------------------------------------------- prefetch knob


def _quantized_bits(itemsize):
    """Workload tables of itemsize 1 are 8-bit quantized, 0.5 4-bit (fp32 / bf16 tables pose nothing here)."""
    return {1: 8, 0.5: 4}.get(itemsize)


def _problems(workload):
    for rows, dim, _pooling, _batch, itemsize in workload.tables:
        bits = _quantized_bits(itemsize)
        if bits:
            yield int(rows), int(dim), bits


def _runner(problem, params):
    """A bag forward at pooling 20, B = 2048 with the given prefetch distance, a new batch per call."""
    rows, dim, bits = problem
    rng = np.random.default_rng(0)
    table = QuantizedTable(empty_table(rows, row_bytes(dim, bits), np.uint8), bits, dim)
    table.data[:] = quantize_rowwise(rng.standard_normal((1, dim), dtype=np.float32), bits).data  # every page touched
    # posed as a table of row_bytes / dim bytes per element, so the pool covers the rows' bytes
    batches, _ = draw_batches((rows, dim, 20, 2048, row_bytes(dim, bits) / dim, 1))
    out = np.empty((2048, dim), np.float32)
    kern = _forward_kernel(_d_class(dim), bits, int(params["pf"]), _serial(2048 * 20 * dim))
    return cycle([functools.partial(kern, table.data, bags[0], bags[1], _NO_PSW, False, False, _CHUNKS, out)
                  for bags in batches], batches)


PREFETCH = knob(
    "embedding.quantized.prefetch", doc="rows ahead the quantized bag forward prefetches (pf)",
    heuristic=lambda p: {"pf": prefetch_distance(row_bytes(p[1], p[2]))},
    shape_class=lambda p: f"{p[2]}bit{pow2_class(p[0], row_bytes(p[1], p[2]))}",
    problems=_problems, runner=_runner,
    candidates=lambda p, quick: [{"pf": d} for d in ((8, 16, 32, 64) if quick else (4, 8, 12, 16, 24, 32, 48, 64))])


# ----------------------------------------------------------------------------- public op


def _d_class(d: int) -> int:
    """The compile-time width for D, or 0 for the generic runtime-D kernel."""
    return d if d in SPECIALISED_D else 0


@functools.lru_cache(maxsize=1024)
def _prefetch_for(num_rows, dim, bits, _db_generation):
    """The knob's prefetch distance, memoised per table shape and tuning-DB generation: the knob's own
    memo key reads five environment variables (~5 us, more than a small forward's kernel time)."""
    return int(PREFETCH.choose((num_rows, dim, bits))["pf"])


@functools.lru_cache(maxsize=None)
def _forward_kernel(dclass, bits, pf, serial):
    return get_kernel(KernelSpec.make("embedding_bag_quantized_forward", D=dclass, bits=bits, pf=pf, serial=serial))


def _serial(work: int) -> bool:
    """Whether the forward runs on the calling thread: one thread, or too little work to pay for
    starting others."""
    return work <= SERIAL_WORK or num_threads() == 1


def embedding_bag_quantized_forward(table, indices, offsets, *, mode="sum", per_sample_weights=None,
                                    include_last_offset=False, out=None):
    """Pooled dequantized rows per bag; table: QuantizedTable (R, D), indices: (nnz,), offsets: (B,) -> (B, D)."""
    if not isinstance(table, QuantizedTable):
        raise TypeError(f"table must be a QuantizedTable, got {type(table).__name__}")
    choice("mode", mode, _MODES)
    idx, off = index_array("indices", indices), index_array("offsets", offsets)  # copies where not contiguous
    if off.dtype != I64:
        off = off.astype(np.int64)
    last = bool(include_last_offset)
    if last and off.shape[0] == 0:
        raise ValueError("with include_last_offset, offsets must have B + 1 >= 1 entries")
    nbags, nnz, (R, D) = off.shape[0] - last, idx.shape[0], table.shape
    psw = _NO_PSW if per_sample_weights is None else float_array("per_sample_weights", per_sample_weights,
                                                                   shape=(nnz,))
    if out is None:
        out = np.empty((nbags, D), np.float32)
    else:  # the caller's own arrays: no_overlap skips a None per_sample_weights
        output("out", out, (nbags, D), table.data, indices, offsets, per_sample_weights)
    pf = _prefetch_for(R, D, table.bits, tunedb.generation())
    kern = _forward_kernel(_d_class(D), table.bits, pf, _serial(nnz * D))
    code, pos, val = kern(table.data, idx, off, psw, mode == "mean", last, min(_CHUNKS, nbags), out)
    if code:
        raise_bag_error(code, pos, val, "table", R, nnz)
    return out
