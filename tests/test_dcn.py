"""DLRM-DCNv2 (interaction="dcn"): the model against a float64 NumPy reference (forward, gradients
checked by finite differences, SGD and Adagrad steps) and, where torch is installed, against a
PyTorch model of the same architecture trained by torch.optim.Adagrad (sparse tables)."""
import numpy as np
import pytest

from jitkern.dlrm.model import DLRM
from test_dlrm import make_batch

try:
    import torch
except ImportError:  # the torch comparison only is skipped
    torch = None

SIZES = [5, 7, 3]
D = 16
BOTTOM = [3, 12, D]
TOP = [6, 1]
B = 9
LAYERS, RANK = 2, 5


def _model(seed=3, **kw):
    return DLRM(SIZES, D, BOTTOM, TOP, interaction="dcn", dcn_layers=LAYERS, dcn_rank=RANK, seed=seed, **kw)


def _count(p, prefix, suffix):
    return sum(1 for k in p if k.startswith(prefix + ".") and k.endswith(suffix))


# --------------------------------------------------------------------------- float64 reference


def ref_forward(p, batch):
    """The DCN DLRM's forward in float64; p: name -> float64 array -> intermediates (dict)."""
    dense, offsets, indices, _ = batch
    f = {"bot_in": [], "top_in": [], "top_out": [], "bags": [], "xl": [], "y": []}
    h = dense.astype(np.float64)
    for l in range(_count(p, "bot", ".weight")):
        f["bot_in"].append(h)
        h = np.maximum(h @ p[f"bot.{l}.weight"].T + p[f"bot.{l}.bias"], 0.0)
    ly = []
    for t, idx in enumerate(indices):
        ends = list(offsets[t][1:]) + [len(idx)]
        f["bags"].append(list(zip(offsets[t], ends)))
        ly.append(np.stack([p[f"emb.{t}.weight"][idx[s:e]].sum(axis=0) for s, e in f["bags"][t]]))
    x0 = np.concatenate([h] + ly, axis=1)                              # (B, (T+1) D)
    x = x0
    for l in range(_count(p, "cross", ".v")):
        f["xl"].append(x)
        y = (x @ p[f"cross.{l}.v"].T) @ p[f"cross.{l}.w"].T + p[f"cross.{l}.b"]
        f["y"].append(y)
        x = x0 * y + x
    z = x
    nt = _count(p, "top", ".weight")
    for l in range(nt):
        f["top_in"].append(z)
        z = z @ p[f"top.{l}.weight"].T + p[f"top.{l}.bias"]
        if l < nt - 1:
            z = np.maximum(z, 0.0)
        f["top_out"].append(z)
    f.update(h=h, x0=x0, logit=z[:, 0])
    return f


def ref_loss(p, batch):
    z, y = ref_forward(p, batch)["logit"], batch[3].astype(np.float64)
    return float(np.mean(np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))))


def ref_grads(p, batch):
    """Gradients of ref_loss by reverse mode, hand-written in float64."""
    f = ref_forward(p, batch)
    indices, labels = batch[2], batch[3]
    g = {k: np.zeros_like(v) for k, v in p.items()}
    logit = f["logit"]
    dz = ((1 / (1 + np.exp(-logit)) - labels) / len(logit))[:, None]
    nt = len(f["top_in"])
    for l in range(nt - 1, -1, -1):
        if l < nt - 1:
            dz = dz * (f["top_out"][l] > 0)
        g[f"top.{l}.weight"] = dz.T @ f["top_in"][l]
        g[f"top.{l}.bias"] = dz.sum(axis=0)
        dz = dz @ p[f"top.{l}.weight"]
    x0, dx0 = f["x0"], np.zeros_like(f["x0"])
    for l in range(len(f["xl"]) - 1, -1, -1):
        xl, v, w = f["xl"][l], p[f"cross.{l}.v"], p[f"cross.{l}.w"]
        dx0 += dz * f["y"][l]
        dy = dz * x0
        du = dy @ w
        g[f"cross.{l}.b"] = dy.sum(axis=0)
        g[f"cross.{l}.w"] = dy.T @ (xl @ v.T)
        g[f"cross.{l}.v"] = du.T @ xl
        dz = dz + du @ v
    dfeats = (dx0 + dz).reshape(len(x0), -1, D)
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


def state64(m):
    return {k: v.astype(np.float64) for k, v in m.state_dict().items()}


def _nonzero_bias(m, rng):
    """Cross biases start at zero (TorchRec's init): give them values so their gradient path shows."""
    for b in m.cross_b:
        b[:] = rng.standard_normal(b.shape).astype(np.float32) * 0.3


# --------------------------------------------------------------------------- tests


def test_state_names_shapes_and_init():
    m = _model()
    sd = m.state_dict()
    n = (len(SIZES) + 1) * D
    assert m.top_mlp[0] == n
    names = list(sd)
    cross = [k for k in names if k.startswith("cross.")]
    assert cross == [f"cross.{l}.{k}" for l in range(LAYERS) for k in "vwb"]
    assert names.index(cross[0]) > names.index("bot.1.bias") and names.index(cross[-1]) < names.index("top.0.weight")
    for l in range(LAYERS):
        assert sd[f"cross.{l}.v"].shape == (RANK, n) and sd[f"cross.{l}.w"].shape == (n, RANK)
        assert sd[f"cross.{l}.b"].shape == (n,) and not sd[f"cross.{l}.b"].any()
        assert sd[f"cross.{l}.v"].std() == pytest.approx(np.sqrt(2 / (n + RANK)), rel=0.2)
    # the dot and cat models draw exactly what they drew before (the cross network draws only for dcn)
    cat = DLRM(SIZES, D, BOTTOM, TOP, interaction="cat", seed=3)
    for k in ("bot.0.weight", "emb.2.weight"):
        np.testing.assert_array_equal(cat.state_dict()[k], sd[k])
    assert m.arch_extras() == {"dcn_layers": LAYERS, "dcn_rank": RANK}
    assert "dcn_layers" not in cat.arch_extras()
    with pytest.raises(ValueError, match="dcn_rank"):
        DLRM(SIZES, D, BOTTOM, TOP, interaction="dcn", dcn_rank=0)
    with pytest.raises(ValueError, match="interaction must be one of"):
        DLRM(SIZES, D, BOTTOM, TOP, interaction="projection")


def test_reference_gradients_match_finite_differences():
    m = _model()
    _nonzero_bias(m, np.random.default_rng(4))
    p = state64(m)
    batch = make_batch(np.random.default_rng(0))
    g = ref_grads(p, batch)
    rng = np.random.default_rng(1)
    eps = 1e-6
    for name, w in p.items():
        for flat in rng.choice(w.size, size=min(w.size, 6), replace=False):
            pos = np.unravel_index(flat, w.shape)
            old = w[pos]
            w[pos] = old + eps
            up = ref_loss(p, batch)
            w[pos] = old - eps
            down = ref_loss(p, batch)
            w[pos] = old
            fd = (up - down) / (2 * eps)
            assert abs(fd - g[name][pos]) <= 1e-7 + 1e-5 * abs(fd), (name, pos, fd, g[name][pos])


def test_sgd_steps_equal_float64_reference():
    m = _model(seed=5)
    rng = np.random.default_rng(2)
    _nonzero_bias(m, rng)
    lr = 0.5
    for _ in range(2):                 # twice: the second step runs on reused buffers
        batch = make_batch(rng)
        p = state64(m)
        want_loss = ref_loss(p, batch)
        g = ref_grads(p, batch)
        probs = m.forward(*batch[:3])
        loss = m.train_step(*batch, lr)
        assert loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
        ref_probs = 1 / (1 + np.exp(-ref_forward(p, batch)["logit"]))
        np.testing.assert_allclose(probs, ref_probs, rtol=1e-5, atol=1e-6)
        for name, w in m.state_dict().items():
            want = p[name] - lr * g[name]
            scale = np.abs(p[name]).max() + lr * np.abs(g[name]).max()
            np.testing.assert_allclose(w, want, rtol=0, atol=2e-6 * scale, err_msg=name)


def _ref_adagrad_steps(m, batches, lr, eps):
    """Losses and parameters of float64 Adagrad steps from m's parameters (element-wise on tables:
    rows no bag used keep their state and weights, as a sparse update leaves them)."""
    p, state, losses = state64(m), None, []
    state = {k: np.zeros_like(v) for k, v in p.items()}
    for batch in batches:
        losses.append(ref_loss(p, batch))
        g = ref_grads(p, batch)
        for k in p:
            state[k] += g[k] * g[k]
            p[k] -= lr * g[k] / (np.sqrt(state[k]) + eps)
    return losses, p


def _rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("table_optimizer", [None, "rowwise_adagrad"])
def test_adagrad_steps_equal_float64_reference(table_optimizer):
    m = _model(seed=7, optimizer="adagrad", table_optimizer=table_optimizer, eps=1e-8)
    rng = np.random.default_rng(3)
    _nonzero_bias(m, rng)
    batches = [make_batch(rng) for _ in range(3)]
    lr = 0.05
    if table_optimizer is None:
        want_losses, want = _ref_adagrad_steps(m, batches, lr, 1e-8)
    for step, batch in enumerate(batches):
        loss = m.train_step(*batch, lr)
        if table_optimizer is None:
            assert loss == pytest.approx(want_losses[step], rel=1e-5)
    assert set(m.optimizer_state_dict()) == {f"state.{k}" for k in m.state_dict()}
    if table_optimizer is None:
        for name, w in m.state_dict().items():
            assert _rel(w, want[name]) <= 1e-5, name
    else:
        assert m.optimizer_state_dict()["state.emb.0.weight"].shape == (SIZES[0],)


def test_checkpoint_arrays_resume_exactly():
    m = _model(seed=8, optimizer="adagrad")
    rng = np.random.default_rng(6)
    batches = [make_batch(rng) for _ in range(3)]
    m.train_step(*batches[0], 0.05)
    saved = {k: v.copy() for k, v in m.checkpoint_arrays().items()}
    assert "state.cross.1.w" in saved and saved["state.cross.1.w"].any()
    other = _model(seed=99, optimizer="adagrad")
    other.load_state_dict(saved)
    for batch in batches[1:]:
        assert m.train_step(*batch, 0.05) == other.train_step(*batch, 0.05)
    for k, v in m.checkpoint_arrays().items():
        np.testing.assert_array_equal(v, other.checkpoint_arrays()[k], err_msg=k)


# --------------------------------------------------------------------------- torch


class _TorchDCN(torch.nn.Module if torch is not None else object):
    """The same DLRM-DCNv2 in PyTorch (TorchRec's DLRM_DCN structure): sparse EmbeddingBags, ReLU
    dense arch, LowRankCrossNet, over arch."""

    def __init__(self, sd, num_tables, layers):
        super().__init__()
        t = {k: torch.from_numpy(v.copy()) for k, v in sd.items()}
        self.emb = torch.nn.ModuleList()
        for i in range(num_tables):
            bag = torch.nn.EmbeddingBag(*t[f"emb.{i}.weight"].shape, mode="sum", sparse=True)
            bag.weight.data.copy_(t[f"emb.{i}.weight"])
            self.emb.append(bag)

        def mlp(prefix):
            out = torch.nn.ModuleList()
            for l in range(sum(1 for k in t if k.startswith(prefix + ".") and k.endswith(".weight"))):
                w = t[f"{prefix}.{l}.weight"]
                lin = torch.nn.Linear(w.shape[1], w.shape[0])
                lin.weight.data.copy_(w)
                lin.bias.data.copy_(t[f"{prefix}.{l}.bias"])
                out.append(lin)
            return out
        self.bot, self.top = mlp("bot"), mlp("top")
        self.v = torch.nn.ParameterList([torch.nn.Parameter(t[f"cross.{l}.v"]) for l in range(layers)])
        self.w = torch.nn.ParameterList([torch.nn.Parameter(t[f"cross.{l}.w"]) for l in range(layers)])
        self.b = torch.nn.ParameterList([torch.nn.Parameter(t[f"cross.{l}.b"]) for l in range(layers)])

    def forward(self, dense, offsets, indices):
        h = dense
        for lin in self.bot:
            h = torch.relu(lin(h))
        ly = [bag(idx, off) for bag, idx, off in zip(self.emb, indices, offsets)]
        x0 = torch.cat([h] + ly, dim=1)
        x = x0
        for v, w, b in zip(self.v, self.w, self.b):
            x = x0 * (torch.nn.functional.linear(torch.nn.functional.linear(x, v), w) + b) + x
        for l, lin in enumerate(self.top):
            x = lin(x)
            if l < len(self.top) - 1:
                x = torch.relu(x)
        return x.reshape(-1)

    def state(self):
        sd = {f"emb.{i}.weight": bag.weight for i, bag in enumerate(self.emb)}
        for prefix, mlp in (("bot", self.bot), ("top", self.top)):
            for l, lin in enumerate(mlp):
                sd[f"{prefix}.{l}.weight"], sd[f"{prefix}.{l}.bias"] = lin.weight, lin.bias
        for l, (v, w, b) in enumerate(zip(self.v, self.w, self.b)):
            sd[f"cross.{l}.v"], sd[f"cross.{l}.w"], sd[f"cross.{l}.b"] = v, w, b
        return {k: a.detach().numpy() for k, a in sd.items()}


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_three_adagrad_steps_equal_pytorch():
    """3 steps: loss within 1e-5 relative per step, every weight within 1e-5 norm-wise relative error."""
    sizes, dim, bottom, top = [50, 20, 7, 31], 16, [5, 32, 16], [24, 12, 1]
    m = DLRM(sizes, dim, bottom, top, interaction="dcn", dcn_layers=3, dcn_rank=8, seed=1, optimizer="adagrad",
             eps=1e-8)
    rng = np.random.default_rng(12)
    _nonzero_bias(m, rng)
    tm = _TorchDCN(m.state_dict(), len(sizes), 3)
    sparse = [bag.weight for bag in tm.emb]
    dense = [p for p in tm.parameters() if all(p is not s for s in sparse)]
    lr, eps = 0.05, 1e-8
    opts = [torch.optim.Adagrad(dense, lr=lr, eps=eps), torch.optim.Adagrad(sparse, lr=lr, eps=eps)]
    for _ in range(3):
        batch = make_batch(rng, sizes=sizes, b=32, max_bag=5, n_dense=bottom[0])
        dense_x, offsets, indices, labels = batch
        for o in opts:
            o.zero_grad()
        logits = tm(torch.from_numpy(dense_x), [torch.from_numpy(o) for o in offsets],
                    [torch.from_numpy(i) for i in indices])
        want = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels))
        want.backward()
        for o in opts:
            o.step()
        loss = m.train_step(*batch, lr)
        assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    theirs = tm.state()
    for name, w in m.state_dict().items():
        assert _rel(w, theirs[name].astype(np.float64)) <= 1e-5, name


def test_mlperf_dcn_config_batches_and_bench_baseline():
    """mlperf-dcn: the MLPerf multi-hot sizes (214 lookups per sample), element-wise Adagrad; the
    bench's PyTorch baseline on a small config of the same kind takes the same first step."""
    from jitkern.dlrm.configs import CONFIGS, MLPERF_MULTI_HOT, ModelConfig
    from jitkern.dlrm.synth import config_batches
    cfg = CONFIGS["mlperf-dcn"]
    assert sum(cfg.pooling) == 214 and cfg.pooling == MLPERF_MULTI_HOT
    assert cfg.model_kwargs()["interaction"] == "dcn" and cfg.model_kwargs()["optimizer"] == "adagrad"
    assert (cfg.model_kwargs()["dcn_layers"], cfg.model_kwargs()["dcn_rank"]) == (3, 512)
    small = ModelConfig((300, 40, 7), 8, (4, 16, 8), (12, 1), interaction="dcn", multi_hot=(3, 1, 5),
                        dcn_layers=2, dcn_rank=6, optimizer="adagrad")
    batches = config_batches(small, 32, 2)
    b = batches[0]
    assert [len(i) for i in b.indices] == [96, 32, 160] and b.offsets.shape == (3, 32)
    np.testing.assert_array_equal(b.offsets[2], np.arange(32) * 5)
    assert all(i.max() < r for i, r in zip(b.indices, small.sizes))
    if torch is None:
        return
    from jitkern.bench.dlrm import LR, torch_step_fn
    m = DLRM(**small.model_kwargs(), seed=0)
    step = torch_step_fn(torch, m, batches)
    theirs = [step() for _ in range(2)]
    ours = [m.train_step(x.dense, x.offsets, x.indices, x.labels, LR) for x in batches]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_scaling_model_counts_the_cross_network():
    """The cost model's dense stages and the allreduced parameters include a dcn model's cross layers."""
    from jitkern.dlrm.configs import CONFIGS
    from jitkern.dlrm.costmodel import dense_estimate
    from jitkern.dlrm.scale import mlp_params
    cfg = CONFIGS["mlperf-dcn"]
    n = 27 * 128
    est = dense_estimate(cfg.bottom, [n, *cfg.top], 1024, gflops=1.0, cross=(3, 512))
    assert est["interaction"] == pytest.approx(6 * 2 * 1024 * n * 512 * 3 / 1e9)
    assert "interaction" not in dense_estimate(cfg.bottom, [n, *cfg.top], 1024)
    plain = CONFIGS["mlperf"]
    top = [n, *cfg.top]
    mlps = sum(a * b + b for sizes in (cfg.bottom, top) for a, b in zip(sizes[:-1], sizes[1:]))
    assert mlp_params(cfg) == mlps + 3 * (2 * 512 + 1) * n
    assert mlp_params(plain) < mlps
