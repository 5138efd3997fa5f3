"""The DLRM trainer's runner: what the flags (flags.py: dlrm_s_pytorch.py's, and jitkern's own)
ask, from the checks before any work to the report at the end (under mpiexec, --sharding
and --rank-memory-gb place the tables). Entry points:
`python examples/dlrm_numba.py` and `python -m jitkern train`.

With no flags it trains a small model on learnable synthetic data for a few seconds.
"""
from __future__ import annotations

import os
import sys
import time

import numba
import numpy as np

from .. import set_num_threads
from ..config import debug_level, get_config, sleep_idle_workers
from ..report import print_table
from . import preflight
from .autotune import tune_for, tune_for_ranks
from .flags import PROG, build_parser, notes, parse_args, refusals  # noqa: F401  (build_parser: cli's API)
from .interrupt import Interrupted, raising_signals
from .launch import comm_from_env, launch_rank, write_lines
from .model import DLRM, StageTimer, arch_extras
from .optimizers import describe, make_optimizers
from .runlog import MLPerfLog, TensorBoardLog, require
from .sources import build_dataset, build_generated, prefetched
from .tables import QR, md_solver
from .checkpoint import arch_dict, load_checkpoint
from .train import LRSchedule, TrainOptions, Trainer, state_from_meta



def _sizes(flag, text):
    try:
        sizes = [int(v) for v in text.split("-")]
    except ValueError:
        raise ValueError(f"{flag} must be dash-separated integers such as 13-512-256-64, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag} sizes must be >= 1, got {text!r}")
    return sizes


def build_data(args, sizes, num_dense, rs, log=print):
    """(train, test) batch sources for the chosen --data-generation (rs: the run's NumPy stream)."""
    test_bs = args.test_mini_batch_size if args.test_mini_batch_size > 0 else args.mini_batch_size
    if args.data_generation == "dataset":
        train, test = build_dataset(args, test_bs, rs, log)
    else:
        train, test = build_generated(args, sizes, num_dense, test_bs)
    return prefetched(train, args.num_workers), prefetched(test, args.test_num_workers)


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


def _architecture(args, rs, log):
    """(embedding sizes, bottom MLP, top MLP, train data, test data) from the flags."""
    bot = _sizes("--arch-mlp-bot", args.arch_mlp_bot)
    top = _sizes("--arch-mlp-top", args.arch_mlp_top)
    sizes = _sizes("--arch-embedding-size", args.arch_embedding_size)
    if args.data_generation != "dataset":
        return (sizes, bot, top) + build_data(args, sizes, bot[0], rs, log)
    train_data, test_data = build_data(args, None, None, rs, log)
    if bot[0] != train_data.num_dense:
        raise ValueError(f"--arch-mlp-bot starts with {bot[0]} but the data set has {train_data.num_dense} "
                         "dense features")
    return train_data.embedding_sizes, bot, top, train_data, test_data


def model_options(args, sizes) -> dict:
    """DLRM keyword arguments for the reference's model flags."""
    loss = {None: "bce", "bce": "bce_prob"}.get(args.loss_function, args.loss_function)
    opts = dict(optimizer=args.optimizer, loss=loss, activation=args.activation_function,
                weighted_pooling=args.weighted_pooling,
                loss_threshold=args.loss_threshold if 0.0 < args.loss_threshold < 1.0 else 0.0)  # else off, as the reference
    if args.eps is not None:
        opts["eps"] = args.eps
    if args.arch_interaction_op == "dcn":
        opts.update(dcn_layers=args.dcn_num_layers, dcn_rank=args.dcn_low_rank_dim)
    if args.loss_function == "wbce":
        try:
            weights = [float(v) for v in args.loss_weights.split("-")]
        except ValueError:
            weights = []
        if len(weights) != 2:
            raise preflight.PreflightError(f"--loss-weights takes the weights of labels 0 and 1 (w0-w1), got "
                                           f"{args.loss_weights!r}")
        opts["loss_weights"] = weights
    if args.qr_flag:
        if args.qr_collisions < 1:
            raise preflight.PreflightError(f"--qr-collisions must be >= 1, got {args.qr_collisions}")
        opts["qr"] = QR(args.qr_threshold, args.qr_collisions, args.qr_operation)
    if args.md_flag:
        dims = md_solver(sizes, args.md_temperature, args.arch_sparse_feature_size, args.md_round_dims)
        if max(dims) != args.arch_sparse_feature_size:
            raise preflight.PreflightError(f"--md-flag: the widest table gets {max(dims)} with --md-round-dims, not "
                                           f"--arch-sparse-feature-size {args.arch_sparse_feature_size}")
        opts["md_dims"] = [d if n > args.md_threshold else None for d, n in zip(dims, sizes)]
    return opts


def _one_process_only(args) -> None:
    """The reference's options the hybrid-parallel model does not train (yet): named, one line."""
    for flag, on in (("--qr-flag", args.qr_flag), ("--md-flag", args.md_flag),
                     (f"--weighted-pooling {args.weighted_pooling}", args.weighted_pooling),
                     (f"--quantize-emb-with-bit {args.quantize_emb_with_bit}", args.quantize_emb_with_bit != 32)):
        if on:
            raise preflight.PreflightError(f"{flag}: runs in one process only; under mpiexec the tables train "
                                           "as plain tables (by any --optimizer)")


def _arch(args, sizes, bot, top, opts) -> dict:
    """The checkpoint architecture this run's model has (what --load-model must match)."""
    dense, table = make_optimizers(opts["optimizer"])
    return arch_dict(sizes, args.arch_sparse_feature_size, bot, top, args.arch_interaction_op,
                     args.arch_interaction_itself,
                     **arch_extras(optimizer=describe(dense, table), weighted_pooling=opts["weighted_pooling"],
                                   qr=opts.get("qr"), md_dims=opts.get("md_dims"),
                                   dcn=(opts["dcn_layers"], opts["dcn_rank"]) if "dcn_layers" in opts else None))


def _preflight(args, comm, log):
    """Everything the run needs later, checked before the model is built or a kernel compiled;
    -> (embedding sizes, bottom MLP, top MLP, train data, test data, model options, NumPy stream)."""
    refused = refusals(args)
    if refused:
        raise preflight.PreflightError(refused[0])
    preflight.check_values(args)
    if args.threads:
        set_num_threads(args.threads)
    if args.mlperf_logging:
        require("mlperf_logging.mllog", "--mlperf-logging", "mlperf-logging")
    if args.tensor_board_filename:
        require("tensorboardX", "--tensor-board-filename", "tensorboardX")
    rs = np.random.RandomState(args.numpy_rand_seed)   # data permutations, then the model's init (as the reference)
    sizes, bot, top, train_data, test_data = _architecture(args, rs, log)
    opts = model_options(args, sizes)
    if comm is not None:
        _one_process_only(args)
    LRSchedule(args.learning_rate, args.lr_num_warmup_steps, args.lr_decay_start_step, args.lr_num_decay_steps)
    if args.load_model:
        preflight.check_load_source(args.load_model, _arch(args, sizes, bot, top, opts))
    if args.save_model and not args.inference_only:
        preflight.check_save_target(args.save_model, sharded=comm is not None)
    if args.plot and not args.inference_only:
        preflight.check_plot_target(args.plot)
    return sizes, bot, top, train_data, test_data, opts, rs


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


def _train_options(args, hooks=()) -> TrainOptions:
    return TrainOptions(lr=args.learning_rate, warmup_steps=args.lr_num_warmup_steps,
                        decay_start_step=args.lr_decay_start_step, decay_steps=args.lr_num_decay_steps,
                        nepochs=args.nepochs, print_freq=args.print_freq, print_time=args.print_time,
                        test_freq=args.test_freq, save_model=args.save_model,
                        mlperf_auc_threshold=args.mlperf_auc_threshold,
                        mlperf_acc_threshold=args.mlperf_acc_threshold, print_wall_time=args.print_wall_time,
                        grad_accum=args.mlperf_grad_accum_iter if args.mlperf_logging else 1,
                        progress={"auto": None, "on": True, "off": False}[args.progress], hooks=tuple(hooks))


def _build_model(args, setup, comm, log, num_batches):
    """The model (hybrid parallel under mpiexec), resumed from --load-model if given; -> (model, state)."""
    sizes, bot, top, _, _, opts, rs = setup
    sharded = {} if comm is None else dict(
        sharding=args.sharding, rank_memory=args.rank_memory_gb * 1e9 or None, plan_batch=args.mini_batch_size,
        plan_pooling=args.num_indices_per_lookup)
    model = DLRM(sizes, args.arch_sparse_feature_size, bot, top, interaction=args.arch_interaction_op,
                 self_interaction=args.arch_interaction_itself, embedding_precision=args.embedding_precision,
                 precision=args.precision, seed=args.numpy_rand_seed, comm=comm, init_stream=rs, **opts, **sharded)
    if comm is not None:
        log(model.describe())
    log(f"{model}: {model.parameter_bytes() / 2**20:.1f} MiB of parameters, {args.data_generation} data, "
        f"{num_batches} batches of {args.mini_batch_size} per epoch")
    state = None
    if args.load_model:
        state = state_from_meta(load_checkpoint(args.load_model, model))
        log(f"resumed from {args.load_model} at iteration {state.step}")
    if args.inference_only and args.quantize_emb_with_bit != 32:
        model.quantize_tables(args.quantize_emb_with_bit)
        log(f"tables quantized row-wise to {args.quantize_emb_with_bit} bits: "
            f"{model.parameter_bytes() / 2**20:.1f} MiB of parameters")
    return model, state


def _debug_print(args, model, train_data, log, when):
    """--debug-mode: the architecture and the training batches before training, the parameters
    before and after (arrays with --print-precision digits), as the reference prints them."""
    with np.printoptions(precision=args.print_precision):
        if when == "before":
            log(f"model arch: mlp top {model.top_mlp}, mlp bot {model.bottom_mlp}, "
                f"{model.top_mlp[0] - model.feature_dim if model.interaction == 'dot' else 0} interactions, "
                f"{model.num_tables} tables of {model.embedding_sizes} rows, sparse feature size {model.embedding_dim}")
            for j, b in enumerate(train_data.batches(0)):
                log(f"mini-batch: {j}\n{b.dense}\n{np.diff(np.append(b.offsets, [[len(i)] for i in b.indices], 1))}\n"
                    f"{b.indices}\n{b.labels}")
        log(f"{'initial' if when == 'before' else 'updated'} parameters (weights and bias):")
        for name, a in model.state_dict().items():
            log(f"{name}\n{a}")


def _hooks(args, n_train):
    hooks = []
    if args.mlperf_logging:
        hooks.append(MLPerfLog(n_train))
    if args.tensor_board_filename:
        hooks.append(TensorBoardLog(args.tensor_board_filename, n_train))
    return hooks


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
    for line in notes(args, comm is not None):
        log(line)
    hooks = _hooks(args, 0)[:1] if args.mlperf_logging else []      # MLPerf's INIT_START comes first
    setup = preflight.collective(comm, lambda: _preflight(args, comm, log))
    train_data, test_data = setup[3], setup[4]
    t_start = time.perf_counter()
    model, state = _build_model(args, setup, comm, log, len(train_data))
    if args.autotune:
        _autotune(args, model, comm, log)
    timer = StageTimer() if args.profile else None
    if timer is not None:
        model.timer = timer
    if args.mlperf_logging:
        hooks[0].nbatches = len(train_data)
        hooks[0].run_start(args)
    hooks += _hooks(args, len(train_data))[len(hooks):]
    trainer = Trainer(model, train_data, test_data, _train_options(args, hooks), log=log, state=state, timer=timer)
    status = "aborted"
    try:
        if args.debug_mode:
            _debug_print(args, model, train_data, log, "before")
        if args.inference_only:
            trainer.evaluate()
        else:
            _train_and_report(args, trainer, t_start, log)
            if args.debug_mode:
                _debug_print(args, model, train_data, log, "after")
        status = "success"
    finally:
        for h in hooks:
            h.close(status)
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
    args = parse_args(argv)
    sleep_idle_workers()                             # before the first parallel kernel starts the thread pool
    threads = numba.get_num_threads()                # --threads is this run's: a caller's setting comes back
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
        finally:
            numba.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
