"""jitkern: CPU kernels generated just in time for the shapes and CPU at hand, and a DLRM built from them."""
__version__ = "0.1.0"


def set_num_threads(n: int) -> None:
    """Threads used by jitkern's parallel kernels (and NumPy's BLAS) in this process."""
    import numba
    from threadpoolctl import threadpool_limits

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    threadpool_limits(n)
