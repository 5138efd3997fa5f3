"""The trainer's flags in one place: dlrm_s_pytorch.py's 76 (facebookresearch/dlrm at 090956e),
with its meanings, and jitkern's own. cli.py runs what they ask.

Defaults are jitkern's (a small synthetic run that learns); REFERENCE_DEFAULTS holds the
reference's, which `--reference-defaults` applies all at once (flags given still win). The
reference's `type=bool` flags take a value here too (`--round-targets=True`) but read it as
written: "False" and "0" are false (the reference's type=bool reads any non-empty text as true),
and alone they are switches (`--round-targets`). A flag that cannot apply is accepted by the
parser and refused by `refusals` with one line naming it and why. Values are checked where they
are used (cli.py), so that every bad value is one line naming its flag.
"""
from __future__ import annotations

import argparse
import sys

from .torchrec_flags import FlagError, translate

PROG = "dlrm"

# dest -> the reference's default, for every one of its flags whose jitkern default differs
REFERENCE_DEFAULTS = {
    "arch_sparse_feature_size": 2, "arch_embedding_size": "4-3-2", "arch_mlp_bot": "4-3-2",
    "arch_mlp_top": "4-2-1", "loss_function": "mse", "data_size": 1, "num_batches": 0,
    "data_generation": "random", "num_indices_per_lookup": 10, "mini_batch_size": 1,
    "learning_rate": 0.01, "print_freq": 1, "test_freq": -1,
}
BOOLEAN_FLAGS = ("--round-targets", "--data-trace-enable-padding", "--num-indices-per-lookup-fixed",
                 "--sync-dense-params")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def boolean(text) -> bool:
    """A type=bool flag's value: True/False/1/0 (any case; yes/no, on/off too), as written."""
    t = str(text).strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"must be True or False (1 or 0), got {text!r}")


def _switch(group, flag, default, help_):
    """A reference type=bool flag: a switch alone, or =True/False/1/0."""
    group.add_argument(flag, type=boolean, nargs="?", const=True, default=default, metavar="BOOL", help=help_)


def _model_flags(p):
    a = p.add_argument_group("model")
    a.add_argument("--arch-sparse-feature-size", type=int, default=16, help="embedding dim D")
    a.add_argument("--arch-embedding-size", default="10-20-40-80-160-320-640-1280",
                   help="rows per table, dash-separated (ignored with --data-generation dataset)")
    a.add_argument("--arch-mlp-bot", default="13-64-16", help="bottom MLP: n_dense-...-D")
    a.add_argument("--arch-mlp-top", default="64-32-1", help="top MLP without its input width: ...-1")
    a.add_argument("--arch-interaction-op", choices=("dot", "cat", "dcn"), default="dot",
                   help="dcn: DLRM-DCNv2's low-rank cross network over [bottom output, pooled embeddings]")
    a.add_argument("--arch-interaction-itself", action="store_true", default=False)
    a.add_argument("--dcn-num-layers", type=int, default=3, help="dcn: cross layers")
    a.add_argument("--dcn-low-rank-dim", type=int, default=512, help="dcn: rank of each cross layer's weight")
    a.add_argument("--activation-function", choices=("relu", "sigmoid"), default="relu",
                   help="hidden layers of both MLPs (the reference parses it but always uses relu)")
    a.add_argument("--weighted-pooling", choices=("fixed", "learned"), default=None,
                   help="per-row pooling weights (start at 1): fixed, or learned by the optimizer")
    a.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="MLPs and interaction; bf16: bf16 GEMMs on Split-SGD weights, fp32 accumulation, "
                        "updates and loss")
    a.add_argument("--embedding-precision", choices=("fp32", "bf16"), default=None,
                   help="tables (default: --precision); bf16: Split-SGD tables (bf16 lookups, exact fp32 updates)")
    t = p.add_argument_group("embedding tricks (the reference's tricks/)")
    t.add_argument("--qr-flag", action="store_true", default=False,
                   help="quotient-remainder tables for tables with more rows than --qr-threshold")
    t.add_argument("--qr-threshold", type=int, default=200)
    t.add_argument("--qr-operation", choices=("mult", "add", "concat"), default="mult")
    t.add_argument("--qr-collisions", type=int, default=4, help="remainder table rows")
    t.add_argument("--md-flag", action="store_true", default=False,
                   help="mixed dimensions: smaller widths for larger tables, projected to D")
    t.add_argument("--md-threshold", type=int, default=200, help="tables up to this many rows keep width D")
    t.add_argument("--md-temperature", type=float, default=0.3, help="alpha of the power-law width rule")
    t.add_argument("--md-round-dims", action="store_true", default=False, help="round widths to powers of 2")


def _loss_flags(p):
    a = p.add_argument_group("loss and optimizer")
    a.add_argument("--loss-function", choices=("mse", "bce", "wbce"), default=None,
                   help="the reference's, on the float32 probabilities as torch computes them (bce: "
                        "torch's BCELoss, logs clamped at -100); not given: BCE from the logits (finite for any logit)")
    a.add_argument("--loss-weights", default="1.0-1.0",
                   help="wbce: weights of labels 0 and 1, w0-w1")
    a.add_argument("--loss-threshold", type=float, default=0.0,
                   help="clamp probabilities to [t, 1 - t] before the loss (0: off)")
    a.add_argument("--optimizer", choices=("sgd", "adagrad", "rwsadagrad"), default="sgd",
                   help="adagrad: torch.optim.Adagrad's on every parameter (element-wise on tables); "
                        "rwsadagrad: row-wise Adagrad on tables, Adagrad on the MLPs")
    a.add_argument("--eps", type=float, default=None,
                   help="Adagrad's epsilon (default: torch.optim.Adagrad's 1e-10; dlrm_main.py's is 1e-8)")
    a.add_argument("--mini-batch-size", type=int, default=256)
    a.add_argument("--num-batches", type=int, default=1000, help="batches per epoch (0: the whole data set)")
    a.add_argument("--nepochs", type=int, default=1)
    a.add_argument("--learning-rate", type=float, default=0.5)
    a.add_argument("--lr-num-warmup-steps", type=int, default=0)
    a.add_argument("--lr-decay-start-step", type=int, default=0)
    a.add_argument("--lr-num-decay-steps", type=int, default=0)
    a.add_argument("--numpy-rand-seed", type=int, default=123)
    _switch(a, "--sync-dense-params", True, "accepted; MLP replicas are always in sync (gradients allreduced each step)")


def _data_flags(p):
    d = p.add_argument_group("data")
    d.add_argument("--data-generation", choices=("random", "synthetic", "dataset", "internal"), default="synthetic",
                   help="random: the reference's generator; synthetic: learnable (hidden teacher); "
                        "dataset: Criteo data; internal: Meta's loader (not available)")
    d.add_argument("--num-indices-per-lookup", type=int, default=1)
    d.add_argument("--multi-hot-sizes", default="",
                   help="fixed lookups per table, dash- or comma-separated (random/synthetic data; on Criteo "
                        "one-hot data, MLPerf's one-hot -> multi-hot expansion)")
    d.add_argument("--multi-hot-distribution-type", choices=("uniform", "pareto"), default="uniform",
                   help="how the multi-hot ids beyond the first are drawn")
    _switch(d, "--num-indices-per-lookup-fixed", False, "every bag has exactly --num-indices-per-lookup ids")
    _switch(d, "--round-targets", False, "random: 0/1 labels")
    d.add_argument("--data-size", type=int, default=0, help="random: samples per epoch (0: batches x batch size)")
    d.add_argument("--rand-data-dist", choices=("uniform", "gaussian"), default="uniform",
                   help="random: ids uniform over each table, or gaussian (clipped to [min, max])")
    d.add_argument("--rand-data-min", type=float, default=0)
    d.add_argument("--rand-data-max", type=float, default=1)
    d.add_argument("--rand-data-mu", type=float, default=-1, help="(-1: (min + max) / 2)")
    d.add_argument("--rand-data-sigma", type=float, default=1)
    d.add_argument("--data-trace-file", default="./input/dist_emb_j.log",
                   help="unused (as in the reference: its trace-driven generation is not selectable)")
    _switch(d, "--data-trace-enable-padding", False, "unused (as --data-trace-file)")
    d.add_argument("--data-set", choices=("kaggle", "terabyte"), default="kaggle")
    d.add_argument("--raw-data-file", default="",
                   help="raw Criteo log (kaggle: train.txt; terabyte: the prefix of day_0 .. day_23)")
    d.add_argument("--processed-data-file", default="",
                   help="the reference's processed .npz, a jitkern preprocessed dir, MLPerf .bin or TorchRec "
                        "dir; when missing, the raw file is preprocessed on first use")
    d.add_argument("--data-randomize", choices=("total", "day", "none"), default="total")
    d.add_argument("--max-ind-range", type=int, default=-1, help="dataset: ids modulo this many rows")
    d.add_argument("--data-sub-sample-rate", type=float, default=0.0,
                   help="dataset: drop this share of the negative samples, in [0, 1]")
    d.add_argument("--memory-map", action="store_true", default=False,
                   help="dataset: read the reference's per-day *_reordered.npz files")
    d.add_argument("--dataset-multiprocessing", action="store_true", default=False,
                   help="accepted; preprocessing streams the raw file through one compiled parser")
    d.add_argument("--mlperf-bin-loader", action="store_true", default=False,
                   help="dataset: read MLPerf PREFIX_{train,test}.bin beside --processed-data-file")
    d.add_argument("--mlperf-bin-shuffle", action="store_true", default=False, help="shuffle the .bin batches")
    d.add_argument("--num-workers", type=int, default=0, help="threads preparing training batches ahead")
    d.add_argument("--test-num-workers", type=int, default=-1, help="threads preparing test batches (-1: --num-workers)")


def _run_flags(p):
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--test-freq", type=int, default=250,
                   help="evaluate before training and every N iterations (-1: only at the end)")
    e.add_argument("--test-mini-batch-size", type=int, default=-1, help="(-1: --mini-batch-size)")
    e.add_argument("--num-test-batches", type=int, default=0, help="held-out batches (0: a tenth, at least 4)")
    e.add_argument("--print-freq", type=int, default=250)
    e.add_argument("--print-time", action="store_true", default=False)
    e.add_argument("--print-wall-time", action="store_true", default=False, help="append (HH:MM) to loss lines")
    e.add_argument("--print-precision", type=int, default=5, help="digits of arrays printed by --debug-mode")
    e.add_argument("--debug-mode", action="store_true", default=False,
                   help="print the architecture, the first batch and the parameters before and after")
    e.add_argument("--save-model", default="", help="checkpoint file, written at every test and at the end")
    e.add_argument("--load-model", default="", help="resume from this checkpoint")
    e.add_argument("--inference-only", action="store_true", default=False, help="evaluate only")
    e.add_argument("--quantize-emb-with-bit", type=int, default=32,
                   help="with --inference-only: 4 or 8-bit row-wise quantized tables (32: off)")
    e.add_argument("--quantize-mlp-with-bit", type=int, default=32, help="32 only (see --embedding-precision)")
    e.add_argument("--mlperf-logging", action="store_true", default=False,
                   help="MLPerf :::MLLOG lines (needs the mlperf-logging package)")
    e.add_argument("--mlperf-acc-threshold", type=float, default=0.0, help="stop once test accuracy exceeds it")
    e.add_argument("--mlperf-auc-threshold", type=float, default=0.0, help="stop once test AUC reaches it")
    e.add_argument("--mlperf-grad-accum-iter", type=int, default=1,
                   help="with --mlperf-logging: one update per N batches (gradients summed)")
    e.add_argument("--tensor-board-filename", default="",
                   help="write TensorBoard event files to ./NAME (needs tensorboardX)")
    e.add_argument("--enable-profiling", action="store_true", default=False, help="as --profile")
    e.add_argument("--profile", action="store_true", default=False, help="print a per-op time table at the end")
    e.add_argument("--plot", default="", metavar="FILE.png", help="loss and AUC curves (needs matplotlib)")
    e.add_argument("--progress", choices=("auto", "on", "off"), default="auto", help="tqdm progress bar")


def _machine_flags(p):
    m = p.add_argument_group("machine")
    m.add_argument("--threads", type=int, default=0, help="kernel threads (0: numba's default)")
    m.add_argument("--autotune", action="store_true", default=False,
                   help="before training, tune the kernels for this model's shapes where the tuning DB "
                        "has no entry yet (stored: later runs time nothing)")
    m.add_argument("--dist-backend", default="", help="'' or mpi: many ranks run under mpiexec")
    m.add_argument("--local_rank", type=int, default=-1, help="ignored (MPI gives each rank its place)")
    m.add_argument("--use-gpu", action="store_true", default=False, help="not supported (CPU only)")
    m.add_argument("--save-onnx", action="store_true", default=False, help="not supported")
    m.add_argument("--plot-compute-graph", action="store_true", default=False, help="not supported")
    m.add_argument("--reference-defaults", action="store_true", default=False,
                   help="every flag not given takes dlrm_s_pytorch.py's default instead of jitkern's")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Train a DLRM with jitkern's kernels "
                                "(flags as dlrm_s_pytorch.py's; the defaults are a small synthetic run).")
    for add in (_model_flags, _loss_flags, _data_flags, _run_flags, _machine_flags, _add_rank_flags):
        add(p)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; with --reference-defaults, those not given take the reference's defaults."""
    p = build_parser()
    try:
        argv, notes = translate(sys.argv[1:] if argv is None else argv)
    except FlagError as e:
        p.error(str(e))
    if p.parse_known_args(argv)[0].reference_defaults:
        p.set_defaults(**REFERENCE_DEFAULTS)
    args = p.parse_args(argv)
    args.translation_notes = notes
    if args.test_num_workers < 0:
        args.test_num_workers = args.num_workers
    args.profile = args.profile or args.enable_profiling
    return args


# --------------------------------------------------------------------------- flags that cannot apply

_NOT_HERE = {
    "use_gpu": "--use-gpu: jitkern trains on the CPU (its kernels are generated for this CPU); there is no GPU path",
    "save_onnx": "--save-onnx: ONNX export is not supported (the model is NumPy arrays: DLRM.state_dict() "
                 "gives them in torch's layouts)",
    "plot_compute_graph": "--plot-compute-graph: not supported (the reference itself exits on it, asking for "
                          "pytorchviz); --profile prints the time per op",
}


def refusals(args) -> list:
    """One line per flag value that cannot apply here (empty: all can), each naming its flag."""
    out = [msg for dest, msg in _NOT_HERE.items() if getattr(args, dest)]
    if args.dist_backend not in ("", "mpi"):
        out.append(f"--dist-backend {args.dist_backend}: jitkern's ranks talk MPI (run under mpiexec -n P, "
                   "--dist-backend mpi or none); gloo, nccl and ccl are torch.distributed's")
    if args.data_generation == "internal":
        out.append("--data-generation internal: Meta's internal data loader is not available (nor is it "
                   "outside Meta for the reference); use random, synthetic or dataset")
    if args.quantize_mlp_with_bit != 32:
        out.append(f"--quantize-mlp-with-bit {args.quantize_mlp_with_bit}: dynamic int8/fp16 MLP quantization "
                   "is not supported; jitkern's reduced precision is bf16 (--precision bf16, "
                   "--embedding-precision bf16)")
    out.extend(_trick_refusals(args))
    return out


def _trick_refusals(args) -> list:
    out = []
    q = args.quantize_emb_with_bit
    if q not in (4, 8, 32):
        out.append(f"--quantize-emb-with-bit must be 4, 8 or 32 (off), got {q}")
    elif q != 32 and not args.inference_only:
        out.append(f"--quantize-emb-with-bit {q}: quantized tables are for --inference-only (training updates "
                   "fp32 tables; the reference ignores the flag when training)")
    for flag, on in (("--qr-flag", args.qr_flag), ("--md-flag", args.md_flag)):
        if on and args.weighted_pooling is not None:
            out.append(f"{flag} with --weighted-pooling is not supported (as in the reference)")
        if on and q != 32:
            out.append(f"{flag} with --quantize-emb-with-bit {q} is not supported (as in the reference)")
    if args.qr_flag and args.md_flag:
        out.append("--qr-flag with --md-flag is not supported (the reference gives its QR tables the "
                   "mixed-dimension list as their width); give one of them")
    return out


def notes(args, under_mpi: bool) -> list:
    """Lines the run prints about flags it accepts but that change nothing here."""
    out = list(getattr(args, "translation_notes", ()))
    if args.local_rank != -1:
        out.append(f"note: --local_rank {args.local_rank} ignored: " +
                   ("MPI gives each rank its place" if under_mpi else "one process (run under mpiexec for many)"))
    if args.sync_dense_params is False:
        out.append("note: --sync-dense-params False ignored: the MLP replicas are kept in sync by the gradient "
                   "allreduce every step")
    return out
