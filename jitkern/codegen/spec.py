"""KernelSpec: the one name of a kernel specialisation (op, dtype, compile-time parameters)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """A frozen, hashable description of one specialisation.

    `params` holds the compile-time constants (block sizes, epilogue, transposition, width,
    ISA) as sorted (name, value) pairs, so equal specs hash equally whatever the keyword order.
    """
    op: str
    dtype: str = "float32"
    params: tuple = ()

    @classmethod
    def make(cls, op: str, dtype: str = "float32", **params) -> "KernelSpec":
        for k, v in params.items():
            if not isinstance(v, (int, float, str, bool, type(None), tuple)):
                raise TypeError(f"KernelSpec parameter {k}={v!r} must be a hashable scalar or tuple")
        return cls(op, dtype, tuple(sorted(params.items())))

    def __getitem__(self, name):
        for k, v in self.params:
            if k == name:
                return v
        raise KeyError(f"{self.op} spec has no parameter {name!r}")

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def replace(self, **params) -> "KernelSpec":
        merged = dict(self.params)
        merged.update(params)
        return KernelSpec.make(self.op, self.dtype, **merged)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.op}[{self.dtype}]({inner})"
