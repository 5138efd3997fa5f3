"""PLACEHOLDER until the kernel issue lands: delegates to the NumPy references."""
from .reference import ( # noqa: F401
    sgd_,
)
