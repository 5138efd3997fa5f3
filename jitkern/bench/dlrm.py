"""python -m jitkern bench dlrm --config NAME [--threads N] [--precision {fp32,bf16}]: a DLRM
training step, jitkern vs PyTorch.

Both models start from the same weights and train on the same random batches (the reference's
generator, fixed pooling, or a config's multi-hot sizes), in one process; the PyTorch model is
dlrm_s_pytorch.py's (nn.EmbeddingBag(mode="sum", sparse=True), Linear + ReLU, bmm + tril-gather
interaction, Sigmoid + BCELoss, optim.SGD), or for a dcn config (mlperf-dcn) TorchRec's DLRM_DCN
in plain PyTorch (the same bags, a low-rank cross network, BCE with logits, torch.optim.Adagrad
on the dense parameters and on the tables' sparse gradients). Also reported: jitkern's peak
memory over its parameter bytes.
--precision bf16: jitkern's bf16 step (DLRM(precision="bf16"): bf16 MLPs, interaction and tables;
fp32 tables for a config whose optimizer is not SGD) against its fp32 step, PyTorch's fp32 step and PyTorch under torch.autocast("cpu", bfloat16) on
the same model (the loss in fp32), all from the same weights.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import sys
import time
from contextlib import contextmanager

from ..config import sleep_idle_workers
from ..dlrm.configs import CONFIGS
from ..dlrm.model import DLRM, StageTimer
from ..dlrm.synth import config_batches
from .common import blas_description, print_table, set_threads, torch_or_none

LR = 0.01


# --------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


# --------------------------------------------------------------------------- PyTorch baseline


def _torch_mlp(torch, ws, bs, last):
    """nn.Sequential of Linear layers with these weights, ReLU after each hidden layer and `last`
    ("relu", "sigmoid" or None) after the last."""
    nn = torch.nn
    layers = []
    for l, (w, b) in enumerate(zip(ws, bs)):
        lin = nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w))
            lin.bias.copy_(torch.from_numpy(b))
        act = "relu" if l < len(ws) - 1 else last
        layers += [lin] + ([nn.ReLU()] if act == "relu" else [nn.Sigmoid()] if act == "sigmoid" else [])
    return nn.Sequential(*layers)


def torch_dlrm(torch, model: DLRM):
    """dlrm_s_pytorch.py's model (dot interaction) with `model`'s current weights."""
    nn = torch.nn

    class TorchDLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList()
            for w in model.emb:
                bag = nn.EmbeddingBag(w.shape[0], w.shape[1], mode="sum", sparse=True, _weight=torch.from_numpy(w.copy()))
                self.emb.append(bag)
            self.bot = _torch_mlp(torch, model.bot_w, model.bot_b, "relu")
            self.top = _torch_mlp(torch, model.top_w, model.top_b, "sigmoid")
            f = model.num_tables + 1
            self.li = torch.tensor([i for i in range(f) for j in range(i)])
            self.lj = torch.tensor([j for i in range(f) for j in range(i)])

        def forward(self, dense, offsets, indices):
            x = self.bot(dense)
            ly = [e(i, o) for e, i, o in zip(self.emb, indices, offsets)]
            b, d = x.shape
            t = torch.cat([x] + ly, dim=1).view((b, -1, d))
            z = torch.bmm(t, torch.transpose(t, 1, 2))
            return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1))

    return TorchDLRM()


def torch_dcn(torch, model: DLRM):
    """TorchRec's DLRM_DCN (dense arch, sparse arch, LowRankCrossNet, over arch) in plain PyTorch,
    with `model`'s current weights; returns logits."""
    nn = torch.nn

    def params(arrays):
        return nn.ParameterList([nn.Parameter(torch.from_numpy(a.copy())) for a in arrays])

    class TorchDCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(w.shape[0], w.shape[1], mode="sum", sparse=True,
                                                     _weight=torch.from_numpy(w.copy())) for w in model.emb)
            self.bot = _torch_mlp(torch, model.bot_w, model.bot_b, "relu")
            self.v, self.w, self.b = params(model.cross_v), params(model.cross_w), params(model.cross_b)
            self.top = _torch_mlp(torch, model.top_w, model.top_b, None)

        def forward(self, dense, offsets, indices):
            x = self.bot(dense)
            x0 = torch.cat([x] + [e(i, o) for e, i, o in zip(self.emb, indices, offsets)], dim=1)
            xl = x0
            for v, w, b in zip(self.v, self.w, self.b):
                xl = x0 * (nn.functional.linear(nn.functional.linear(xl, v), w) + b) + xl
            return self.top(xl)

    return TorchDCN()


def _torch_training(torch, model: DLRM, net=None):
    """(net, loss function, optimizers) of the PyTorch baseline for `model`'s architecture (net:
    that model, already built)."""
    if model.interaction != "dcn":
        net = torch_dlrm(torch, model) if net is None else net
        return net, torch.nn.BCELoss(reduction="mean"), [torch.optim.SGD(net.parameters(), lr=LR)]
    net = torch_dcn(torch, model) if net is None else net
    eps = getattr(model.dense_opt, "eps", 1e-8)
    tables = list(net.emb.parameters())
    dense = [p for p in net.parameters() if all(p is not t for t in tables)]
    return net, torch.nn.BCEWithLogitsLoss(reduction="mean"), [torch.optim.Adagrad(dense, lr=LR, eps=eps),
                                                                torch.optim.Adagrad(tables, lr=LR, eps=eps)]


def torch_step_fn(torch, model: DLRM, batches, *, net=None, autocast=False):
    """A PyTorch training step on `net` (default: a new model for `model`); autocast: the forward
    under torch.autocast("cpu", dtype=torch.bfloat16), the loss on its output in fp32."""
    net, loss_fn, opts = _torch_training(torch, model, net)
    tb = [(torch.from_numpy(b.dense), [torch.from_numpy(o) for o in b.offsets],
           [torch.from_numpy(i) for i in b.indices], torch.from_numpy(b.labels).view(-1, 1)) for b in batches]
    it = itertools.cycle(tb)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def step():
        dense, offsets, indices, labels = next(it)
        for opt in opts:
            opt.zero_grad()
        with context():
            out = net(dense, offsets, indices)
        loss = loss_fn(out.float(), labels)
        loss.backward()
        for opt in opts:
            opt.step()
        return loss.item()

    def first_loss():
        """The loss on batch 0 (forward only, parameters untouched)."""
        dense, offsets, indices, labels = tb[0]
        with torch.no_grad(), context():
            return loss_fn(net(dense, offsets, indices).float(), labels).item()
    step.first_loss = first_loss
    return step


# --------------------------------------------------------------------------- main


def _spread(times) -> str:
    """Half the 10-90 percentile range over the median, like common.Timing.spread."""
    t = sorted(times)
    q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
    return f"±{(q(0.9) - q(0.1)) / 2 / statistics.median(t) * 100:.0f}%"


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jitkern bench dlrm",
                                description="DLRM training step: jitkern vs PyTorch, same batches, one process")
    p.add_argument("--config", choices=sorted(CONFIGS), default="kaggle")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--num-batches", type=int, default=4, help="distinct random batches, cycled")
    p.add_argument("--reps", type=int, default=6, help="timed steps per implementation (at least)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--profile", action="store_true", help="jitkern's time per stage")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: jitkern's bf16 step against its fp32 step, PyTorch fp32 and PyTorch bf16 autocast")
    return p.parse_args(argv)


def _jitkern_model(cfg, batches, precision="fp32"):
    """The model, warmed up (compile, first touch) inside a peak-memory window; -> (model, step fn,
    peak bytes over the process before the model, whole-process peak, whether the peak was reset)."""
    gc.collect()
    exact_peak = reset_peak_rss()
    base = rss_bytes()
    # bf16 Split tables take SGD only: a config with another optimizer keeps fp32 tables
    tables = "fp32" if cfg.optimizer != "sgd" else None
    model = DLRM(**cfg.model_kwargs(), seed=0, precision=precision, embedding_precision=tables)
    it = itertools.cycle(batches)

    def step():
        b = next(it)
        model.train_step(b.dense, b.offsets, b.indices, b.labels, LR)
    for _ in range(2):
        step()
    peak_abs = peak_rss_bytes()
    return model, step, peak_abs - base, peak_abs, exact_peak


def stage_work(cfg, batch: int) -> dict:
    """stage -> (FLOPs, bytes) of one training step: the MLP GEMMs (forward 2*B*in*out per layer,
    backward twice that but for the first layer's unused input gradient), the dot interaction
    (B * pairs * D multiply-adds forward, twice backward), and the embedding rows moved in whole
    cache lines (the forward reads each looked-up row; the fused update reads and writes it, and its
    element-wise Adagrad state row). A dcn config's cross layers count 6 GEMMs of 2*B*n*r FLOPs each
    (2 forward, 4 backward; the backward's recomputation of u @ w.T is not counted)."""
    from ..dlrm.configs import interaction_width
    top_in = interaction_width(len(cfg.sizes), cfg.dim, cfg.interaction)
    bot = list(zip(cfg.bottom[:-1], cfg.bottom[1:]))
    top = list(zip([top_in, *cfg.top[:-1]], cfg.top))
    fwd = lambda layers: sum(2.0 * batch * i * o for i, o in layers)  # noqa: E731
    f = len(cfg.sizes) + 1
    pairs = f * (f - 1) // 2 if cfg.interaction == "dot" else 0
    line = 64
    row_bytes = -(-cfg.dim * 4 // line) * line
    lookups = batch * sum(cfg.pooling)
    cross = 6 * 2.0 * batch * top_in * cfg.dcn_rank * cfg.dcn_layers if cfg.interaction == "dcn" else 0.0
    upd = (4 if cfg.optimizer == "adagrad" else 2) * lookups * row_bytes
    return {
        "bottom_fwd": (fwd(bot), 0), "top_fwd": (fwd(top), 0),
        "bottom_bwd": (2 * fwd(bot) - fwd(bot[:1]), 0), "top_bwd": (2 * fwd(top), 0),
        "interaction": (6.0 * batch * pairs * cfg.dim + cross, 0),
        "embedding_fwd": (0, lookups * row_bytes), "embedding_upd": (0, upd),
    }


class _ThreadTimer(StageTimer):
    """Stage times in CPU time of the calling thread: on one thread, robust to being descheduled
    on a loaded machine (the kernels run on the caller)."""

    @contextmanager
    def __call__(self, name: str):
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.thread_time() - t0)


def _peaks(threads, bf16) -> dict:
    """stage -> this machine's measured FLOP peak for it: the FMA peak, the bf16 dot-product peak
    for a bf16 model's MLP stages (where its GEMMs run the vdpbf16ps tile)."""
    from ..codegen.peaks import bf16_peak_gflops, fma_peak_gflops
    from ..ops.gemm_bf16_kernel import bf16_tile
    fma = max(fma_peak_gflops() for _ in range(3)) * threads
    dot = [bf16_peak_gflops() for _ in range(3)] if bf16 and bf16_tile()[0] else [None]
    mlp = max(dot) * threads if dot[0] else fma
    return {"fma": fma, "mlp": mlp}


def _profile(model, step, reps, cfg, batch, threads) -> None:
    """--profile: jitkern's time per stage over `reps` steps, each stage's rate against this
    machine's measured FMA peak (GEMM stages; a bf16 model's MLPs: the bf16 dot-product peak) or
    copy bandwidth (embedding stages), and the step against its floor: every stage's FLOPs at its
    peak plus the embedding bytes at the bandwidth. On one thread stages and step are timed in the
    thread's CPU time, each the best of `reps` steps. The peaks are measured before and after the
    steps and the higher kept: load can only hide a peak, and a burst over one measurement once
    read 200 GFLOP/s for a 234 GFLOP/s bf16 peak (stages then showed 103% of it)."""
    from .common import copy_bandwidth_gbs
    bf16 = model.precision == "bf16"
    before = _peaks(threads, bf16)
    bandwidth = copy_bandwidth_gbs()
    clock = time.thread_time if threads == 1 else time.perf_counter
    best, wall = {}, float("inf")
    for _ in range(reps):
        model.timer = _ThreadTimer() if threads == 1 else StageTimer()
        t0 = clock()
        step()
        wall = min(wall, clock() - t0)
        for name, sec in model.timer.seconds.items():
            best[name] = min(best.get(name, float("inf")), sec)
    after = _peaks(threads, bf16)
    peaks = {k: max(before[k], after[k]) for k in before}
    peak = peaks["fma"]
    work = stage_work(cfg, batch)
    rows, floor = [], 0.0
    for name, sec in best.items():
        flops, nbytes = work.get(name, (0, 0))
        top = peaks["mlp"] if name.endswith(("_fwd", "_bwd")) and not name.startswith("embedding") else peak
        floor += flops / (top * 1e9) + nbytes / (bandwidth * 1e9)
        rate = (f"{flops / sec / 1e9:.1f} GFLOP/s", f"{100 * flops / sec / 1e9 / top:.0f}%") if flops else \
            ((f"{nbytes / sec / 1e9:.1f} GB/s", f"{100 * nbytes / sec / 1e9 / bandwidth:.0f}%") if nbytes else ("", ""))
        rows.append([name, f"{1e3 * sec:.2f}", *rate])
    print_table(["jitkern stage", "ms/step", "rate", "of peak"], rows)
    dot = f", bf16 dot product {peaks['mlp']:.1f} (MLP stages)" if peaks["mlp"] != peak else ""
    print(f"measured peaks: FMA {peak:.1f} GFLOP/s{dot} ({threads} thread{'s' * (threads > 1)}), "
          f"copy {bandwidth:.1f} GB/s; "
          f"step floor {floor * 1e3:.1f} ms (FLOPs at {'their peaks' if dot else 'the FMA peak'} + embedding bytes at the "
          f"copy bandwidth); "
          f"profiled step {wall * 1e3:.1f} ms = {wall / floor:.2f}x the floor")
    model.timer = StageTimer()


def _time_alternately(steps: dict, reps: int, cpu: dict | None = None) -> dict:
    """name -> step times; the implementations alternate step by step, so that a load change on a
    shared machine hits both alike. cpu: a dict to fill with each step's CPU time of this thread too."""
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.thread_time() - c0)
    return times


def main(argv=None) -> int:
    args = _parse(argv)
    if args.threads < 1 or args.num_batches < 1 or args.reps < 1:
        print("--threads, --num-batches and --reps must be >= 1", file=sys.stderr)
        return 2
    sleep_idle_workers()                 # for both implementations, before either starts its thread pool
    cfg = CONFIGS[args.config]
    blas = set_threads(args.threads)
    print(f"config {args.config}: {len(cfg.sizes)} tables ({sum(cfg.sizes):,} rows), D={cfg.dim}, "
          f"bottom {'-'.join(map(str, cfg.bottom))}, top {'-'.join(map(str, cfg.top))}, "
          f"pooling {'-'.join(map(str, cfg.multi_hot)) if cfg.multi_hot else cfg.lookups}, "
          f"{cfg.interaction}{f' {cfg.dcn_layers}x{cfg.dcn_rank}' if cfg.interaction == 'dcn' else ''}, "
          f"optimizer {cfg.optimizer}, batch {args.batch_size}, threads {args.threads}")
    print(blas_description() if blas else "BLAS: unknown")
    batches = config_batches(cfg, args.batch_size, args.num_batches)
    model, jk_step, peak, peak_abs, exact_peak = _jitkern_model(cfg, batches, args.precision)
    pbytes = model.parameter_bytes()
    if args.profile:
        _profile(model, jk_step, args.reps, cfg, args.batch_size, args.threads)
    if args.precision == "bf16":
        _bf16_comparison(args, cfg, batches, model, jk_step)
    else:
        _fp32_comparison(args, batches, model, jk_step)
    how = "" if exact_peak else " (process peak: an upper bound)"
    print(f"jitkern peak memory over the process before the model: {peak / 2**20:,.0f} MiB = "
          f"{peak / pbytes:.2f}x its {pbytes / 2**20:,.0f} MiB of parameters{how}; whole process "
          f"(interpreter, numba, batches) {peak_abs / 2**20:,.0f} MiB")
    return 0


def _print_times(steps, reps, batch, cpu=None) -> dict:
    """Time the steps alternately and print their table; -> name -> median seconds. cpu: a dict
    that receives name -> median CPU seconds of this thread (a column of its own)."""
    cpu_times = None if cpu is None else {}
    times = _time_alternately(steps, reps, cpu_times)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [[name, f"{med[name] * 1e3:.1f}", _spread(times[name]), f"{batch / med[name]:,.0f}"] for name in steps]
    head = ["implementation", "ms/iter", "spread", "samples/s"]
    if cpu is not None:
        cpu.update({name: statistics.median(t) for name, t in cpu_times.items()})
        head.append("thread CPU ms/iter")
        for row, name in zip(rows, steps):
            row.append(f"{cpu[name] * 1e3:.1f} {_spread(cpu_times[name])}")
    print_table(head, rows)
    return med


def _bf16_comparison(args, cfg, batches, model, jk_step) -> None:
    """jitkern bf16 against jitkern fp32, PyTorch fp32 and PyTorch bf16 autocast, all from the fp32
    model's weights (loaded into the bf16 one), one PyTorch model for both PyTorch steps."""
    ref, ref_step, *_ = _jitkern_model(cfg, batches)
    model.load_state_dict(ref.state_dict())
    steps = {"jitkern bf16": jk_step, "jitkern fp32": ref_step}
    b = batches[0]
    losses = {name: m.batch_loss(b.dense, b.offsets, b.indices, b.labels)
              for name, m in (("jitkern bf16", model), ("jitkern fp32", ref))}
    torch = None if args.no_torch else torch_or_none()
    if torch is not None:
        torch.set_num_threads(args.threads)
        net, tname = (torch_dcn if ref.interaction == "dcn" else torch_dlrm)(torch, ref), f"torch {torch.__version__}"
        for name, cast in ((f"{tname} fp32", False), (f"{tname} bf16 autocast", True)):
            steps[name] = torch_step_fn(torch, ref, batches, net=net, autocast=cast)
            losses[name] = steps[name].first_loss()
    print("same weights and batch, forward: loss " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    cpu = {} if args.threads == 1 else None     # one thread: each step runs on this one
    med = _print_times(steps, args.reps, args.batch_size, cpu)
    for what, t in (("wall", med), ("thread CPU", cpu)):
        if t is not None:
            print(f"jitkern bf16 speed-up ({what} time): " + ", ".join(
                f"{name} {t[name] / t['jitkern bf16']:.2f}x" for name in steps if name != "jitkern bf16"))


def _fp32_comparison(args, batches, model, jk_step) -> None:
    """jitkern's fp32 step against PyTorch's, from the same weights."""
    steps = {"jitkern": jk_step}
    torch = None if args.no_torch else torch_or_none()
    tname = None if torch is None else f"torch {torch.__version__}"
    if torch is not None:
        torch.set_num_threads(args.threads)
        tstep = steps[tname] = torch_step_fn(torch, model, batches)
        b = batches[0]                       # torch's first step is on batch 0 too, from the same weights
        jk_loss, t_loss = model.train_step(b.dense, b.offsets, b.indices, b.labels, LR), tstep()
        print(f"same weights and batch, one step: loss jitkern {jk_loss:.6f}, torch {t_loss:.6f}")
        tstep()
    med = _print_times(steps, args.reps, args.batch_size)
    if tname is not None:
        print(f"jitkern / torch samples/s: {med[tname] / med['jitkern']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
