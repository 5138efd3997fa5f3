"""DLRM(precision="bf16"): bf16 MLPs and dot interaction on Split-pair weights.

Each layer of a bf16 training step is checked against a float64 reference on the bf16 values the
model holds (its Split pairs' high halves, its bf16 activations): the kernels differ from it only by
fp32 accumulation (bounded from K, as in test_gemm_bf16.py) and, for a bf16 result, one bf16
rounding on each side. The update is exact fp32 SGD on the rejoined weights; fp32 models are as
before; checkpoints of a bf16 model resume bit for bit; bf16 and fp32 training reach the same AUC.
"""
import numpy as np
import pytest

from jitkern import ops
from jitkern.dlrm import flags
from jitkern.dlrm.cli import main
from jitkern.dlrm.metrics import roc_auc
from jitkern.dlrm.model import DLRM
from jitkern.dlrm.model_state import SplitWeight
from jitkern.dlrm.synth import SyntheticData
from jitkern.dlrm.checkpoint import load_checkpoint
from jitkern.dlrm.train import TrainOptions, Trainer, state_from_meta
from jitkern.ops import BF16Array
from jitkern.ops import reference as ref

EPS = np.finfo(np.float32).eps
U_BF16 = 2.0 ** -8
SIZES = [30, 40, 50, 60]
ARCH = dict(embedding_sizes=SIZES, embedding_dim=16, bottom_mlp=[13, 48, 16], top_mlp=[40, 24, 1])


def values(x):
    return (x.to_float32() if isinstance(x, BF16Array) else np.asarray(x)).astype(np.float64)


def assert_close(got, want, scale, k, what):
    """got within the fp32 accumulation error of k terms bounded by `scale`, plus one bf16
    rounding of each side where got is bf16."""
    acc = 2 * (k + 4) * EPS * scale + 1e-30
    g, w = values(got), values(want)
    bound = acc + 2 * U_BF16 * (np.abs(w) + acc) if isinstance(got, BF16Array) else acc
    err = np.abs(g - w)
    assert err.shape == bound.shape and np.all(err <= bound), \
        f"{what}: max err {err.max()} > bound {bound.ravel()[np.argmax(err)]}"


def batch(b=64, seed=0, k=2):
    return SyntheticData(SIZES, 13, b, 1, num_indices_per_lookup=k, fixed=False, seed=seed).batch(0, 0)


def record(model, name, calls):
    """Record every call of the model's method `name`: (args, kwargs, result)."""
    orig = getattr(model, name)

    def wrapped(*a, **kw):
        r = orig(*a, **kw)
        calls.append((a, kw, r))
        return r
    setattr(model, name, wrapped)


# --------------------------------------------------------------------------- layers against float64


@pytest.mark.parametrize("interaction", ["dot", "cat"])
def test_bf16_step_layers_match_float64_reference(interaction):
    m = DLRM(**ARCH, seed=3, precision="bf16", interaction=interaction)
    assert m.embedding_precision == "bf16"
    assert all(isinstance(w, SplitWeight) for w in m.bot_w + m.top_w)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    hi0 = {id(w): w.hi.to_float32().astype(np.float64) for w in m.bot_w + m.top_w}   # what the step reads
    hi0.update({id(v): v.astype(np.float64) for v in m.bot_b + m.top_b})
    fwd, bwd = [], []
    record(m, "_layer_forward", fwd)
    record(m, "_layer_backward", bwd)
    b = batch()
    lr = 0.05
    m.train_step(b.dense, b.offsets, b.indices, b.labels, lr)
    buf = m._buffers[64]

    np.testing.assert_array_equal(buf.dense16.to_float32(), ref.bf16_round(b.dense))   # RNE once
    tables = [ref.bf16_to_float32(ref.bf16_split(before[f"emb.{t}.weight"])[0]) for t in range(len(SIZES))]
    for t, w in enumerate(tables):           # pooled bf16 rows (exact sums in fp32 here), rounded once
        want = ref.embedding_bag_forward(w, b.indices[t], b.offsets[t])
        scale = ref.embedding_bag_forward(np.abs(w), b.indices[t], b.offsets[t])
        assert_close(buf.pooled[t], want, scale, 2, f"pooled {t}")
        np.testing.assert_array_equal(buf.ly16[t].to_float32(), ref.bf16_round(buf.pooled[t]))

    assert len(fwd) == 5 and len(bwd) == 5
    for (h, w, bias, out, act), _, y in fwd:
        assert act == "relu" or y.shape[1] == 1
        assert isinstance(h, BF16Array) and isinstance(w, SplitWeight)
        assert isinstance(y, BF16Array) == (y.shape[1] != 1)      # bf16 activations, fp32 logits
        x64, w64, bias = values(h), hi0[id(w)], hi0[id(bias)]
        want = x64 @ w64.T + bias
        if act == "relu":
            want = np.maximum(want, 0.0)
        assert_close(y, want, np.abs(x64) @ np.abs(w64).T + np.abs(bias), h.shape[1], "linear forward")

    x, ly = buf.bot[-1], buf.ly16
    z = fwd[2][0][0]                          # the top MLP's input: the interaction's bf16 output
    if interaction == "cat":                  # the bf16 values themselves, side by side
        np.testing.assert_array_equal(z.bits, np.concatenate([x.bits] + [a.bits for a in ly], axis=1))
        np.testing.assert_array_equal(z.bits, ref.interaction_cat_forward(x, ly).bits)
    else:
        want = ref.interaction_dot_forward(x, ly)
        t = np.stack([values(x)] + [values(a) for a in ly], axis=1)
        mag = np.abs(t) @ np.abs(t).transpose(0, 2, 1)
        li, lj = ref.interaction_pairs(len(SIZES) + 1)
        assert_close(z, want, np.concatenate([np.abs(values(x)), mag[:, li, lj]], axis=1), 16, "interaction")

    for (dy, xin, w, y, act, _), kw, (dx, dw, db) in bwd:
        g = values(dy) * (values(y) > 0 if act == "relu" else 1.0)
        gb = ref.bf16_round(g.astype(np.float32)).astype(np.float64)
        x64, w64 = values(xin), hi0[id(w)]
        n, k = x64.shape
        assert_close(dw, gb.T @ x64, np.abs(gb).T @ np.abs(x64), n, "dw")
        assert_close(db, g.sum(axis=0), np.abs(g).sum(axis=0), n, "db")
        if kw.get("need_dx", True):
            assert isinstance(dx, BF16Array)
            keep = x64 > 0 if kw.get("input_relu") else 1.0  # the ReLU below, in dx's epilogue
            assert_close(dx, (gb @ w64) * keep, (np.abs(gb) @ np.abs(w64)) * keep, w64.shape[0], "dx")
        else:
            assert dx is None and xin is buf.dense16

    # the update: exact fp32 SGD on the rejoined weights (Split-SGD), fp32 biases by sgd_
    after = m.state_dict()
    for (_, xin, w, _, _, _), _, (_, dw, db) in bwd:
        name = next(k for k, p in m.mlp_parameters().items() if p is w)
        want = ops.sgd_(before[name].copy(), dw, lr)
        np.testing.assert_array_equal(after[name].view(np.uint32), want.view(np.uint32))
        np.testing.assert_array_equal(w.hi.bits, ref.bf16_split(want)[0])
        bias = name.replace("weight", "bias")
        np.testing.assert_array_equal(after[bias], ops.sgd_(before[bias].copy(), db, lr))


def test_bf16_forward_is_close_to_fp32():
    """The whole forward: bf16 probabilities near fp32's from the same weights (a sanity check on
    the wiring; the exact bounds are per layer above)."""
    b = batch(256, seed=1)
    p32 = DLRM(**ARCH, seed=5).forward(b.dense, b.offsets, b.indices)
    p16 = DLRM(**ARCH, seed=5, precision="bf16").forward(b.dense, b.offsets, b.indices)
    assert p16.dtype == np.float32 and p16.shape == (256,)
    assert np.abs(p16 - p32).max() < 0.02


def test_bf16_dcn_cross_network_runs_on_split_pairs():
    """dcn in bf16: the cross layers read their Split pairs' bf16 halves and the bf16 interaction
    output, hand the top MLP a bf16 x_L, and their update is exact fp32 on the rejoined weights."""
    m = DLRM(**ARCH, seed=2, precision="bf16", interaction="dcn", dcn_layers=2, dcn_rank=4)
    assert all(isinstance(p, SplitWeight) for p in m.cross_v + m.cross_w)
    fwd, grads = [], []
    record(m, "_layer_forward", fwd)
    orig = m._cross_update
    m._cross_update = lambda ctx: (grads.append(ctx.cross_grads), orig(ctx))
    before = {k: v.copy() for k, v in m.state_dict().items()}
    b = batch()
    lr = 0.05
    m.train_step(b.dense, b.offsets, b.indices, b.labels, lr)
    buf = m._buffers[64]
    z = fwd[2][0][0]                                       # the top MLP's input: the last cross layer's
    assert isinstance(z, BF16Array) and z is buf.cross_x[-1]
    x0 = ops.interaction_cat_forward(buf.bot[-1], buf.ly16)
    xl = x0
    for l in range(2):                                     # each layer as ops.cross_layer_forward on the pairs
        v, w = (ops.BF16Array(ref.bf16_split(before[f"cross.{l}.{k}"])[0]) for k in "vw")
        want, _ = ops.cross_layer_forward(x0, xl, v, w, before[f"cross.{l}.b"])
        np.testing.assert_array_equal(buf.cross_x[l].bits, want.bits)
        xl = want
    after = m.state_dict()
    for l, (dv, dw, db) in enumerate(grads[0]):
        for k, g in zip("vwb", (dv, dw, db)):
            name = f"cross.{l}.{k}"
            want = ops.sgd_(before[name].copy(), g, lr)
            np.testing.assert_array_equal(after[name].view(np.uint32), want.view(np.uint32), err_msg=name)


# --------------------------------------------------------------------------- fp32 and mixed precisions


def test_fp32_precision_is_the_default_model_bit_for_bit():
    b = batch(32, seed=2)
    models = [DLRM(**ARCH, seed=1), DLRM(**ARCH, seed=1, precision="fp32"),
              DLRM(**ARCH, seed=1, precision="fp32", embedding_precision="fp32")]
    for m in models:
        assert all(isinstance(w, np.ndarray) for w in m.bot_w + m.top_w)
        for _ in range(3):
            m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    for m in models[1:]:
        for (k, x), (_, y) in zip(models[0].state_dict().items(), m.state_dict().items()):
            np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=k)
    assert repr(models[0]) == repr(models[1]) and "precision='fp32'" in repr(models[0])


@pytest.mark.parametrize("precision, tables", [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_mlp_and_table_precisions_are_independent(precision, tables):
    m = DLRM(**ARCH, seed=1, precision=precision, embedding_precision=tables)
    assert isinstance(m.emb[0], np.ndarray) == (tables == "fp32")
    assert isinstance(m.bot_w[0], SplitWeight) == (precision == "bf16")
    b = batch(64, seed=3)
    losses = [m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.2) for _ in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert all(v.dtype == np.float32 for v in m.state_dict().values())
    if precision != tables:
        assert f"embedding_precision='{tables}'" in repr(m)


def test_bf16_option_errors():
    with pytest.raises(ValueError, match="precision must be one of"):
        DLRM(**ARCH, precision="fp16")
    with pytest.raises(ValueError, match="runs relu hidden layers"):
        DLRM(**ARCH, precision="bf16", activation="sigmoid")
    with pytest.raises(ValueError, match="Split-SGD tables take SGD only"):
        DLRM(**ARCH, precision="bf16", optimizer="adagrad")      # tables follow precision


# --------------------------------------------------------------------------- state, checkpoints


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_state_dict_is_fp32_and_loads_back(interaction):
    m = DLRM(**ARCH, seed=1, precision="bf16", interaction=interaction)
    f = DLRM(**ARCH, seed=1, interaction=interaction)
    sd, fsd = m.state_dict(), f.state_dict()
    assert list(sd) == list(fsd)
    for k in sd:                                   # same init: the split pairs hold it exactly
        assert sd[k].dtype == np.float32
        np.testing.assert_array_equal(sd[k].view(np.uint32), fsd[k].view(np.uint32), err_msg=k)
    b = batch(64, seed=4)
    f.train_step(b.dense, b.offsets, b.indices, b.labels, 0.3)
    m.load_state_dict(f.state_dict())
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v.view(np.uint32), f.state_dict()[k].view(np.uint32), err_msg=k)
    assert m.parameter_bytes() == f.parameter_bytes()     # two uint16 halves per fp32 value
    with pytest.raises(TypeError, match="float32"):
        m.load_state_dict({k: v.astype(np.float64) for k, v in f.state_dict().items()})


def _trainer(model, num_batches, ck=None, state=None):
    train = SyntheticData(SIZES, 13, 64, num_batches, num_indices_per_lookup=2, fixed=False, seed=4)
    test = SyntheticData(SIZES, 13, 256, 2, num_indices_per_lookup=2, fixed=False, seed=4, split="test")
    o = TrainOptions(lr=0.3, test_freq=-1, print_freq=0, progress=False, save_model=str(ck) if ck else "",
                     warmup_steps=3, decay_start_step=6, decay_steps=5)
    return Trainer(model, train, test, o, log=lambda msg: None, state=state)


@pytest.mark.parametrize("tables, extra", [("bf16", {}), ("fp32", {}),
                                           ("fp32", dict(interaction="dcn", optimizer="adagrad"))])
def test_bf16_resume_is_bit_exact(tmp_path, tables, extra):
    def model(seed):
        return DLRM(**ARCH, seed=seed, precision="bf16", embedding_precision=tables, **extra)
    straight = model(1)
    _trainer(straight, 12).run()
    ck = tmp_path / "ck.bin"
    _trainer(model(1), 7, ck).run()
    resumed = model(99)
    state = state_from_meta(load_checkpoint(str(ck), resumed))
    assert state.step == 7
    _trainer(resumed, 12, state=state).run()
    for (k, x), (_, y) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32), err_msg=k)
    for a, c in zip(straight.bot_w + straight.top_w + straight.cross_v, resumed.bot_w + resumed.top_w + resumed.cross_v):
        np.testing.assert_array_equal(a.hi.bits, c.hi.bits)


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_bf16_training_reaches_fp32_auc(interaction):
    """Learnable synthetic data, same seed: 400 steps of batch 256; fp32 reaches AUC >= 0.75 and
    bf16 ends within 0.003 of it, the losses tracking each other (dcn: 3 cross layers of rank 8,
    whose running x_l is bf16 too)."""
    extra = dict(interaction="dcn", dcn_layers=3, dcn_rank=8) if interaction == "dcn" else {}
    sizes, d = [100, 200, 300, 50, 80, 120, 400, 60], 16
    train = SyntheticData(sizes, 13, 256, 400, seed=5)
    test = SyntheticData(sizes, 13, 4096, 1, seed=5, split="test").batch(0, 0)
    losses, aucs = {}, {}
    for precision in ("fp32", "bf16"):
        m = DLRM(sizes, d, [13, 64, d], [64, 32, 1], seed=3, precision=precision, **extra)
        losses[precision] = np.array([m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
                                      for b in train.batches()])
        aucs[precision] = roc_auc(test.labels, m.forward(test.dense, test.offsets, test.indices))
    gap = np.abs(losses["fp32"] - losses["bf16"])
    print(f"test AUC fp32 {aucs['fp32']:.4f} bf16 {aucs['bf16']:.4f}; loss gap max {gap.max():.4f} "
          f"mean {gap.mean():.5f}")
    assert aucs["fp32"] >= 0.75
    assert abs(aucs["fp32"] - aucs["bf16"]) <= 0.003
    assert gap.max() < 0.01


# --------------------------------------------------------------------------- the trainer's flag

TINY_CLI = ["--arch-embedding-size", "10-20-40-80", "--arch-sparse-feature-size", "16", "--arch-mlp-bot",
            "13-32-16", "--arch-mlp-top", "16-1", "--mini-batch-size", "64", "--threads", "1", "--progress", "off",
            "--num-batches", "4"]


def test_precision_flag_sets_mlps_and_tables_by_default(capsys):
    p = flags.build_parser()
    args = p.parse_args([])
    assert (args.precision, args.embedding_precision) == ("fp32", None)
    for argv, want in ((["--precision", "bf16"], "precision='bf16'"),
                       (["--precision", "bf16", "--embedding-precision", "fp32"],
                        "precision='bf16', embedding_precision='fp32'"),
                       (["--embedding-precision", "bf16"], "precision='fp32', embedding_precision='bf16'")):
        assert main(TINY_CLI + argv) == 0
        out = capsys.readouterr().out
        assert want + ")" in out or want + "," in out, out


def test_other_dense_optimizers_update_split_pairs_in_fp32():
    """An optimizer without a fused Split-pair kernel runs on the rejoined fp32 weight, split again:
    here plain SGD by that path, bit for bit the fused split_sgd_."""
    class Unfused:
        name = "unfused-sgd"

        def step(self, param, state, grad, lr):
            ops.sgd_(param, grad, lr)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 33)).astype(np.float32)
    g = rng.standard_normal((7, 33)).astype(np.float32)
    fused, unfused = SplitWeight(w), SplitWeight(w)
    fused.step(DLRM(**ARCH).dense_opt, None, g, 0.25)
    unfused.step(Unfused(), None, g, 0.25)
    np.testing.assert_array_equal(fused.hi.bits, unfused.hi.bits)
    np.testing.assert_array_equal(fused.lo, unfused.lo)
    np.testing.assert_array_equal(unfused.to_float32(), ops.sgd_(w.copy(), g, 0.25))
