"""Run under mpiexec: every sharding kind (and a mixed plan) against one process; rank 0 prints JSON.

usage: [mpiexec -n P] python sharding.py MODE [MODE ...]

contract[-fp32][=TABLE_OPTIMIZER]: the embedding layer alone (pool, then a fixed pooled gradient,
          then the update by the table optimizer, SGD unless named), three steps: the pooled rows,
          the tables and their optimizer state against one process, per kind (and precision).
train:    whole training steps, a forward and a load, every kind in fp32 and the mixed plan in
          bf16: losses, every weight, probabilities, replicas bit-identical.
train-mixed[=adagrad]: the same for the mixed plan only, fp32 and bf16 (and fp32 by the Adagrads:
          optimizer "adagrad", element-wise tables; "rwsadagrad", row-wise).
save=DIR: train the mixed plan (row-wise Adagrad tables) two steps, save a sharded checkpoint to
          DIR, the full model to DIR/../expected.npz and, after one more step, to
          DIR/../after.npz; load=DIR: load it (auto plan; one process: a plain DLRM), compare,
          train that step, compare.
"""
import json
import os
import sys

import numpy as np
from compare import loads_state, rel_err, trained

from jitkern.config import get_config
from jitkern.dlrm import dist_checkpoint
from jitkern.dlrm.launch import comm_from_env, node_groups
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.planner import plan_sharding
from jitkern.dlrm.synth import random_batch
from jitkern.dlrm.checkpoint import model_arch

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


def contract(comm, precisions=("fp32", "bf16"), table_optimizer=None):
    out = {}
    opt = {} if table_optimizer is None else {"table_optimizer": table_optimizer}
    for precision in precisions:
        label = precision if table_optimizer is None else f"{precision}+{table_optimizer}"
        for kind in ("table", "column", "row", "table_row", "replicate"):
            dist = DLRM(**ARCH, embedding_precision=precision, comm=comm, sharding=kind, **opt)
            single = DLRM(**ARCH, embedding_precision=precision, **opt)
            rs = np.random.RandomState(3)
            for pooling in (1, 4, 4):
                b = batches(rs, 1, 67, pooling)[0]
                dly = (rs.standard_normal((67, len(SIZES), DIM)) * 0.1).astype(np.float32)
                ly_d, lo, hi = embedding_step(dist, b, dly, 0.3, comm)
                ly_s, _, _ = embedding_step(single, b, dly, 0.3, None)
                err = rel_err(ly_d, ly_s[lo:hi]) if hi > lo else 0.0
                out[f"{label} {kind} pooling {pooling} ly_err"] = max(comm.allgather(err))
            sd_d, sd_s = dist.state_dict(), single.state_dict()
            out[f"{label} {kind} table_err"] = max(rel_err(sd_d[k], sd_s[k]) for k in sd_s if k.startswith("emb"))
            st_d, st_s = dist.optimizer_state_dict(), single.optimizer_state_dict()
            assert set(st_d) == set(st_s) and bool(st_s) == (table_optimizer is not None), (sorted(st_d), sorted(st_s))
            out[f"{label} {kind} state_err"] = max((rel_err(st_d[k], st_s[k]) for k in st_s), default=0.0)
            out[f"{label} {kind} kinds"] = sorted(set(dist.plan.kinds()))
    return out


def train(comm, cases=None):
    out = {}
    cases = cases or [("fp32", k, "sgd") for k in ("table", "column", "row", "table_row", "replicate", "mixed")] + \
        [("bf16", "mixed", "sgd")]
    for precision, kind, optimizer in cases:
        arch = dict(ARCH, interaction="cat" if kind == "mixed" else "dot", embedding_precision=precision,
                    optimizer=optimizer)
        lr = 0.2 if optimizer == "sgd" else 0.02
        dist = DLRM(**arch, comm=comm, sharding=sharding_for(kind, comm))
        single = DLRM(**arch)
        bs = batches(np.random.RandomState(3), 3, 67)
        losses_d = [dist.train_step(b.dense, b.offsets, b.indices, b.labels, lr) for b in bs]
        losses_s = [single.train_step(b.dense, b.offsets, b.indices, b.labels, lr) for b in bs]
        probs_d = dist.forward(bs[0].dense, bs[0].offsets, bs[0].indices)
        probs_s = single.forward(bs[0].dense, bs[0].offsets, bs[0].indices)
        res = trained(dist, single, losses_d, lr, comm)
        res["load_state_exact"] = loads_state(dist, single)
        probs_l = dist.forward(bs[1].dense, bs[1].offsets, bs[1].indices)
        work = dist.workload(67, pooling=4)
        assert work.tables and all(r >= 1 and d >= 1 for r, d, *_ in work.tables)
        name = f"{precision} {kind}" if optimizer == "sgd" else f"{precision}+{optimizer} {kind}"
        out[name] = dict(
            res, kinds=list(dist.plan.kinds()), ranks=[list(t.ranks) for t in dist.plan.tables],
            loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses_d, losses_s)),
            probs_err=float(np.abs(probs_d - probs_s).max()),
            load_probs_err=float(np.abs(probs_l - single.forward(bs[1].dense, bs[1].offsets, bs[1].indices)).max()))
    return out


SAVED = dict(ARCH, optimizer="rwsadagrad")      # row-wise state: on column pieces, replicas, row ranges


def save(comm, path):
    """Train the mixed plan two steps; save it sharded to `path`, the full model (and optimizer
    state) beside it, and the full model after one more step (the one load trains)."""
    model = DLRM(**SAVED, comm=comm, sharding=sharding_for("mixed", comm))
    for b in batches(np.random.RandomState(5), 2, 31)[:2]:
        model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.02)
    dist_checkpoint.save_checkpoint(path, model, {"step": 2}, model_arch(model))
    full = {k: v.copy() for k, v in model.checkpoint_arrays().items()}     # live arrays among them
    b = batches(np.random.RandomState(6), 1, 31)[0]
    model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.02)
    after = model.checkpoint_arrays()
    if comm.Get_rank() == 0:
        np.savez(os.path.join(path, "..", "expected.npz"), **full)
        np.savez(os.path.join(path, "..", "after.npz"), **after)
    return {"saved_kinds": list(model.plan.kinds())}


def load(comm, path):
    """Load the checkpoint (every table row-wise, or one process), compare every array (optimizer
    state too), train a step, compare with the saver's step."""
    model = DLRM(**SAVED, comm=comm, **({} if comm is None else {"sharding": "row"}))
    meta = dist_checkpoint.load_checkpoint(path, model, model_arch(model))
    expected, after = (np.load(os.path.join(path, "..", f)) for f in ("expected.npz", "after.npz"))
    full = model.checkpoint_arrays()
    assert set(full) == set(expected.files) and any(k.startswith("state.emb.") for k in full)
    err = max(float(np.abs(full[k] - expected[k]).max()) for k in expected.files)
    b = batches(np.random.RandomState(6), 1, 31)[0]
    loss = model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.02)
    full = model.checkpoint_arrays()
    return {"step": meta["step"], "load_err": err, "loss_after": loss,
            "after_rel": max(rel_err(full[k], after[k]) for k in after.files),
            "kinds": list(model.plan.kinds()) if comm is not None else []}


def main(modes):
    comm = comm_from_env()
    out = {"ranks": 1 if comm is None else comm.Get_size()}
    adagrads = [("fp32", "mixed", "adagrad"), ("fp32", "mixed", "rwsadagrad")]     # train-mixed=adagrad
    for mode in modes:
        name, _, arg = mode.partition("=")
        if name == "contract":
            out.update(contract(comm, table_optimizer=arg or None))
        elif name == "contract-fp32":
            out.update(contract(comm, ("fp32",), arg or None))
        elif name == "train":
            out.update(train(comm))
        elif name == "train-mixed":
            out.update(train(comm, [("fp32", "mixed", "sgd"), ("bf16", "mixed", "sgd")] + (adagrads if arg else [])))
        elif name == "save":
            out.update(save(comm, arg))
        elif name == "load":
            out.update(load(comm, arg))
    if comm is None or comm.Get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
