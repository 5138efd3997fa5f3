"""Run under mpiexec: a P-rank DLRM and a one-process DLRM on the same batches; rank 0 prints JSON.

usage: mpiexec -n P python equivalence.py BATCH STEPS INTERACTION SELF_INTERACTION [PRECISION]
"""
import json
import zlib
import sys

import numpy as np

from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.placement import place_tables
from jitkern.dlrm.planner import whole_table_plan
from jitkern.dlrm.synth import random_batch

SIZES = [3, 50, 2000, 700, 5000, 64, 1200, 3000]     # tiny ones are replicated, the rest placed
DIM = 16


def main(batch, steps, interaction, self_interaction, precision):
    comm = comm_from_env()
    arch = dict(embedding_sizes=SIZES, embedding_dim=DIM, bottom_mlp=[5, 24, DIM], top_mlp=[20, 1],
                interaction=interaction, self_interaction=self_interaction, seed=7,
                embedding_precision=precision)
    if interaction == "dcn":
        arch.update(dcn_layers=2, dcn_rank=6)
    # the whole-table placement (tiny tables replicated, fp32 and bf16 alike)
    plan = whole_table_plan(place_tables(SIZES, DIM, comm.Get_size()))
    dist = DLRM(**arch, comm=comm, sharding=plan)
    single = DLRM(**arch)
    rs = np.random.RandomState(3)
    batches = [random_batch(rs, SIZES, 5, batch, 4, False) for _ in range(steps)]
    batches.append(random_batch(rs, SIZES, 5, 2, 4, False))     # B < P: a rank gets no rows
    losses_d = [dist.train_step(b.dense, b.offsets, b.indices, b.labels, 0.2) for b in batches]
    losses_s = [single.train_step(b.dense, b.offsets, b.indices, b.labels, 0.2) for b in batches]
    probs_d = dist.forward(batches[0].dense, batches[0].offsets, batches[0].indices)
    probs_s = single.forward(batches[0].dense, batches[0].offsets, batches[0].indices)
    sd_d, sd_s = dist.state_dict(), single.state_dict()
    weight_err = max(float(np.abs(sd_d[k] - sd_s[k]).max()) for k in sd_s)
    # replicas must agree bit for bit: compare every rank's MLP bytes and losses with rank 0's
    mine = b"".join(sd_d[k].tobytes() for k in sorted(sd_d)) + np.array(losses_d).tobytes()
    same = comm.allgather(zlib.crc32(mine)) if comm is not None else [0]
    # load a full model on every rank, then the forward must match the source model's
    dist.load_state_dict(single.state_dict())
    probs_l = dist.forward(batches[1].dense, batches[1].offsets, batches[1].indices)
    probs_ls = single.forward(batches[1].dense, batches[1].offsets, batches[1].indices)
    if comm is None or comm.Get_rank() == 0:
        print(json.dumps({
            "ranks": 1 if comm is None else comm.Get_size(),
            "placement": [-1 if s.kind == "replicate" else s.ranks[0] for s in dist.plan.tables],
            "losses_dist": losses_d, "losses_single": losses_s,
            "weight_err": weight_err,
            "probs_err": float(np.abs(probs_d - probs_s).max()),
            "load_probs_err": float(np.abs(probs_l - probs_ls).max()),
            "replicas_identical": len(set(same)) == 1,
        }))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", (sys.argv[5:] or ["fp32"])[0])
