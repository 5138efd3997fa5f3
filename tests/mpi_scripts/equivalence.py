"""Run under mpiexec: a P-rank DLRM and a one-process DLRM on the same batches; rank 0 prints JSON.

usage: mpiexec -n P python equivalence.py BATCH STEPS INTERACTION SELF_INTERACTION [PRECISION [OPTIMIZER]]

PRECISION: fp32; bf16 (bf16 Split-SGD tables, fp32 MLPs); bf16-all (precision="bf16": bf16 MLPs,
interaction and tables).

OPTIMIZER: the model's optimizer= (sgd; adagrad: Adagrad MLPs and element-wise Adagrad tables;
rwsadagrad); the optimizer state is compared too.
"""
import json
import sys

import numpy as np
from compare import loads_state, trained

from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.placement import place_tables
from jitkern.dlrm.planner import whole_table_plan
from jitkern.dlrm.synth import random_batch
from jitkern.dlrm.tables import QR

SIZES = [3, 50, 2000, 700, 5000, 64, 1200, 3000]     # tiny ones are replicated, the rest placed
DIM = 16


def refusals(arch, comm):
    """What the P-rank model refuses with these optimizers, as one process does or by MPI: the errors."""
    said = []
    for extra in (dict(embedding_precision="bf16"), dict(qr=QR(100, 4, "mult"))):
        try:
            DLRM(**dict(arch, **extra), comm=comm)
        except (ValueError, NotImplementedError) as e:
            said.append(f"{type(e).__name__}: {e}")
    return said


def main(batch, steps, interaction, self_interaction, precision, optimizer):
    comm = comm_from_env()
    arch = dict(embedding_sizes=SIZES, embedding_dim=DIM, bottom_mlp=[5, 24, DIM], top_mlp=[20, 1],
                interaction=interaction, self_interaction=self_interaction, seed=7, optimizer=optimizer)
    if precision == "bf16-all":
        arch.update(precision="bf16")
    else:
        arch.update(embedding_precision=precision)
    lr = 0.2 if optimizer == "sgd" else 0.02
    if interaction == "dcn":
        arch.update(dcn_layers=2, dcn_rank=6)
    # the whole-table placement (tiny tables replicated, fp32 and bf16 alike)
    plan = whole_table_plan(place_tables(SIZES, DIM, comm.Get_size()))
    dist = DLRM(**arch, comm=comm, sharding=plan)
    single = DLRM(**arch)
    rs = np.random.RandomState(3)
    batches = [random_batch(rs, SIZES, 5, batch, 4, False) for _ in range(steps)]
    batches.append(random_batch(rs, SIZES, 5, 2, 4, False))     # B < P: a rank gets no rows
    losses_d = [dist.train_step(b.dense, b.offsets, b.indices, b.labels, lr) for b in batches]
    losses_s = [single.train_step(b.dense, b.offsets, b.indices, b.labels, lr) for b in batches]
    probs_d = dist.forward(batches[0].dense, batches[0].offsets, batches[0].indices)
    probs_s = single.forward(batches[0].dense, batches[0].offsets, batches[0].indices)
    out = trained(dist, single, losses_d, lr, comm)
    # load a full model (with its optimizer state) on every rank: the state reads back exactly, and
    # the forward matches the source model's
    out["load_state_exact"] = loads_state(dist, single)
    probs_l = dist.forward(batches[1].dense, batches[1].offsets, batches[1].indices)
    probs_ls = single.forward(batches[1].dense, batches[1].offsets, batches[1].indices)
    if optimizer != "sgd":
        out["refused"] = refusals(arch, comm)
    if comm is None or comm.Get_rank() == 0:
        print(json.dumps(dict(
            out, ranks=1 if comm is None else comm.Get_size(),
            placement=[-1 if s.kind == "replicate" else s.ranks[0] for s in dist.plan.tables],
            losses_dist=losses_d, losses_single=losses_s,
            probs_err=float(np.abs(probs_d - probs_s).max()),
            load_probs_err=float(np.abs(probs_l - probs_ls).max()))))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", (sys.argv[5:] or ["fp32"])[0],
         (sys.argv[6:] or ["sgd"])[0])
