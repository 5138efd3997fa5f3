"""Checkpoints under mpiexec (or one process): save, optionally fail mid-save, load, resume.

usage: [mpiexec -n P] python checkpoint.py save DIR [fail]   train 2 steps, save; DIR/../expected.npz,
                                                            and after 2 more steps DIR/../after.npz
       [mpiexec -n P] python checkpoint.py load PATH [FILE]  load, compare with expected.npz (and save
                                                            it again to FILE: one process writes a
                                                            file); train the same 2 steps, compare
                                                            with after.npz
PATH: the sharded directory P ranks save, or the file one process saves (checkpoint.save_checkpoint).
The model trains by Adagrad (element-wise tables): its optimizer state is saved and loaded with it.
With `fail`, a second save after the 2 more steps dies on rank 1 once its first file is written.
"""
import os
import sys

import numpy as np

from jitkern.dlrm import dist_checkpoint
from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import random_batch
from jitkern.dlrm.checkpoint import load_checkpoint, save_checkpoint

SIZES = [3, 2000, 5000, 1200, 50]


def train(model, steps, seed):
    rs = np.random.RandomState(seed)
    for _ in range(steps):
        b = random_batch(rs, SIZES, 5, 31, 2, False)
        model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.02)


def fail_on_rank_1(rank):
    """From now on, rank 1 dies after writing its first checkpoint file."""
    real = dist_checkpoint._write_array

    def dying(p, a):
        entry = real(p, a)
        if rank == 1:
            raise RuntimeError("injected failure during save")
        return entry

    dist_checkpoint._write_array = dying


def err(model, ref, name):
    """max |difference| of every parameter and optimizer state array from the npz `name` in ref."""
    full = model.checkpoint_arrays()
    expected = np.load(os.path.join(ref, name))
    assert set(full) == set(expected.files) and any(k.startswith("state.emb.") for k in full)
    return max(float(np.abs(full[k] - expected[k]).max()) for k in expected.files)


def main(mode, path, arg):
    comm = comm_from_env()
    rank = 0 if comm is None else comm.Get_rank()
    model = DLRM(SIZES, 16, [5, 16], [8, 1], seed=3, comm=comm, optimizer="adagrad")
    ref = os.path.dirname(os.path.abspath(path))
    if mode == "save":
        train(model, 2, 0)
        save_checkpoint(path, model, {"step": 2})
        full = {k: v.copy() for k, v in model.checkpoint_arrays().items()}     # live arrays among them
        train(model, 2, 1)
        after = model.checkpoint_arrays()
        if rank == 0:
            np.savez(os.path.join(ref, "expected.npz"), **full)
            np.savez(os.path.join(ref, "after.npz"), **after)
        if arg == "fail":
            fail_on_rank_1(rank)
            save_checkpoint(path, model, {"step": 4})
    else:
        meta = load_checkpoint(path, model)
        loaded = err(model, ref, "expected.npz")
        if arg:
            save_checkpoint(arg, model, meta)
        train(model, 2, 1)
        after = err(model, ref, "after.npz")
        if rank == 0:
            print(f"loaded step {meta['step']} max error {loaded}; resumed max error {after}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], (sys.argv[3:] or [None])[0])
