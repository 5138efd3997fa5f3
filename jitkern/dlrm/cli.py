"""The DLRM trainer's command line: dlrm_s_pytorch.py's flags, plus --threads, --embedding-precision,
--autotune, --profile and --plot (and --sharding, --rank-memory-gb under mpiexec). Entry points:
`python examples/dlrm_numba.py` and `python -m jitkern train`.

With no flags it trains a small model on learnable synthetic data for a few seconds.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from .. import set_num_threads
from ..config import debug_level, get_config, sleep_idle_workers
from ..report import print_table
from . import preflight
from .autotune import tune_for, tune_for_ranks
from .data import iterate_batches, load_preprocessed, table_sizes
from .interrupt import Interrupted, raising_signals
from .launch import comm_from_env, launch_rank, write_lines
from .model import DLRM, StageTimer
from .synth import RandomData, SyntheticData
from .train import LRSchedule, TrainOptions, Trainer, arch_dict, load_checkpoint, state_from_meta

PROG = "dlrm"


def _sizes(flag, text):
    try:
        sizes = [int(v) for v in text.split("-")]
    except ValueError:
        raise ValueError(f"{flag} must be dash-separated integers such as 13-512-256-64, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag} sizes must be >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Train a DLRM with jitkern's kernels "
                                "(flags as dlrm_s_pytorch.py; the defaults are a small synthetic run).")
    a = p.add_argument_group("model")
    a.add_argument("--arch-sparse-feature-size", type=int, default=16, help="embedding dim D")
    a.add_argument("--arch-embedding-size", default="10-20-40-80-160-320-640-1280",
                   help="rows per table, dash-separated (ignored with --data-generation dataset)")
    a.add_argument("--arch-mlp-bot", default="13-64-16", help="bottom MLP: n_dense-...-D")
    a.add_argument("--arch-mlp-top", default="64-32-1", help="top MLP without its input width: ...-1")
    a.add_argument("--arch-interaction-op", choices=("dot", "cat"), default="dot")
    a.add_argument("--arch-interaction-itself", action="store_true", default=False)
    a.add_argument("--embedding-precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: Split-SGD tables (bf16 lookups, exact fp32 updates)")
    d = p.add_argument_group("data")
    d.add_argument("--data-generation", choices=("random", "synthetic", "dataset"), default="synthetic",
                   help="random: the reference's generator; synthetic: learnable (hidden teacher); "
                        "dataset: preprocessed Criteo data")
    d.add_argument("--num-indices-per-lookup", type=int, default=1)
    d.add_argument("--num-indices-per-lookup-fixed", action="store_true", default=False)
    d.add_argument("--round-targets", action="store_true", default=False, help="random: 0/1 labels")
    d.add_argument("--data-size", type=int, default=0, help="random: samples per epoch (0: batches x batch size)")
    d.add_argument("--processed-data-file", default="", help="dataset: directory written by `jitkern preprocess`")
    d.add_argument("--raw-data-file", default="", help="dataset: raw Criteo log (preprocess it first)")
    d.add_argument("--max-ind-range", type=int, default=-1, help="dataset: ids modulo this many rows")
    d.add_argument("--data-randomize", choices=("none", "total"), default="total",
                   help="dataset: shuffle training batches (by block)")
    d.add_argument("--numpy-rand-seed", type=int, default=123)
    t = p.add_argument_group("training")
    t.add_argument("--mini-batch-size", type=int, default=256)
    t.add_argument("--num-batches", type=int, default=1000, help="batches per epoch (0: the whole data set)")
    t.add_argument("--nepochs", type=int, default=1)
    t.add_argument("--learning-rate", type=float, default=0.5)
    t.add_argument("--lr-num-warmup-steps", type=int, default=0)
    t.add_argument("--lr-decay-start-step", type=int, default=0)
    t.add_argument("--lr-num-decay-steps", type=int, default=0)
    t.add_argument("--mlperf-auc-threshold", type=float, default=0.0, help="stop once test AUC reaches it")
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--test-freq", type=int, default=250,
                   help="evaluate before training and every N iterations (-1: only at the end)")
    e.add_argument("--test-mini-batch-size", type=int, default=-1, help="(-1: --mini-batch-size)")
    e.add_argument("--num-test-batches", type=int, default=0, help="held-out batches (0: a tenth, at least 4)")
    e.add_argument("--print-freq", type=int, default=250)
    e.add_argument("--print-time", action="store_true", default=False)
    e.add_argument("--save-model", default="", help="checkpoint file, written at every test and at the end")
    e.add_argument("--load-model", default="", help="resume from this checkpoint")
    e.add_argument("--inference-only", action="store_true", default=False, help="evaluate only")
    e.add_argument("--threads", type=int, default=0, help="kernel threads (0: numba's default)")
    e.add_argument("--autotune", action="store_true", default=False,
                   help="before training, tune the kernels for this model's shapes where the tuning DB "
                        "has no entry yet (stored: later runs time nothing)")
    e.add_argument("--profile", action="store_true", default=False, help="print a per-op time table at the end")
    _add_rank_flags(p)
    e.add_argument("--plot", default="", metavar="FILE.png", help="loss and AUC curves (needs matplotlib)")
    e.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="tqdm progress bar")
    return p


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of GB >= 0, got {text!r}")
    return value


def _add_rank_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("many ranks (mpiexec)")
    m.add_argument("--sharding", choices=("auto", "table", "row", "column", "table_row", "replicate"), default="auto",
                   help="how tables are split over the ranks: auto (the cost-model planner), or one kind for every "
                        "table (the plan is printed at start)")
    m.add_argument("--rank-memory-gb", type=_gigabytes, default=0.0,
                   help="memory per rank the plan must fit, GB (0: this machine's RAM over its ranks); a table "
                        "larger than it is split row-wise")


# --------------------------------------------------------------------------- data


class DatasetData:
    """Adapter from jitkern.dlrm.data (preprocessed Criteo) to the trainer's batch-source protocol."""

    def __init__(self, path, split, batch_size, num_batches, *, shuffle, seed, max_ind_range):
        self.ds = load_preprocessed(path, split)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.max_ind_range = max_ind_range if max_ind_range > 0 else None
        full = math.ceil(len(self.ds) / batch_size)
        if full == 0:
            raise ValueError(f"{path}: the {split} split is empty")
        self.num_batches = min(num_batches, full) if num_batches > 0 else full
        self.num_dense = self.ds.dense.shape[1]
        self.embedding_sizes = table_sizes(self.ds, self.max_ind_range)

    def __len__(self):
        return self.num_batches

    def batches(self, epoch=0, start=0):
        it = iterate_batches(self.ds, self.batch_size, shuffle=self.shuffle, seed=self.seed + epoch,
                           max_ind_range=self.max_ind_range, drop_last=False)
        for i, b in enumerate(it):
            if i >= self.num_batches:
                return
            if i >= start:
                yield b


def build_data(args, sizes, num_dense):
    """(train, test) batch sources for the chosen --data-generation."""
    test_bs = args.test_mini_batch_size if args.test_mini_batch_size > 0 else args.mini_batch_size
    if args.data_generation == "dataset":
        if not args.processed_data_file:
            if args.raw_data_file:
                preflight.check_raw_file(args.raw_data_file)
            hint = f" --raw {args.raw_data_file}" if args.raw_data_file else " --raw FILE"
            raise ValueError("--data-generation dataset needs --processed-data-file DIR; make it with "
                             f"`python -m jitkern preprocess{hint} --out DIR`")
        common = dict(seed=args.numpy_rand_seed, max_ind_range=args.max_ind_range)
        try:
            train = DatasetData(args.processed_data_file, "train", args.mini_batch_size, args.num_batches,
                                shuffle=args.data_randomize == "total", **common)
            test = DatasetData(args.processed_data_file, "test", test_bs, args.num_test_batches,
                               shuffle=False, **common)
        except (ValueError, OSError) as e:
            raise type(e)(f"--processed-data-file: {e}") from None
        return train, test
    if args.num_batches <= 0 and not (args.data_generation == "random" and args.data_size > 0):
        raise ValueError("--num-batches must be > 0 for generated data (or give --data-size with random)")
    n_train = args.num_batches or math.ceil(args.data_size / args.mini_batch_size)
    n_test = args.num_test_batches or max(4, math.ceil(n_train * args.mini_batch_size / test_bs / 10))
    k, fixed, seed = args.num_indices_per_lookup, args.num_indices_per_lookup_fixed, args.numpy_rand_seed
    if k < 1:
        raise ValueError(f"--num-indices-per-lookup must be >= 1, got {k}")
    if args.data_generation == "random":
        # held out: the same generator on another seed (the reference reuses the training seed)
        common = dict(num_indices_per_lookup=k, fixed=fixed, round_targets=args.round_targets)
        train = RandomData(sizes, num_dense, args.mini_batch_size, n_train, seed=seed,
                           data_size=args.data_size or None, **common)
        test = RandomData(sizes, num_dense, test_bs, n_test, seed=seed + 1, **common)
        return train, test
    common = dict(num_indices_per_lookup=k, fixed=fixed, seed=seed)
    return (SyntheticData(sizes, num_dense, args.mini_batch_size, n_train, split="train", **common),
            SyntheticData(sizes, num_dense, test_bs, n_test, split="test", **common))


# --------------------------------------------------------------------------- reporting


def print_profile(timer, steps, total_seconds, log=print):
    """The --profile table: seconds, ms per training step and share of the run, per op."""
    order = ["data", "bottom_fwd", "embedding_fwd", "interaction", "top_fwd", "loss", "top_bwd",
             "bottom_bwd", "embedding_upd", "dense_upd", "communication", "evaluation"]
    names = order + sorted(set(timer.seconds) - set(order))
    rows = []
    for name in names:
        s = timer.seconds.get(name, 0.0)
        rows.append([name, f"{s:.3f}", f"{1e3 * s / max(steps, 1):.3f}", f"{100 * s / max(total_seconds, 1e-12):.1f}"])
    log("profile (forward stages include evaluation batches; communication is 0 in one process):")
    print_table(["op", "total s", "ms/step", "% of run"], rows)


def plot_curves(path, state, log=print):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if state.losses:
        steps, losses = zip(*state.losses)
        ax1.plot(steps, losses)
    ax1.set(xlabel="iteration", ylabel="training loss (BCE)", title="loss")
    evals = [e for e in state.evals if e.get("auc") is not None]
    if evals:
        ax2.plot([e["step"] for e in evals], [e["auc"] for e in evals], marker="o")
    ax2.set(xlabel="iteration", ylabel="test ROC AUC", title="AUC")
    fig.tight_layout()
    fig.savefig(path)
    log(f"wrote {path}")


# --------------------------------------------------------------------------- main


def _architecture(args):
    """(embedding sizes, bottom MLP, top MLP, train data, test data) from the flags."""
    bot = _sizes("--arch-mlp-bot", args.arch_mlp_bot)
    top = _sizes("--arch-mlp-top", args.arch_mlp_top)
    sizes = _sizes("--arch-embedding-size", args.arch_embedding_size)
    if args.data_generation != "dataset":
        return (sizes, bot, top) + build_data(args, sizes, bot[0])
    train_data, test_data = build_data(args, None, None)
    if bot[0] != train_data.num_dense:
        raise ValueError(f"--arch-mlp-bot starts with {bot[0]} but the data set has {train_data.num_dense} "
                         "dense features")
    return train_data.embedding_sizes, bot, top, train_data, test_data


def _preflight(args, comm):
    """Everything the run needs later, checked before the model is built or a kernel compiled;
    -> (embedding sizes, bottom MLP, top MLP, train data, test data)."""
    preflight.check_values(args)
    if args.threads:
        set_num_threads(args.threads)
    sizes, bot, top, train_data, test_data = _architecture(args)
    LRSchedule(args.learning_rate, args.lr_num_warmup_steps, args.lr_decay_start_step, args.lr_num_decay_steps)
    if args.load_model:
        arch = arch_dict(sizes, args.arch_sparse_feature_size, bot, top, args.arch_interaction_op,
                         args.arch_interaction_itself)
        preflight.check_load_source(args.load_model, arch)
    if args.save_model and not args.inference_only:
        preflight.check_save_target(args.save_model, sharded=comm is not None)
    if args.plot and not args.inference_only:
        preflight.check_plot_target(args.plot)
    return sizes, bot, top, train_data, test_data


def _rank_log(comm, log):
    """Under `mpiexec -n P` only rank 0 logs (and prints tables)."""
    if comm is None or comm.Get_rank() == 0:
        return log
    sys.stdout = open(os.devnull, "w")
    return lambda *a, **k: None


def _autotune(args, model, comm, log) -> None:
    """--autotune: quick-tune the model's own shapes where the DB lacks them; one line of report."""
    t0 = time.perf_counter()
    k = args.num_indices_per_lookup
    if comm is None:
        tuned = len(tune_for(model, args.mini_batch_size, pooling=k))
    else:
        tuned = tune_for_ranks(model, args.mini_batch_size, comm, pooling=k)
    db = get_config().tune_db
    if tuned:
        log(f"autotune: tuned {tuned} knob entries for this model's shapes in {time.perf_counter() - t0:.1f} s "
            f"(stored in {db})")
    else:
        log(f"autotune: every knob entry for this model's shapes was found in {db}")


def _train_options(args) -> TrainOptions:
    return TrainOptions(lr=args.learning_rate, warmup_steps=args.lr_num_warmup_steps,
                        decay_start_step=args.lr_decay_start_step, decay_steps=args.lr_num_decay_steps,
                        nepochs=args.nepochs, print_freq=args.print_freq, print_time=args.print_time,
                        test_freq=args.test_freq, save_model=args.save_model,
                        mlperf_auc_threshold=args.mlperf_auc_threshold,
                        progress={"auto": None, "on": True, "off": False}[args.progress])


def _build_model(args, sizes, bot, top, comm, log, num_batches):
    """The model (hybrid parallel under mpiexec), resumed from --load-model if given; -> (model, state)."""
    sharded = {} if comm is None else dict(
        sharding=args.sharding, rank_memory=args.rank_memory_gb * 1e9 or None, plan_batch=args.mini_batch_size,
        plan_pooling=args.num_indices_per_lookup)
    model = DLRM(sizes, args.arch_sparse_feature_size, bot, top, interaction=args.arch_interaction_op,
                 self_interaction=args.arch_interaction_itself, embedding_precision=args.embedding_precision,
                 seed=args.numpy_rand_seed, comm=comm, **sharded)
    if comm is not None:
        log(model.describe())
    log(f"{model}: {model.parameter_bytes() / 2**20:.1f} MiB of parameters, {args.data_generation} data, "
        f"{num_batches} batches of {args.mini_batch_size} per epoch")
    state = None
    if args.load_model:
        state = state_from_meta(load_checkpoint(args.load_model, model))
        log(f"resumed from {args.load_model} at iteration {state.step}")
    return model, state


def _train_and_report(args, trainer, t_start, log) -> None:
    """Run the training loop, then print the summary line, the profile and the plot as asked."""
    steps0, samples0, secs0 = trainer.state.step, trainer.state.samples, trainer.state.train_seconds
    state = trainer.run()
    wall = time.perf_counter() - t_start
    steps, samples = state.step - steps0, state.samples - samples0
    secs = state.train_seconds - secs0
    final = state.evals[-1]
    log(f"done: {steps} iterations, {samples} samples in {secs:.2f} s of training "
        f"({samples / max(secs, 1e-12):,.0f} samples/s, {1e3 * secs / max(steps, 1):.2f} ms/it); "
        f"test loss {final['loss']:.5f}, AUC {final['auc']:.4f}, accuracy {100 * final['accuracy']:.2f} %; "
        f"wall {wall:.1f} s")
    if trainer.timer is not None:
        print_profile(trainer.timer, steps, wall, log)
    if args.plot:
        plot_curves(args.plot, state, log)


def run(args, log=print) -> int:
    comm = comm_from_env()                           # under `mpiexec -n P`: hybrid parallel
    log = _rank_log(comm, log)
    sizes, bot, top, train_data, test_data = preflight.collective(comm, lambda: _preflight(args, comm))
    t_start = time.perf_counter()
    model, state = _build_model(args, sizes, bot, top, comm, log, len(train_data))
    if args.autotune:
        _autotune(args, model, comm, log)
    timer = StageTimer() if args.profile else None
    if timer is not None:
        model.timer = timer
    trainer = Trainer(model, train_data, test_data, _train_options(args), log=log, state=state, timer=timer)
    if args.inference_only:
        trainer.evaluate()
    else:
        _train_and_report(args, trainer, t_start, log)
    return 0


def _interrupted(e: Interrupted) -> int:
    """The one line an interrupt prints (on stderr; once when the ranks agreed on the step)."""
    if e.step is None:
        write_lines(f"interrupted ({e}) outside training; no checkpoint written on the way out")
    elif launch_rank() in (None, 0):
        saved = f"checkpoint saved to {e.saved}" if e.saved else "checkpoint not saved (no --save-model)"
        write_lines(f"interrupted ({e}) at iteration {e.step}; {saved}")
    return e.exit_code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sleep_idle_workers()                             # before the first parallel kernel starts the thread pool
    with raising_signals():                          # SIGTERM unwinds as Ctrl-C does
        try:
            return run(args)
        except Interrupted as e:
            return _interrupted(e)
        except preflight.CHECK_ERRORS as e:
            if debug_level():
                raise
            write_lines(f"{PROG}: error: {preflight.message(e)}")
            return 2


if __name__ == "__main__":
    sys.exit(main())
