"""The hot loops of the embedding kernels make no NRT reference-count calls.

numba emits NRT_incref/decref (atomic calls) for arrays that a loop hands to inlined helpers,
and its refcount pruning misses some (a helper that unpacks the bags tuple, or branches): per bag
or per entry they cost 2-7x the gather itself. Checked on the machine code of freshly compiled
kernels (numba cannot show the code of kernels loaded from its disk cache); an unusual prefetch
distance gives a kernel no other test compiled.
"""
import numpy as np
import pytest

from jitkern.ops.embedding import forward, sgd
from jitkern.ops.embedding._rows import NO_PSW

_PF = 7  # a distance no knob chooses: a fresh compile


@pytest.fixture
def uncached(monkeypatch):
    monkeypatch.setenv("JITKERN_NO_DISK_CACHE", "1")


def _entry_asm(disp) -> str:
    """The machine code of the dispatcher's compiled function itself (not its Python wrapper)."""
    asm = next(iter(disp.inspect_asm().values()))
    return asm.split(".Lfunc_end0")[0]


def _bags(rows, nbags, pooling, mean):
    rng = np.random.default_rng(0)
    idx = rng.integers(0, rows, nbags * pooling)
    return (idx, np.arange(nbags, dtype=np.int64) * pooling, NO_PSW, mean, False)


@pytest.mark.parametrize("dim, cols", [(32, 1), (64, 1), (128, 1), (128, 2)])
def test_serial_forward_gathers_without_refcounts(uncached, dim, cols):
    kern = forward._serial_kernel(forward._pooler(dim, _PF, 2, 1, 4, cols), dim)
    w = np.ones((50, dim), np.float32)
    out = np.empty((20, dim), np.float32)
    assert kern(w, _bags(50, 20, 1, False), 1, out) == (0, 0, 0)
    np.testing.assert_array_equal(out, 1.0)
    pool_all = next(c.cell_contents for c in kern.py_func.__closure__ if hasattr(c.cell_contents, "inspect_asm"))
    assert "NRT_incref" not in _entry_asm(pool_all)


@pytest.mark.parametrize("bf16", [False, True])
def test_scaled_sgd_loop_counts_no_references(uncached, bf16):
    serial, _ = sgd._loops(64, _PF, bf16, 1, True)  # scaled: mean bags
    rows = 50
    if bf16:
        target = (np.zeros((rows, 64), np.uint16), np.zeros((rows, 64), np.uint16))
    else:
        target = (np.zeros((rows, 64), np.float32), np.empty((0, 64), np.float32))
    bags = _bags(rows, 20, 4, True)
    dout = np.ones((20, 64), np.float32)
    serial(bags, dout, np.float32(0.5), target, np.empty(0, np.float32))
    if not bf16:  # each entry of a bag of 4 adds -0.5 * 1 / 4
        np.testing.assert_allclose(target[0].sum(), -0.125 * 20 * 4 * 64)
    code = _entry_asm(serial)
    assert "NRT_incref" not in code and "NRT_decref" not in code
