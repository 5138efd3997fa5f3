"""torch's CPU random generator, as far as the reference DLRM draws its table inits from it.

The reference seeds torch with --numpy-rand-seed and initialises its quotient-remainder tables
(torch.nn.init.uniform_) and mixed-dimension projections (xavier_uniform_) from torch's stream,
while every module it constructs on the way (nn.EmbeddingBag: normal_, nn.Linear:
kaiming_uniform_) consumes numbers from it. torch's CPU generator is an mt19937 seeded as
NumPy's legacy RandomState (init_genrand), so the same 32-bit words come from RandomState; this
class turns them into torch's float32 draws and consumes them as torch's kernels do.
"""
from __future__ import annotations

import math

import numpy as np

_MASK24 = np.uint64((1 << 24) - 1)
_SKIP_CHUNK = 1 << 20            # words drawn per call when skipping (no table-sized temporaries)
_NORMAL_VECTOR_MIN = 16          # normal_ of at least this many floats takes the vectorised path


class TorchGenerator:
    """torch.manual_seed(seed)'s CPU generator: uniform_, normal_ (its consumption) and the inits
    built on them, for float32 tensors."""

    def __init__(self, seed: int):
        self._rs = np.random.RandomState(seed)
        self._cached_normal = False     # the second Box-Muller sample of a scalar normal draw

    def _words(self, n: int) -> np.ndarray:
        """The next n 32-bit outputs of the mt19937 stream, as uint64."""
        return self._rs.randint(0, 1 << 32, size=n, dtype=np.uint64)

    def _skip(self, n: int) -> None:
        for k in range(0, n, _SKIP_CHUNK):
            self._words(min(_SKIP_CHUNK, n - k))

    def skip_uniform(self, shape) -> None:
        """Consume what tensor.uniform_ (or an init built on it) takes, without the values."""
        self._skip(math.prod(shape))

    def uniform(self, shape, low: float, high: float) -> np.ndarray:
        """tensor.uniform_(low, high): 24 random bits x in [0, 1), then fma(x, high - low, low) in float32."""
        n = math.prod(shape)
        x = (self._words(n) & _MASK24).astype(np.float64) * 2.0 ** -24
        lo, hi = np.float32(low), np.float32(high)
        span = np.float64(np.float32(hi - lo))
        return (x * span + np.float64(lo)).astype(np.float32).reshape(shape)   # one rounding, as an FMA

    def skip_normal(self, shape) -> None:
        """Consume what tensor.normal_() takes: n floats plus 16 for a ragged tail (vectorised path),
        or Box-Muller pairs of 64-bit draws for fewer than 16 (one sample may stay cached)."""
        n = math.prod(shape)
        if n >= _NORMAL_VECTOR_MIN:
            self._skip(n + (_NORMAL_VECTOR_MIN if n % _NORMAL_VECTOR_MIN else 0))
            return
        for _ in range(n):
            if self._cached_normal:
                self._cached_normal = False
            else:
                self._words(4)          # two doubles of 64 bits each
                self._cached_normal = True

    def kaiming_uniform(self, shape) -> np.ndarray:
        """nn.Linear's default init of an (out, in) weight: kaiming_uniform_(a=sqrt(5))."""
        a = math.sqrt(5)
        std = math.sqrt(2.0 / (1 + a ** 2)) / math.sqrt(shape[1])      # torch's formula, term by term
        bound = math.sqrt(3.0) * std
        return self.uniform(shape, -bound, bound)

    def xavier_uniform(self, shape) -> np.ndarray:
        """xavier_uniform_ of an (out, in) weight."""
        std = math.sqrt(2.0 / float(shape[0] + shape[1]))
        bound = math.sqrt(3.0) * std
        return self.uniform(shape, -bound, bound)
