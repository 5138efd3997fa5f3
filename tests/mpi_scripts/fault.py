"""Run under mpiexec: train a tiny DLRM; rank FAIL_RANK fails at step 2 in the way MODE says.

usage: mpiexec -n P python fault.py MODE FAIL_RANK    (MODE: raise, kill, exit)
"""
import os
import signal
import sys
import time

import numpy as np

from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.synth import random_batch

SIZES = [3, 2000, 5000, 1200]


def main(mode, fail_rank):
    comm = comm_from_env()
    model = DLRM(SIZES, 16, [5, 16], [8, 1], comm=comm)
    if comm.Get_rank() == 0:
        print(model.describe(), flush=True)
    rs = np.random.RandomState(0)
    for step in range(50):
        b = random_batch(rs, SIZES, 5, 33, 2, False)
        if step == 2 and comm.Get_rank() == fail_rank:
            print(f"rank {fail_rank} failing at {time.time()}", flush=True)
            if mode == "raise":
                raise RuntimeError("injected failure")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "exit":
                sys.exit(3)
        model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
