"""Run under mpiexec: every sharding kind (and a mixed plan) against one process; rank 0 prints JSON.

usage: [mpiexec -n P] python sharding.py MODE [MODE ...]

contract[-fp32]: the embedding layer alone (pool, then a fixed pooled gradient, then the update),
          three steps: the pooled rows and the tables against one process, per kind (and precision).
train:    whole training steps, a forward and a load, every kind in fp32 and the mixed plan in
          bf16: losses, every weight, probabilities, replicas bit-identical.
train-mixed: the same for the mixed plan only, fp32 and bf16.
adagrad:  row-wise Adagrad on column pieces (per-row squares summed over the column group) against
          ops.embedding_bag_adagrad_ on the whole table.
save=DIR: train the mixed plan two steps, save a sharded checkpoint to DIR and the full model to
          DIR/../expected.npz; load=DIR: load it (auto plan; one process: a plain DLRM), compare.
"""
import json
import os
import sys
import zlib

import numpy as np

from jitkern import ops
from jitkern.dlrm import dist_checkpoint
from jitkern.config import get_config
from jitkern.dlrm.dist import DistributedDLRM
from jitkern.dlrm.launch import comm_from_env, node_groups
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.planner import TableSharding, plan_sharding
from jitkern.dlrm.sharding import ColumnGroup, RowwiseAdagrad, make_shard
from jitkern.dlrm.synth import random_batch
from jitkern.dlrm.train import model_arch

SIZES = [3, 50, 2000, 700, 5000, 64, 1200, 3000]
DIM = 16
MIXED = ["replicate", "table", "row", "column", "table_row", "replicate", "column", "row"]
ARCH = dict(embedding_sizes=SIZES, embedding_dim=DIM, bottom_mlp=[5, 24, DIM], top_mlp=[20, 1], seed=7)


def batches(rs, n, batch, pooling=4):
    out = [random_batch(rs, SIZES, 5, batch, pooling, False) for _ in range(n)]
    out.append(random_batch(rs, SIZES, 5, 2, pooling, False))      # B < P: a rank gets no rows
    return out


def sharding_for(kind, comm):
    """A kind for every table, or the mixed plan (every kind; table_row inside a node)."""
    if kind == "mixed":
        nodes = node_groups(comm, get_config().ranks_per_node)
        return plan_sharding(SIZES, DIM, 4, 67, comm.Get_size(), kinds=MIXED, nodes=nodes)
    return kind


def rel_err(a, b):
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def embedding_step(m, b, dly, lr, comm):
    """Pool, apply the pooled gradient dly (B, T, D), update; -> this process's pooled rows (b, T, D)."""
    ctx = m.step_context(b.dense, b.offsets, b.indices, b.labels, lr)
    lo = getattr(ctx, "layout", None)
    lo, hi = (lo.lo, lo.hi) if lo is not None else (0, len(b.labels))
    m.embedding_forward_start(ctx)
    ly = np.stack(m.embedding_forward(ctx), axis=1) if hi > lo else np.zeros((0, len(SIZES), DIM))
    mine = np.ascontiguousarray(dly[lo:hi])
    if comm is not None:
        m.embedding_backward_start(ctx, mine)
        m._post_grads(ctx.grads, [], final=True)
    m.embedding_update(ctx, mine)
    if comm is not None:
        zeros = lambda ws, bs: [(np.zeros_like(w), np.zeros_like(c)) for w, c in zip(ws, bs)]
        m.dense_update(ctx, zeros(m.bot_w, m.bot_b), zeros(m.top_w, m.top_b))
    return ly, lo, hi


def contract(comm, precisions=("fp32", "bf16")):
    out = {}
    for precision in precisions:
        for kind in ("table", "column", "row", "table_row", "replicate"):
            dist = DLRM(**ARCH, embedding_precision=precision, comm=comm, sharding=kind)
            single = DLRM(**ARCH, embedding_precision=precision)
            rs = np.random.RandomState(3)
            ly_err = 0.0
            for pooling in (1, 4, 4):
                b = batches(rs, 1, 67, pooling)[0]
                dly = (rs.standard_normal((67, len(SIZES), DIM)) * 0.1).astype(np.float32)
                ly_d, lo, hi = embedding_step(dist, b, dly, 0.3, comm)
                ly_s, _, _ = embedding_step(single, b, dly, 0.3, None)
                err = rel_err(ly_d, ly_s[lo:hi]) if hi > lo else 0.0
                out[f"{precision} {kind} pooling {pooling} ly_err"] = max(comm.allgather(err))
            sd_d, sd_s = dist.state_dict(), single.state_dict()
            out[f"{precision} {kind} table_err"] = max(rel_err(sd_d[k], sd_s[k]) for k in sd_s if k.startswith("emb"))
            out[f"{precision} {kind} kinds"] = sorted(set(dist.plan.kinds()))
    return out


def train(comm, cases=None):
    P, out = comm.Get_size(), {}
    cases = cases or [("fp32", k) for k in ("table", "column", "row", "table_row", "replicate", "mixed")] + \
        [("bf16", "mixed")]
    for precision, kind in cases:
        arch = dict(ARCH, interaction="cat" if kind == "mixed" else "dot", embedding_precision=precision)
        dist = DLRM(**arch, comm=comm, sharding=sharding_for(kind, comm))
        single = DLRM(**arch)
        bs = batches(np.random.RandomState(3), 3, 67)
        losses_d = [dist.train_step(b.dense, b.offsets, b.indices, b.labels, 0.2) for b in bs]
        losses_s = [single.train_step(b.dense, b.offsets, b.indices, b.labels, 0.2) for b in bs]
        probs_d = dist.forward(bs[0].dense, bs[0].offsets, bs[0].indices)
        probs_s = single.forward(bs[0].dense, bs[0].offsets, bs[0].indices)
        sd_d, sd_s = dist.state_dict(), single.state_dict()
        mine = b"".join(sd_d[k].tobytes() for k in sorted(sd_d)) + np.array(losses_d).tobytes()
        dist.load_state_dict(single.state_dict())
        probs_l = dist.forward(bs[1].dense, bs[1].offsets, bs[1].indices)
        work = dist.workload(67, pooling=4)
        assert work.tables and all(r >= 1 and d >= 1 for r, d, *_ in work.tables)
        out[f"{precision} {kind}"] = {
            "kinds": list(dist.plan.kinds()),
            "ranks": [list(t.ranks) for t in dist.plan.tables],
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses_d, losses_s)),
            "weight_err": max(float(np.abs(sd_d[k] - sd_s[k]).max()) for k in sd_s),
            "probs_err": float(np.abs(probs_d - probs_s).max()),
            "load_probs_err": float(np.abs(probs_l - single.forward(bs[1].dense, bs[1].offsets,
                                                                     bs[1].indices)).max()),
            "replicas_identical": len(set(comm.allgather(zlib.crc32(mine)))) == 1,
        }
    return out


def adagrad(comm):
    """Row-wise Adagrad on column pieces of one table vs the op on the whole table, 3 steps."""
    P, rank = comm.Get_size(), comm.Get_rank()
    R, D = 300, 16
    spec = TableSharding.column(range(P), D)
    group = comm.Create_group(comm.group, 0)
    shard = make_shard(0, spec, R, D, rank, optimizer=RowwiseAdagrad(), group=ColumnGroup(group, D))
    whole = make_shard(0, TableSharding.table(0), R, D, 0)
    shard.init(np.random.RandomState(1))
    whole.init(np.random.RandomState(1))
    state = np.zeros(R, np.float32)
    rs = np.random.RandomState(2)
    for _ in range(3):
        b = random_batch(rs, [R], 1, 40, 5, False)
        dout = rs.standard_normal((40, D)).astype(np.float32)
        r0, r1, c0, c1 = shard.region
        shard.optimizer.update(shard.weight, shard.state, b.indices[0], b.offsets[0],
                               np.ascontiguousarray(dout[:, c0:c1]), 0.05, shard.group)
        ops.embedding_bag_adagrad_(whole.weight, state, b.indices[0], b.offsets[0], dout, 0.05)
    r0, r1, c0, c1 = shard.region
    w_err = rel_err(shard.weight, whole.weight[:, c0:c1])
    s_err = rel_err(shard.state, state)
    # the model's seam: a DistributedDLRM whose tables train by row-wise Adagrad, column-sharded
    # (column groups made by the model) against table-wise (the op on whole tables)
    models = [RowwiseAdagradDLRM(**ARCH, comm=comm, sharding=kind) for kind in ("column", "table")]
    for b in batches(np.random.RandomState(4), 2, 67):
        for m in models:
            m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    sds = [m.state_dict() for m in models]
    model_err = max(float(np.abs(sds[0][k] - sds[1][k]).max()) for k in sds[1])
    return {"weight_err": max(comm.allgather(w_err)), "state_err": max(comm.allgather(s_err)),
            "state_exact": all(comm.allgather(bool(np.array_equal(shard.state, state)))), "model_err": model_err}


class RowwiseAdagradDLRM(DistributedDLRM):
    def _table_optimizer(self):
        return RowwiseAdagrad()


def save(comm, path):
    """Train the mixed plan two steps; save it sharded to `path`, the full model beside it."""
    model = DLRM(**ARCH, comm=comm, sharding=sharding_for("mixed", comm))
    for b in batches(np.random.RandomState(5), 2, 31)[:2]:
        model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    dist_checkpoint.save_checkpoint(path, model, {"step": 2}, model_arch(model))
    full = model.state_dict()
    if comm.Get_rank() == 0:
        np.savez(os.path.join(path, "..", "expected.npz"), **full)
    return {"saved_kinds": list(model.plan.kinds())}


def load(comm, path):
    """Load the checkpoint (every table row-wise, or one process), compare every array, train a step."""
    model = DLRM(**ARCH, comm=comm, **({} if comm is None else {"sharding": "row"}))
    meta = dist_checkpoint.load_checkpoint(path, model, model_arch(model))
    full = model.state_dict()
    expected = np.load(os.path.join(path, "..", "expected.npz"))
    err = max(float(np.abs(full[k] - expected[k]).max()) for k in expected.files)
    b = batches(np.random.RandomState(6), 1, 31)[0]
    loss = model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    return {"step": meta["step"], "load_err": err, "loss_after": loss,
            "kinds": list(model.plan.kinds()) if comm is not None else []}


def main(modes):
    comm = comm_from_env()
    out = {"ranks": 1 if comm is None else comm.Get_size()}
    for mode in modes:
        name, _, arg = mode.partition("=")
        if name == "contract":
            out.update(contract(comm))
        elif name == "contract-fp32":
            out.update(contract(comm, ("fp32",)))
        elif name == "train":
            out.update(train(comm))
        elif name == "train-mixed":
            out.update(train(comm, [("fp32", "mixed"), ("bf16", "mixed")]))
        elif name == "adagrad":
            out["adagrad"] = adagrad(comm)
        elif name == "save":
            out.update(save(comm, arg))
        elif name == "load":
            out.update(load(comm, arg))
    if comm is None or comm.Get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
