"""What the MPI scripts measure of a P-rank model against one process (imported beside them)."""
import zlib

import numpy as np


def rel_err(a, b):
    """max |a - b| over max |b|."""
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def trained(dist, single, losses_d, lr, comm) -> dict:
    """Weights (max abs error; elements off by more than 1e-6, of how many), optimizer state
    (max relative error per array; names as one process's), and whether every rank holds the
    same bytes of both and the same losses."""
    sd_d, sd_s = dist.state_dict(), single.state_dict()
    st_d, st_s = dist.optimizer_state_dict(), single.optimizer_state_dict()
    assert set(st_d) == set(st_s), (sorted(st_d), sorted(st_s))
    diff = np.concatenate([np.abs(sd_d[k] - sd_s[k]).ravel() for k in sd_s])
    mine = b"".join(a[k].tobytes() for a in (sd_d, st_d) for k in sorted(a)) + np.array(losses_d).tobytes()
    return {"weight_err": float(diff.max()), "weight_outliers": int((diff > 1e-6).sum()), "weight_size": diff.size,
            "lr": lr, "stateful": bool(st_s), "state_rel": max((rel_err(st_d[k], st_s[k]) for k in st_s), default=0.0),
            "replicas_identical": len(set(comm.allgather(zlib.crc32(mine)))) == 1}


def loads_state(dist, single) -> bool:
    """Load the one-process model's parameters and optimizer state into dist: is the state read back exact?"""
    dist.load_state_dict(single.checkpoint_arrays())
    st_d, st_s = dist.optimizer_state_dict(), single.optimizer_state_dict()
    return all(np.array_equal(st_d[k], st_s[k]) for k in st_s)
