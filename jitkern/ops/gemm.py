"""PLACEHOLDER until the kernel issue lands: delegates to the NumPy references."""
from .reference import ( # noqa: F401
    gemm,
    linear_forward,
    linear_backward,
    batch_reduce_gemm,
)
