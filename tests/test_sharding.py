"""Sharding without MPI: the planner, the cost model, the exchange layouts of every rank (their
counts must pair up), bucketing lookups by row shard, and `scale --plan-only`. The shardings
themselves run under mpiexec in test_dist.py."""
import io
import json
import os
from contextlib import redirect_stdout

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitkern.dlrm import ShardingPlan, plan_sharding
from jitkern.dlrm.configs import CONFIGS
from jitkern.dlrm.costmodel import KINDS, Network, Rates, dense_estimate, estimate
from jitkern.dlrm.layout import Layout
from jitkern.dlrm.placement import place_tables
from jitkern.dlrm.planner import TableSharding, plan_load, whole_table_plan
from jitkern.dlrm.sharding import Scratch, bucket


def _covers(plan):
    """Every table's pieces tile it exactly: rows for row kinds, columns for column."""
    for t, (s, rows) in enumerate(zip(plan.tables, plan.sizes)):
        regions = [s.region(j, rows, plan.dim) for j in range(len(s.ranks))]
        if s.kind == "replicate":
            assert s.ranks == tuple(range(plan.nranks))
            continue
        area = sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in regions)
        assert area == rows * plan.dim, (t, s)


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(1, 3_000_000), min_size=1, max_size=12), st.integers(1, 9),
       st.sampled_from([4, 16, 64]), st.sampled_from([1, 20]), st.sampled_from([64, 2048]))
def test_planner_gives_every_table_one_covering_sharding(sizes, ranks, dim, pooling, batch):
    plan = plan_sharding(sizes, dim, pooling, batch, ranks)
    assert len(plan.tables) == len(sizes) and plan.nranks == ranks
    _covers(plan)
    if ranks == 1:
        assert set(plan.kinds()) == {"table"}
    assert len(plan.memory) == ranks and plan.step > 0
    text = plan.describe()
    assert "est. ms" in text and text.count("\n") >= len(sizes) + 2


def test_planner_respects_the_memory_limit_and_splits_tables_that_do_not_fit_by_rows():
    sizes, dim, mlp = [10_000, 400_000, 3_000, 50], 16, 4096
    limit = 16e6                                   # the 400k table (25.6 MB) fits on no rank whole
    plan = plan_sharding(sizes, dim, 1, 512, 4, limit, mlp_bytes=mlp)
    assert plan.tables[1].kind in ("row", "table_row")
    r0, r1, _, _ = plan.tables[1].region(0, sizes[1], dim)
    assert max(plan.memory) <= limit - 2 * mlp
    with pytest.raises(ValueError, match="do not fit"):
        plan_sharding(sizes, dim, 1, 512, 2, 8e6)
    with pytest.raises(ValueError, match="does not fit|do not fit"):
        plan_sharding(sizes, dim, 1, 512, 4, limit, kinds="table")


def test_forced_kinds_and_bad_arguments():
    sizes = [1000, 2000, 3000]
    for kind in KINDS:
        plan = plan_sharding(sizes, 16, 2, 256, 4, kinds=kind, nodes=((0, 1), (2, 3)))
        assert set(plan.kinds()) == {kind}
        _covers(plan)
        if kind == "table_row":
            assert all(s.ranks in ((0, 1), (2, 3)) for s in plan.tables)
        if kind == "row":
            assert all(len(s.ranks) == 4 for s in plan.tables)
    mixed = plan_sharding(sizes, 16, 2, 256, 4, kinds=["replicate", "auto", "column"])
    assert mixed.kinds()[0] == "replicate" and mixed.kinds()[2] == "column"
    for bad in (dict(kinds="diagonal"), dict(kinds=["row"]), dict(pooling=[1, 2]), dict(ranks=0),
                dict(dim=0), dict(sizes=[0, 5, 5]), dict(optimizer="adam")):
        args = dict(sizes=sizes, dim=16, pooling=1, batch=64, ranks=2) | bad
        with pytest.raises(ValueError):
            plan_sharding(**args)


def test_plans_given_by_hand_are_checked():
    ok = ShardingPlan((10, 20), 8, 2, (TableSharding.table(1), TableSharding.row((0, 1), 20)))
    assert ok.held(1) == [(0, 0), (1, 1)]
    bad = [(TableSharding.table(2), TableSharding.replicate(2)),                   # no rank 2
           (TableSharding("row", (0, 1), (0, 10)), TableSharding.replicate(2)),    # bounds: 2 pieces need 3
           (TableSharding("column", (0, 1), (0, 8, 8)), TableSharding.replicate(2)),  # an empty piece
           (TableSharding("diagonal", (0,)), TableSharding.replicate(2)),
           (TableSharding.replicate(1), TableSharding.replicate(2))]
    for tables in bad:
        with pytest.raises(ValueError):
            ShardingPlan((10, 20), 8, 2, tables)
    with pytest.raises(ValueError, match="one sharding per table"):
        ShardingPlan((10, 20), 8, 2, (TableSharding.table(0),))


def test_column_blocks_keep_widths_of_four_where_they_can():
    assert TableSharding.column((0, 1, 2, 3), 64).bounds == (0, 16, 32, 48, 64)
    assert TableSharding.column((0, 1, 2), 16).bounds == (0, 6, 11, 16)       # 16 is not 3 x 4k
    assert TableSharding.row((0, 1, 2), 10).bounds == (0, 4, 7, 10)


@pytest.mark.parametrize("ranks, nodes", [(3, None), (4, ((0, 1), (2, 3)))])
@pytest.mark.parametrize("batch", [2, 67])
def test_exchange_layouts_of_all_ranks_pair_up(ranks, nodes, batch):
    # what rank r sends rank q (counts and piece shapes) is what q expects from r, for the pooled
    # pieces, the row shards' lookup lengths and the in-node sums
    sizes = [3, 50, 2000, 700, 5000, 64, 1200, 3000]
    kinds = ["replicate", "table", "row", "column", "table_row" if nodes else "row", "replicate", "column", "row"]
    plan = plan_sharding(sizes, 16, 4, batch, ranks, kinds=kinds, nodes=nodes)
    lays = [Layout(plan, r, batch) for r in range(ranks)]
    for r in range(ranks):
        for q in range(ranks):
            assert lays[r].send_counts[q] == lays[q].recv_counts[r]
            assert lays[r].ids_send_counts[q] == lays[q].ids_recv_counts[r]
            assert lays[r].node_send_counts[q] == lays[q].node_recv_counts[r]
            for t in range(len(sizes)):
                if (q, t) in lays[r].fwd_out:
                    assert lays[r].fwd_out[q, t].shape == lays[q].fwd_in[r, t].shape
    assert sum(lay.b for lay in lays) == batch


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 5000), st.integers(1, 9), st.lists(st.integers(0, 6), max_size=40), st.integers(0, 2**31))
def test_bucket_groups_lookups_by_row_shard_in_position_order(rows, k, sizes, seed):
    k = min(k, rows)
    rs = np.random.default_rng(seed)
    sizes = np.array(sizes, np.int64)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else np.zeros(0, np.int64)
    idx = rs.integers(0, rows, int(sizes.sum()), dtype=np.int64)
    bounds = TableSharding.row(range(k), rows).bounds
    lengths, local, ends = bucket(off, idx, bounds, Scratch())
    bag = np.repeat(np.arange(len(sizes)), sizes)
    for j in range(k):
        mine = (idx >= bounds[j]) & (idx < bounds[j + 1])
        np.testing.assert_array_equal(local[ends[j]:ends[j + 1]], idx[mine] - bounds[j])
        np.testing.assert_array_equal(lengths[j], np.bincount(bag[mine], minlength=len(sizes)))


def test_cost_model_prefers_splitting_hot_tables_over_whole_tables():
    # paper-small (8 tables of 1M rows, 100 lookups) on 64 ranks: whole tables leave 56 ranks
    # without lookups; the planned plan (row-wise) is much faster in the model (its default
    # rates; `scale` measures the real ones)
    cfg, P = CONFIGS["paper-small"], 64
    for batch, gain in ((2048, 1.4), (2048 * P, 1.5)):
        dense = dense_estimate(cfg.bottom, [cfg.dim + 36] + list(cfg.top), batch // P)
        plan = plan_sharding(cfg.sizes, cfg.dim, cfg.lookups, batch, P, dense=dense)
        whole = whole_table_plan(place_tables(cfg.sizes, cfg.dim, P))
        rates, net = Rates(), Network()
        steps = [estimate(plan_load(p, cfg.lookups, batch, rates), p.kinds(), dense, 0, net).step
                 for p in (plan, whole)]
        assert "row" in plan.kinds() and steps[1] > gain * steps[0], steps


def test_planner_finds_row_groups_that_one_table_at_a_time_cannot_reach():
    # paper-small at 64 ranks, 2048 samples per rank: each table row-wise over its own group of
    # ranks moves a fraction of the partial pools that all-rank row shards do, but no single
    # table can leave a plan balanced over all 64 ranks without overloading its group first
    cfg, P = CONFIGS["paper-small"], 64
    batch = 2048 * P
    dense = dense_estimate(cfg.bottom, [cfg.dim + 36] + list(cfg.top), batch // P)
    rates, net = Rates(), Network()

    def step(plan):
        return estimate(plan_load(plan, cfg.lookups, batch, rates), plan.kinds(), dense, 0, net).step

    plan = plan_sharding(cfg.sizes, cfg.dim, cfg.lookups, batch, P, dense=dense)
    groups = {k: ShardingPlan(cfg.sizes, cfg.dim, P, tuple(TableSharding.row(range(t * k % P, t * k % P + k), n)
                                                         for t, n in enumerate(cfg.sizes)))
              for k in (4, 8, 16, 32)}
    every = plan_sharding(cfg.sizes, cfg.dim, cfg.lookups, batch, P, dense=dense, kinds="row")
    best = min(step(g) for g in groups.values())
    assert best < 0.95 * step(every), (best, step(every))     # the groups are worth finding
    assert step(plan) <= best * 1.001, (step(plan), {k: step(g) for k, g in groups.items()})


def test_cost_model_without_offload_exposes_every_transfer():
    # ranks sharing one machine's memory copy every byte themselves inside MPI calls: nothing of
    # the link time hides behind compute, so the step is the compute plus all of it
    cfg, P, batch = CONFIGS["kaggle"], 4, 4096
    dense = dense_estimate(cfg.bottom, [cfg.dim + 351] + list(cfg.top), batch // P)
    rates = Rates()
    for kind in ("row", "column", "table"):
        plan = plan_sharding(cfg.sizes, cfg.dim, cfg.lookups, batch, P, dense=dense, kinds=kind)
        load = plan_load(plan, cfg.lookups, batch, rates)
        nic, shm = (estimate(load, plan.kinds(), dense, 4 << 20, Network(1.0, 5.0, offload=o)) for o in (True, False))
        assert (shm.compute, shm.alltoall, shm.ids, shm.allreduce) == (nic.compute, nic.alltoall, nic.ids, nic.allreduce)
        assert shm.exposed == pytest.approx(shm.ids + 2 * (shm.alltoall + shm.node) + shm.allreduce)
        assert shm.allreduce > 0 and shm.step > nic.step, (kind, shm, nic)


def test_scale_plan_only_plans_the_full_mlperf_model_without_allocating_it():
    from jitkern.dlrm import scale
    out = io.StringIO()
    with redirect_stdout(out):
        assert scale.main(["--config", "mlperf-full", "--ranks", "8", "--rank-memory-gb", "24", "--plan-only"]) == 0
    text = out.getvalue()
    mem = [float(m) for m in __import__("re").findall(r"\d: ([0-9.]+) GB", text)]
    assert len(mem) >= 4 and max(mem) <= 24.0, text
    assert "96.1 GB of fp32" in text and "nothing was allocated" in text
    with redirect_stdout(io.StringIO()), pytest.raises(ValueError, match="do not fit"):
        scale.main(["--config", "mlperf-full", "--ranks", "4", "--rank-memory-gb", "16", "--plan-only"])


def test_sharded_checkpoint_of_one_process_and_version_1_manifests(tmp_path):
    from jitkern.dlrm import dist_checkpoint
    from jitkern.dlrm.model import DLRM
    from jitkern.dlrm.checkpoint import model_arch

    m = DLRM([30, 70], 8, [3, 8], [4, 1], seed=1)
    dist_checkpoint.save_checkpoint(str(tmp_path / "v2"), m, {"step": 1}, model_arch(m))
    other = DLRM([30, 70], 8, [3, 8], [4, 1], seed=2)
    assert dist_checkpoint.load_checkpoint(str(tmp_path / "v2"), other, model_arch(m)) == {"step": 1}
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(other.state_dict()[k], v)
    # version 1: every array whole in one file
    man = json.loads((tmp_path / "v2" / "manifest.json").read_text())
    for name, e in man["arrays"].items():
        if "pieces" in e:
            piece = e.pop("pieces")[0]
            e.update(file=piece["file"], crc32=piece["crc32"])
    man["version"] = 1
    (tmp_path / "v2" / "manifest.json").write_text(json.dumps(man))
    third = DLRM([30, 70], 8, [3, 8], [4, 1], seed=3)
    dist_checkpoint.load_checkpoint(str(tmp_path / "v2"), third, model_arch(m))
    np.testing.assert_array_equal(third.state_dict()["emb.1.weight"], m.state_dict()["emb.1.weight"])
    # a corrupt piece is found before anything is loaded
    piece = next(p for p in (tmp_path / "v2").rglob("emb.1.weight*.npy"))
    data = bytearray(piece.read_bytes())
    data[-1] ^= 0xFF
    piece.write_bytes(bytes(data))
    fourth = DLRM([30, 70], 8, [3, 8], [4, 1], seed=4)
    before = {k: v.copy() for k, v in fourth.state_dict().items()}
    with pytest.raises(dist_checkpoint.ShardedCheckpointError, match="corrupt"):
        dist_checkpoint.load_checkpoint(str(tmp_path / "v2"), fourth, model_arch(m))
    for k, v in fourth.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    assert os.path.isdir(tmp_path / "v2")


@pytest.mark.parametrize("optimizer", ["adagrad", "rwsadagrad"])
def test_sharded_checkpoint_of_one_process_keeps_the_optimizer_state_and_resumes_exactly(tmp_path, optimizer):
    from jitkern.dlrm import dist_checkpoint
    from jitkern.dlrm.model import DLRM
    from jitkern.dlrm.synth import random_batch
    from jitkern.dlrm.checkpoint import model_arch

    arch = dict(embedding_sizes=[30, 70], embedding_dim=8, bottom_mlp=[3, 8], top_mlp=[4, 1], interaction="dcn",
                dcn_layers=1, dcn_rank=4, optimizer=optimizer)
    rs = np.random.RandomState(0)
    bs = [random_batch(rs, [30, 70], 3, 16, 2, False) for _ in range(4)]
    m = DLRM(**arch, seed=1)
    for b in bs[:2]:
        m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.05)
    dist_checkpoint.save_checkpoint(str(tmp_path / "ck"), m, {"step": 2}, model_arch(m))
    man = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert set(man["arrays"]) == set(m.checkpoint_arrays())       # one process's names, state included
    assert man["arrays"]["state.emb.1.weight"]["shape"] == list(m.optimizer_state_dict()["state.emb.1.weight"].shape)
    other = DLRM(**arch, seed=2)
    dist_checkpoint.load_checkpoint(str(tmp_path / "ck"), other, model_arch(m))
    for k, v in m.checkpoint_arrays().items():
        np.testing.assert_array_equal(other.checkpoint_arrays()[k], v, err_msg=k)
    for b in bs[2:]:
        for model in (m, other):
            model.train_step(b.dense, b.offsets, b.indices, b.labels, 0.05)
    for k, v in m.checkpoint_arrays().items():
        np.testing.assert_array_equal(other.checkpoint_arrays()[k], v, err_msg=k)


def test_ranks_wait_for_the_slowest_by_the_expected_maximum_of_their_spread():
    from jitkern.dlrm.costmodel import expected_max_normal, sync_wait
    from jitkern.dlrm.calibration import DenseStages
    from jitkern.dlrm.scale import make_plan, predict_plan
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / np.sqrt(np.pi), abs=1e-4)     # E|X - Y| / 2
    draws = np.random.default_rng(0).standard_normal((100_000, 64))
    for n in (3, 8, 64):
        assert expected_max_normal(n) == pytest.approx(draws[:, :n].max(axis=1).mean(), abs=0.01)
    assert sync_wait(2e-3, 4) == pytest.approx(2e-3 * expected_max_normal(4))
    # a prediction on P ranks carries that wait; a spread of 0 (dense stages not measured) none
    cfg, P, batch = CONFIGS["kaggle"], 4, 4096
    calm = DenseStages(dense_estimate(cfg.bottom, [cfg.dim + 351] + list(cfg.top), batch // P))
    shaky = DenseStages(calm)
    shaky.sd = 3e-3
    plan = make_plan(cfg, P, batch, kinds="column", dense=calm, rates=Rates(), network=Network())
    a, b = (predict_plan("p", plan, cfg, batch, d, Rates(), Network()) for d in (calm, shaky))
    assert b.step - a.step == pytest.approx(sync_wait(3e-3, P))
    assert b.exposed - a.exposed == pytest.approx(b.step - a.step)
    assert b.compute == a.compute
    # measured steps: the dense update is sharded, so on P ranks its own variation counts at 1/P
    from jitkern.dlrm.calibration import step_spread
    varied = DenseStages(calm)
    varied.steps = np.array([5.0, 5.1, 4.9, 5.0, 5.05]) * 1e-3
    varied.updates = np.array([1.0, 3.0, 0.0, 2.0, 4.0]) * 1e-3
    assert varied.spread(P) == step_spread(varied.steps + varied.updates / P) < varied.spread(1) / 3
    c = predict_plan("p", plan, cfg, batch, varied, Rates(), Network())
    assert c.step - a.step == pytest.approx(sync_wait(varied.spread(P), P))


def test_measured_dense_stages_are_medians_with_their_spread():
    from jitkern.bench.dist import _combine_dense, _dense_rows
    from jitkern.dlrm.calibration import DenseStages, measure_dense, step_spread, table_traffic
    # the caches see a rank's share of the lookups' rows before each timed step: 100 lookups of
    # 8 tables of 64 floats per sample, read by the forward and again by the update
    assert table_traffic(CONFIGS["paper-small"], 32) == 32 * 100 * 8 * 64 * 4 * 2
    got = measure_dense(CONFIGS["tiny"], [8, 16], reps=3)
    assert sorted(got) == [8, 16]
    for stages in got.values():
        assert isinstance(stages, DenseStages) and stages.sd >= 0 and "top_fwd" in stages
        assert stages.sd == stages.spread(1) and len(stages.steps) == len(stages.updates) >= 3
        assert stages.spread(64) == step_spread(stages.steps + stages.updates / 64)
        assert not any(k.startswith("embedding") for k in stages)
    # the spread is the bulk's: one step slowed by another process does not set it
    steps = [10.0, 10.2, 9.8, 10.1, 9.9, 10.0, 17.0]
    assert step_spread(steps) == pytest.approx(1.4826 * 0.1) and np.std(steps) > 2.0
    assert step_spread([5.0]) == 0.0
    # bench dist's rounds (JSON: rows as strings) -> each stage's and the spread's median
    rounds = [{"8": {"top_fwd": t, "loss": 1.0, "sd": s}} for t, s in ((3.0, 0.1), (1.0, 0.3), (2.0, 0.2))]
    both = _combine_dense(rounds)
    assert list(both) == [8] and dict(both[8]) == {"top_fwd": 2.0, "loss": 1.0} and both[8].sd == 0.2
    # and over the copies of one round: 2 ranks' copies of 2 rounds
    copies = _combine_dense([{"8": {"top_fwd": t, "sd": 0.0}} for t in (1.0, 2.0, 4.0, 3.0)])
    assert copies[8]["top_fwd"] == 2.5
    # the slices the model needs on P ranks: weak (the per-rank batch) and strong (the global
    # batch's largest slice)
    assert _dense_rows([1, 2, 3], 2048) == {1: [2048], 2: [1024, 2048], 3: [683, 2048]}


def test_ranks_sharing_a_machine_are_predicted_from_stages_timed_side_by_side():
    from jitkern.dlrm.calibration import DenseStages
    from jitkern.dlrm.scale import measure_and_predict
    cfg = CONFIGS["kaggle"]
    stages = {b: DenseStages(dense_estimate(cfg.bottom, [cfg.dim + 351] + list(cfg.top), b)) for b in (1024, 2048)}
    for dense in stages.values():
        dense.sd = 0.0
    slower = DenseStages({k: 1.5 * v for k, v in stages[1024].items()})
    slower.sd = 0.0
    kw = dict(bandwidth_gbs=10.0, latency_us=1.0, per_rank_batch=2048, kinds="column", rates=Rates(),
              log=lambda *a: None)
    alone = measure_and_predict(cfg, [1, 2], "strong", dense_at=stages, **kw)
    paired = measure_and_predict(cfg, [1, 2], "strong", dense_at={**stages, (2, 1024): slower}, **kw)
    assert paired[0].step == alone[0].step  # one process: the stages timed alone
    assert paired[1].compute - alone[1].compute == pytest.approx(0.5 * sum(stages[1024].values()))
