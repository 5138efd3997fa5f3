"""Code generation core: host target, kernel specs, spec -> kernel builder, SIMD, tuning."""
from .build import get_kernel, jit, kernel_factory
from .spec import KernelSpec
from .target import Target, host_target

__all__ = ["KernelSpec", "Target", "get_kernel", "host_target", "jit", "kernel_factory"]
