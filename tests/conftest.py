"""Shared test settings: hypothesis profiles sized for a 2-core machine, numba compile included."""
import os

# Idle OpenMP workers (numba's parallel kernels) sleep instead of spinning: on a busy 2-core box,
# spinning workers starved the thread doing the work and made 2-thread kernels 10-30x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hypothesis import HealthCheck, settings  # noqa: E402

# Kernels compile once per specialisation (and are cached on disk); examples are cheap after
# that, so the budget is examples, not time: no deadline, because a first call compiles.
settings.register_profile("default", deadline=None, max_examples=40,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", deadline=None, max_examples=400,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("JITKERN_HYPOTHESIS_PROFILE", "default"))
