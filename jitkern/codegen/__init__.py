"""Code generation core: host target, kernel specs, spec -> kernel builder, SIMD, per-CPU knobs."""
from .target import Target, host_target, pin_numba_cpu, target_isa

pin_numba_cpu()  # before the first njit decoration below: numba's loops follow JITKERN_ISA

from .build import get_kernel, jit, kernel_factory, num_threads, uidx  # noqa: E402
from .spec import KernelSpec  # noqa: E402

__all__ = ["KernelSpec", "Target", "get_kernel", "host_target", "jit", "kernel_factory", "num_threads", "target_isa", "uidx"]
