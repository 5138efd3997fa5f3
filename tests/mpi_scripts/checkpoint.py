"""Sharded checkpoints under mpiexec (or one process): save, optionally fail mid-save, load.

usage: [mpiexec -n P] python checkpoint.py save DIR [fail]   train 2 steps, save; DIR/expected.npz
       [mpiexec -n P] python checkpoint.py load DIR          load, compare with DIR/expected.npz
With `fail`, a second save after 2 more steps dies on rank 1 once its first file is written.
"""
import os
import sys

import numpy as np

from jitkern.dlrm import dist_checkpoint
from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import random_batch

SIZES = [3, 2000, 5000, 1200, 50]
ARCH = {"sizes": SIZES}


def train(model, steps, seed):
    rs = np.random.RandomState(seed)
    for _ in range(steps):
        b = random_batch(rs, SIZES, 5, 31, 2, False)
        model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)


def main(mode, path, fail):
    comm = comm_from_env()
    rank = 0 if comm is None else comm.Get_rank()
    model = DLRM(SIZES, 16, [5, 16], [8, 1], seed=3, comm=comm)
    if mode == "save":
        train(model, 2, 0)
        dist_checkpoint.save_checkpoint(path, model, {"step": 2}, ARCH)
        full = model.state_dict()
        if rank == 0:
            np.savez(os.path.join(path, "..", "expected.npz"), **full)
        if fail:
            train(model, 2, 1)
            real = dist_checkpoint._write_array

            def dying(p, a):
                entry = real(p, a)
                if rank == 1:
                    raise RuntimeError("injected failure during save")
                return entry

            dist_checkpoint._write_array = dying
            dist_checkpoint.save_checkpoint(path, model, {"step": 4}, ARCH)
    else:
        meta = dist_checkpoint.load_checkpoint(path, model, ARCH)
        full = model.state_dict()
        expected = np.load(os.path.join(path, "..", "expected.npz"))
        err = max(float(np.abs(full[k] - expected[k]).max()) for k in expected.files)
        if rank == 0:
            print(f"loaded step {meta['step']} max error {err}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["fail"])
