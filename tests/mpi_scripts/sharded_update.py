"""Run under mpiexec: the sharded dense update (dlrm/dense_shard.py) against the update it replaces,
an allreduce of the gradients and every rank applying the optimizer to all of them; rank 0 prints
JSON.

usage: mpiexec -n P python sharded_update.py OPTIMIZER

Buckets mix fp32 arrays and bf16 Split weights, one array alone and several packed together, with
sizes that put chunk boundaries inside parameters (and a bias smaller than P).
"""
import json
import sys

import numpy as np

from jitkern.dlrm.dense_shard import ShardedUpdate
from jitkern.dlrm.exchange import Exchange
from jitkern.dlrm.launch import comm_from_env
from jitkern.dlrm.model_state import SplitWeight
from jitkern.dlrm.optimizers import DenseAdagrad, DenseOptimizer

SHAPES = [(37, 11), (5,), (2,), (64, 9), (1,), (301,)]
SPLIT = {1, 3}          # these are bf16 Split weights
BUCKETS = [[0], [1, 2, 3], [4, 5]]
LR = 0.05


def parameters(opt):
    rs = np.random.RandomState(11)
    params, states = [], []
    for i, shape in enumerate(SHAPES):
        w = rs.standard_normal(shape).astype(np.float32)
        params.append(SplitWeight(w) if i in SPLIT else w)
        s = opt.state(shape)
        states.append(None if s is None else rs.uniform(0, 1, shape).astype(np.float32))
    return params, states


def gradients(rank, step):
    rs = np.random.RandomState(1000 * step + rank)
    return [rs.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def weights(params):
    return [p.to_float32() if isinstance(p, SplitWeight) else p.copy() for p in params]


def main(optimizer):
    comm = comm_from_env()
    ex = Exchange(comm)
    opt = DenseAdagrad() if optimizer == "adagrad" else DenseOptimizer()
    sharded, sharded_states = parameters(opt)
    plain, plain_states = parameters(opt)

    def step(p, s, g, lr):  # the model's dense step: SplitWeights updated in fp32
        if isinstance(p, SplitWeight):
            p.step(opt, s, g, lr)
        else:
            opt.step(p, s, g, lr)

    upd = ShardedUpdate(ex, step)
    for it in range(3):
        g1, g2 = gradients(ex.rank, it), gradients(ex.rank, it)
        for bucket in BUCKETS:
            upd.post("sharded", [(sharded[i], sharded_states[i], g1[i]) for i in bucket], LR)
            ex.iallreduce("plain", [g2[i] for i in bucket])
        ex.wait_all()
        for p, s, g in zip(plain, plain_states, g2):
            step(p, s, g, LR)
    same_w = all(np.array_equal(a.view(np.uint32), b.view(np.uint32))
                 for a, b in zip(weights(sharded), weights(plain)))
    same_s = all(s is None or np.array_equal(s.view(np.uint32), t.view(np.uint32))
                 for s, t in zip(sharded_states, plain_states))
    moved = not all(np.array_equal(a, b) for a, b in zip(weights(sharded), weights(parameters(opt)[0])))
    gathered = comm.gather([w.tobytes() for w in weights(sharded)], root=0)
    if ex.rank == 0:
        print(json.dumps(dict(ranks=ex.size, same_weights=bool(same_w), same_state=bool(same_s),
                              moved=bool(moved), replicas_identical=all(g == gathered[0] for g in gathered))))


if __name__ == "__main__":
    main(sys.argv[1])
