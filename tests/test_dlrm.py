"""The DLRM model: train_step against a float64 NumPy reference DLRM, init, state, bad input."""
import numpy as np
import pytest

from jitkern.dlrm.model import DLRM
from jitkern.ops import reference as ref

SIZES = [5, 7, 3]          # tiny tables: multi-hot bags hit the same rows often (duplicates)
D = 16                     # the default run's width: its compiled kernels are shared
BOTTOM = [3, 12, D]
TOP = [6, 1]
B = 9


# --------------------------------------------------------------------------- float64 reference


def _layers(p, prefix):
    return sum(1 for k in p if k.startswith(prefix + ".") and k.endswith(".weight"))


def ref_forward(p, batch, interaction, self_interaction):
    """The reference DLRM's forward in float64; p: name -> float64 array. -> intermediates (dict)."""
    dense, offsets, indices, _ = batch
    f = {"bot_in": [], "top_in": [], "top_out": [], "bags": []}
    h = dense.astype(np.float64)
    for l in range(_layers(p, "bot")):
        f["bot_in"].append(h)
        h = np.maximum(h @ p[f"bot.{l}.weight"].T + p[f"bot.{l}.bias"], 0.0)
    ly = []
    for t, idx in enumerate(indices):
        starts, ends = ref._bag_bounds(offsets[t], len(idx), False)
        f["bags"].append(list(zip(starts, ends)))
        w = p[f"emb.{t}.weight"]
        ly.append(np.stack([w[idx[s:e]].sum(axis=0) for s, e in f["bags"][t]]))
    feats = np.stack([h] + ly, axis=1)                               # (B, F, D)
    if interaction == "dot":
        f["pairs"] = ref.interaction_pairs(feats.shape[1], self_interaction)
        gram = feats @ feats.transpose(0, 2, 1)
        z = np.concatenate([h, gram[:, f["pairs"][0], f["pairs"][1]]], axis=1)
    else:
        z = feats.reshape(len(h), -1)
    nt = _layers(p, "top")
    for l in range(nt):
        f["top_in"].append(z)
        z = z @ p[f"top.{l}.weight"].T + p[f"top.{l}.bias"]
        if l < nt - 1:
            z = np.maximum(z, 0.0)
        f["top_out"].append(z)
    f.update(h=h, feats=feats, logit=z[:, 0])
    return f


def ref_loss(p, batch, interaction, self_interaction):
    """Batch-mean BCE of the reference DLRM, all float64."""
    z, y = ref_forward(p, batch, interaction, self_interaction)["logit"], batch[3].astype(np.float64)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def ref_grads(p, batch, interaction, self_interaction):
    """Gradients of ref_loss by reverse mode, hand-written in float64 (checked by finite differences)."""
    f = ref_forward(p, batch, interaction, self_interaction)
    indices, labels = batch[2], batch[3]
    g = {k: np.zeros_like(v) for k, v in p.items()}
    logit, feats = f["logit"], f["feats"]
    dz = ((1 / (1 + np.exp(-logit)) - labels) / len(logit))[:, None]
    nt = len(f["top_in"])
    for l in range(nt - 1, -1, -1):
        if l < nt - 1:
            dz = dz * (f["top_out"][l] > 0)
        g[f"top.{l}.weight"] = dz.T @ f["top_in"][l]
        g[f"top.{l}.bias"] = dz.sum(axis=0)
        dz = dz @ p[f"top.{l}.weight"]
    if interaction == "dot":
        d = feats.shape[2]
        dgram = np.zeros((len(feats), feats.shape[1], feats.shape[1]))
        np.add.at(dgram, (slice(None), *f["pairs"]), dz[:, d:])
        dfeats = dgram @ feats + dgram.transpose(0, 2, 1) @ feats
        dfeats[:, 0] += dz[:, :d]
    else:
        dfeats = dz.reshape(feats.shape)
    for t, idx in enumerate(indices):
        for bag, (s, e) in enumerate(f["bags"][t]):
            np.add.at(g[f"emb.{t}.weight"], idx[s:e], dfeats[bag, t + 1])
    dh = dfeats[:, 0]
    outs = f["bot_in"][1:] + [f["h"]]
    for l in range(len(f["bot_in"]) - 1, -1, -1):
        dh = dh * (outs[l] > 0)
        g[f"bot.{l}.weight"] = dh.T @ f["bot_in"][l]
        g[f"bot.{l}.bias"] = dh.sum(axis=0)
        dh = dh @ p[f"bot.{l}.weight"]
    return g


# --------------------------------------------------------------------------- fixtures


def make_batch(rng, sizes=SIZES, b=B, max_bag=4, n_dense=BOTTOM[0]):
    """Multi-hot bags (empty ones too) drawn from tiny tables, so indices repeat within and across bags."""
    offsets = np.zeros((len(sizes), b), np.int64)
    indices = []
    for t, r in enumerate(sizes):
        lens = rng.integers(0, max_bag + 1, b)
        lens[0] = max_bag                                  # at least one full bag
        offsets[t, 1:] = np.cumsum(lens)[:-1]
        indices.append(rng.integers(0, r, lens.sum()).astype(np.int64))
    dense = rng.random((b, n_dense), dtype=np.float32)
    labels = (rng.random(b) < 0.5).astype(np.float32)
    return dense, offsets, indices, labels


def state64(m):
    return {k: v.astype(np.float64) for k, v in m.state_dict().items()}


CASES = [("dot", False), ("dot", True), ("cat", False)]


@pytest.mark.parametrize("interaction,self_int", CASES)
def test_reference_dlrm_gradients_match_finite_differences(interaction, self_int):
    m = DLRM(SIZES, D, BOTTOM, TOP, interaction=interaction, self_interaction=self_int, seed=3)
    p = state64(m)
    batch = make_batch(np.random.default_rng(0))
    g = ref_grads(p, batch, interaction, self_int)
    rng = np.random.default_rng(1)
    eps = 1e-6
    for name, w in p.items():
        for flat in rng.choice(w.size, size=min(w.size, 6), replace=False):
            pos = np.unravel_index(flat, w.shape)
            old = w[pos]
            w[pos] = old + eps
            up = ref_loss(p, batch, interaction, self_int)
            w[pos] = old - eps
            down = ref_loss(p, batch, interaction, self_int)
            w[pos] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g[name][pos]) <= 1e-7 + 1e-5 * abs(fd), (name, pos, fd, g[name][pos])


@pytest.mark.parametrize("interaction,self_int", CASES)
def test_train_step_equals_float64_reference(interaction, self_int):
    m = DLRM(SIZES, D, BOTTOM, TOP, interaction=interaction, self_interaction=self_int, seed=5)
    rng = np.random.default_rng(2)
    lr = 0.5
    for _ in range(2):                 # twice: the second step runs on reused buffers
        batch = make_batch(rng)
        p = state64(m)
        want_loss = ref_loss(p, batch, interaction, self_int)
        g = ref_grads(p, batch, interaction, self_int)
        probs = m.forward(*batch[:3])
        loss = m.train_step(*batch, lr)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        ref_probs = 1 / (1 + np.exp(-ref_forward(p, batch, interaction, self_int)["logit"]))
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-5, atol=1e-6)
        for name, w in m.state_dict().items():
            want = p[name] - lr * g[name]
            scale = np.abs(p[name]).max() + lr * np.abs(g[name]).max()
            np.testing.assert_allclose(w, want, rtol=0, atol=2e-6 * scale, err_msg=name)
            untouched = g[name] == 0                       # rows no bag used stay bit-identical
            np.testing.assert_array_equal(w[untouched], p[name][untouched].astype(np.float32))


def test_relu_byte_masks_give_the_step_of_the_float_masks(monkeypatch):
    # every hidden activation "outgrows L2": the forward writes its byte mask and the backward's dx
    # epilogue reads it; the trained weights equal, bit for bit, those of a model that masks dx by
    # the activations themselves
    import jitkern.dlrm.step as step
    monkeypatch.setattr(step, "host_target", lambda: type("T", (), {"l2": 0})())
    models = [DLRM(SIZES, D, BOTTOM, TOP, seed=5) for _ in range(2)]
    rng = np.random.default_rng(3)
    batches = [make_batch(rng) for _ in range(2)]
    buf = models[0]._buffers_for(B)
    assert all(m is not None for mlp in ("bottom", "top") for m in buf.relu_masks[mlp])
    models[1]._buffers_for(B).relu_masks = {"bottom": None, "top": None}
    for batch in batches:
        losses = [m.train_step(*batch, 0.5) for m in models]
        assert losses[0] == losses[1]
        for mlp, acts in (("bottom", buf.bot), ("top", buf.top[:-1])):
            for mask, y in zip(buf.relu_masks[mlp], acts):
                np.testing.assert_array_equal(mask, y > 0)
    for (name, got), want in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_strided_dense_batch_trains_as_its_contiguous_copy():
    # the bottom MLP's first layer reads the caller's dense array through the checked op (the
    # layers after it skip the checks on the step's own buffers): a Fortran-ordered or strided
    # dense is taken as its copy, bit for bit, in the forward and in the weight gradient
    models = [DLRM(SIZES, D, BOTTOM, TOP, seed=5) for _ in range(3)]
    rng = np.random.default_rng(4)
    for _ in range(2):
        dense, offsets, indices, labels = make_batch(rng)
        wide = np.zeros((B, 2 * BOTTOM[0]), np.float32)
        wide[:, ::2] = dense
        views = (dense, np.asfortranarray(dense), wide[:, ::2])
        losses = [m.train_step(v, offsets, indices, labels, 0.5) for m, v in zip(models, views)]
        assert losses[0] == losses[1] == losses[2]
    for name, want in models[0].state_dict().items():
        for m in models[1:]:
            np.testing.assert_array_equal(m.state_dict()[name], want, err_msg=name)


def test_initialisation_follows_the_reference():
    m = DLRM([10, 2_000_001], 4, [3, 5, 4], [7, 1], seed=11)
    rs = np.random.RandomState(11)
    for t, r in enumerate([10, 2_000_001]):
        bound = np.sqrt(1 / r)
        want = rs.uniform(-bound, bound, size=(r, 4)).astype(np.float32)
        np.testing.assert_array_equal(m.emb[t], want)
    for prefix, sizes in (("bot", [3, 5, 4]), ("top", [m.top_mlp[0], 7, 1])):
        for l, (n, k) in enumerate(zip(sizes[:-1], sizes[1:])):
            w = rs.normal(0.0, np.sqrt(2 / (k + n)), size=(k, n)).astype(np.float32)
            b = rs.normal(0.0, np.sqrt(1 / k), size=k).astype(np.float32)
            np.testing.assert_array_equal(m.state_dict()[f"{prefix}.{l}.weight"], w)
            np.testing.assert_array_equal(m.state_dict()[f"{prefix}.{l}.bias"], b)


def test_top_input_width_is_derived():
    assert DLRM([3] * 26, 16, [13, 16], [1]).top_mlp[0] == 16 + 27 * 26 // 2      # 367, as Criteo's
    assert DLRM([3] * 26, 16, [13, 16], [1], self_interaction=True).top_mlp[0] == 16 + 27 * 28 // 2
    assert DLRM([3] * 26, 16, [13, 16], [1], interaction="cat").top_mlp[0] == 16 * 27


def test_state_dict_round_trip_and_validation():
    a = DLRM(SIZES, D, BOTTOM, TOP, seed=1)
    b = DLRM(SIZES, D, BOTTOM, TOP, seed=2)
    sd = a.state_dict()
    assert set(sd) == set(b.state_shapes())
    assert sd["emb.1.weight"].shape == (7, D) and sd["bot.0.weight"].shape == (12, 3)
    assert sd["top.1.bias"].shape == (1,)
    before = {k: v.copy() for k, v in b.state_dict().items()}
    bad = dict(sd)
    bad["top.0.weight"] = sd["top.0.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"top\.0\.weight.*shape"):
        b.load_state_dict(bad)
    bad = dict(sd)
    bad["emb.0.weight"] = sd["emb.0.weight"].astype(np.float64)
    with pytest.raises(TypeError, match=r"emb\.0\.weight.*float32"):
        b.load_state_dict(bad)
    bad = {k: v for k, v in sd.items() if k != "bot.1.bias"}
    with pytest.raises(KeyError, match=r"bot\.1\.bias"):
        b.load_state_dict(bad)
    for k, v in b.state_dict().items():                       # a failed load changes nothing
        np.testing.assert_array_equal(v, before[k])
    b.load_state_dict(sd)
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
        assert v is not sd[k]                                 # copied, not aliased


def test_forward_changes_nothing_and_buffers_are_reused():
    m = DLRM(SIZES, D, BOTTOM, TOP, seed=1)
    batch = make_batch(np.random.default_rng(3))
    before = {k: v.copy() for k, v in m.state_dict().items()}
    p1 = m.forward(*batch[:3]).copy()
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    buf = m._buffers[B]
    m.train_step(*batch, 0.1)
    assert m._buffers[B] is buf and len(m._buffers) == 1
    assert not np.array_equal(m.forward(*batch[:3]), p1)


def test_bad_input_is_a_clear_error_and_changes_nothing():
    m = DLRM(SIZES, D, BOTTOM, TOP, seed=1)
    dense, offsets, indices, labels = make_batch(np.random.default_rng(4))
    before = {k: v.copy() for k, v in m.state_dict().items()}
    bad_idx = [i.copy() for i in indices]
    bad_idx[1][offsets[1, 4]] = 7                                   # table 1 has 7 rows
    assert offsets[1, 4] < (offsets[1, 5])                          # sample 4's bag is not empty
    with pytest.raises(IndexError, match=r"table 1: index 7 of sample 4 .*\[0, 7\)"):
        m.train_step(dense, offsets, bad_idx, labels, 0.1)
    bad_idx[1][offsets[1, 4]] = -1
    with pytest.raises(IndexError, match="table 1: index -1 of sample 4"):
        m.train_step(dense, offsets, bad_idx, labels, 0.1)
    bad_dense = dense.copy()
    bad_dense[6, 2] = np.nan
    with pytest.raises(ValueError, match="dense feature 2 of sample 6 is nan"):
        m.train_step(bad_dense, offsets, indices, labels, 0.1)
    bad_labels = labels.copy()
    bad_labels[3] = 1.5
    with pytest.raises(ValueError, match="label of sample 3 is 1.5"):
        m.train_step(dense, offsets, indices, bad_labels, 0.1)
    with pytest.raises(ValueError, match="offsets must be"):
        m.train_step(dense, offsets[:, :-1], indices, labels, 0.1)
    with pytest.raises(ValueError, match="3 arrays"):
        m.train_step(dense, offsets, indices[:2], labels, 0.1)
    with pytest.raises(ValueError, match=r"dense must be \(B, 3\)"):
        m.train_step(dense[:, :2], offsets, indices, labels, 0.1)
    with pytest.raises(ValueError, match="lr must be finite"):
        m.train_step(dense, offsets, indices, labels, float("nan"))
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("kwargs,match", [
    (dict(bottom_mlp=[3, 12, 5]), "bottom_mlp output 5 != embedding_dim 16"),
    (dict(top_mlp=[6, 2]), "end in 1 output"),
    (dict(interaction="mul"), "interaction must be one of"),
    (dict(embedding_sizes=[5, 0]), r"embedding_sizes\[1\] \(table 1\)"),
    (dict(embedding_precision="fp16"), "embedding_precision must be one of"),
])
def test_architecture_errors(kwargs, match):
    args = dict(embedding_sizes=SIZES, embedding_dim=D, bottom_mlp=BOTTOM, top_mlp=TOP)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DLRM(**args)


def test_communicator_builds_the_distributed_model_or_says_why_not(monkeypatch):
    from jitkern.dlrm import DistributedDLRM
    assert DLRM._comm_variant is DistributedDLRM
    monkeypatch.setattr(DLRM, "_comm_variant", None)                   # as if dist were not loaded
    with pytest.raises(NotImplementedError, match="comm"):
        DLRM(SIZES, D, BOTTOM, TOP, comm=object())


def test_bf16_tables_read_bf16_and_update_exact_fp32():
    m32 = DLRM(SIZES, D, BOTTOM, TOP, seed=7)
    m16 = DLRM(SIZES, D, BOTTOM, TOP, seed=7, embedding_precision="bf16")
    assert m16.parameter_bytes() == m32.parameter_bytes()
    for t, w in enumerate(m32.emb):                         # same master weights ...
        np.testing.assert_array_equal(m16.state_dict()[f"emb.{t}.weight"], w)
    batch = make_batch(np.random.default_rng(8))
    p = state64(m32)
    for t in range(len(SIZES)):                               # ... but the forward reads bf16
        p[f"emb.{t}.weight"] = ref.bf16_to_float32(ref.bf16_split(m32.emb[t])[0]).astype(np.float64)
    g = ref_grads(p, batch, "dot", False)
    loss = m16.train_step(*batch, 0.5)
    assert loss == pytest.approx(ref_loss(p, batch, "dot", False), rel=1e-5)
    for t, w in enumerate(m32.emb):
        want = w.astype(np.float64) - 0.5 * g[f"emb.{t}.weight"]
        np.testing.assert_allclose(m16.state_dict()[f"emb.{t}.weight"], want, atol=2e-6)
