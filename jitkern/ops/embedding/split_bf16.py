"""BF16 Split-SGD storage: an fp32 embedding table held as two uint16 halves (the SC20 paper's
Split-SGD). `hi` is exactly the bf16 weight that lookups read (half the bytes of fp32), `lo` the
low 16 mantissa bits the update needs to reassemble the exact fp32 value, so BF16 training
matches fp32 SGD bit for bit.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from ...codegen import jit, knobs, num_threads
from ...codegen.bf16 import as_float32, as_uint32
from ._rows import empty_table


@jit(parallel=True)
def _split(w, hi, lo):
    for i in prange(w.shape[0]):
        for j in range(w.shape[1]):
            bits = as_uint32(w[i, j])
            hi[i, j] = np.uint16(bits >> np.uint32(16))
            lo[i, j] = np.uint16(bits & np.uint32(0xFFFF))


@jit(parallel=True)
def _join(hi, lo, w):
    for i in prange(w.shape[0]):
        for j in range(w.shape[1]):
            w[i, j] = as_float32((np.uint32(hi[i, j]) << np.uint32(16)) | np.uint32(lo[i, j]))


LAYOUTS = ("split", "pairs")
LAYOUT_KNOB = "embedding.bf16.layout"  # declared in layout.py, with a runner that times the kernels


def layout_for(rows: int, dim: int, threads: int | None = None) -> str:
    """The layout (LAYOUTS) SplitBF16Table.from_float32 builds a (rows, dim) table in: the layout
    knob's choice, tuned or heuristic (looked up by name: its runner imports the kernels, whose
    modules import this one)."""
    threads = num_threads() if threads is None else threads
    return knobs.get(LAYOUT_KNOB).choose((int(rows), int(dim), 1, 1, 2, int(threads)))["layout"]


def _dense_rows(name, a):
    """Check a half: a 2-D aligned uint16 array whose rows are dense (unit element stride)."""
    if not isinstance(a, np.ndarray) or a.dtype != np.uint16:
        raise TypeError(f"{name} must be a uint16 ndarray, got {getattr(a, 'dtype', type(a))}")
    if (a.ndim != 2 or not a.flags.aligned or (a.shape[1] > 1 and a.strides[1] != 2)
            or (a.shape[0] > 1 and a.strides[0] < 2 * a.shape[1])):
        raise ValueError(f"{name} must be an aligned 2-D array of dense rows (C-contiguous, or a row-strided "
                         f"view), got shape {a.shape} strides {a.strides}")


def _disjoint_rows(hi, lo) -> bool:
    """Whether no element of hi is one of lo (equal shapes, dense rows): separate arrays, or rows
    of equal strides interleaved, each row of one between two rows of the other."""
    if hi.size == 0 or not np.may_share_memory(hi, lo):
        return True
    if hi.strides != lo.strides:
        return False  # no layout this class makes; not worth an exact test
    width, gap = 2 * hi.shape[1], lo.ctypes.data - hi.ctypes.data
    if hi.shape[0] == 1:
        return abs(gap) >= width
    stride = hi.strides[0]
    return width <= gap % stride <= stride - width


class SplitBF16Table:
    """An fp32 (R, D) table held as bf16 high halves `hi` (R, D) uint16 and low halves `lo` (R, D) uint16.

    Accepted as `weight` by embedding_bag_forward (reads `hi` only, as bf16) and by
    embedding_bag_sgd_ (reassembles fp32, applies SGD, splits again: exact fp32 SGD).

    Two layouts (`layout`): "split", two arrays; "pairs", the halves of one (R, 2D) array whose row
    r is hi[r] then lo[r]. An update of row r then touches one page, not two: on a table beyond the
    TLB's reach each page is a walk (Zen 4, R=1e7 D=128: Split-SGD 1.47x the fp32 time split,
    1.11x pairs). A forward that reads hi alone finds half of each pair's lines useless to cache,
    so tables the caches could hold stay split (see layout_for).
    """
    __slots__ = ("hi", "lo", "__weakref__")  # weakly held by the tuner's table memo

    def __init__(self, hi, lo):
        """Wrap the halves as given (updates write them in place): two (R, D) uint16 arrays of dense
        rows that share no element, e.g. two C-contiguous arrays, or the two column halves of
        one (R, 2D) array (then `layout` is "pairs")."""
        _dense_rows("hi", hi)
        _dense_rows("lo", lo)
        if hi.shape != lo.shape:
            raise ValueError(f"hi shape {hi.shape} and lo shape {lo.shape} differ")
        if not _disjoint_rows(hi, lo):
            raise ValueError("hi and lo overlap: each element needs its own high and low half")
        self.hi, self.lo = hi, lo

    @classmethod
    def empty(cls, rows: int, dim: int, layout: str = "split") -> "SplitBF16Table":
        """An uninitialised table in `layout` (LAYOUTS), on the memory empty_table gives tables."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "pairs":
            pairs = empty_table(rows, 2 * dim, np.uint16)
            return cls(pairs[:, :dim], pairs[:, dim:])
        return cls(empty_table(rows, dim, np.uint16), empty_table(rows, dim, np.uint16))

    @classmethod
    def from_float32(cls, weight, layout: str | None = None) -> "SplitBF16Table":
        """Split a float32 (R, D) table exactly into its high and low halves, in `layout` (default:
        layout_for the table's size)."""
        w = np.ascontiguousarray(weight)
        if w.dtype != np.float32 or w.ndim != 2:
            raise TypeError(f"weight must be a 2-D float32 array, got {w.dtype} with shape {w.shape}")
        if layout is None:
            layout = layout_for(*w.shape)
        table = cls.empty(w.shape[0], w.shape[1], layout)
        if w.size:
            _split(w, table.hi, table.lo)
        return table

    @property
    def layout(self) -> str:
        """"pairs" where lo[r] directly follows hi[r] (one (R, 2D) array), else "split"."""
        hi, lo = self.hi, self.lo
        width = 2 * hi.shape[1]
        adjacent = lo.ctypes.data == hi.ctypes.data + width and hi.strides == lo.strides
        return "pairs" if adjacent and (hi.shape[0] < 2 or hi.strides[0] == 2 * width) else "split"

    def to_float32(self) -> np.ndarray:
        """The exact float32 table (R, D) reassembled from both halves."""
        w = np.empty(self.hi.shape, np.float32)
        if w.size:
            _join(self.hi, self.lo, w)
        return w

    @property
    def shape(self) -> tuple:
        return self.hi.shape

    @property
    def num_rows(self) -> int:
        return self.hi.shape[0]

    @property
    def dim(self) -> int:
        return self.hi.shape[1]

    def __repr__(self) -> str:
        return f"SplitBF16Table(num_rows={self.num_rows}, dim={self.dim}, layout={self.layout!r})"
