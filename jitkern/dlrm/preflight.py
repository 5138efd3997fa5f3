"""Checks the trainer runs before it builds the model, compiles a kernel or takes a step: what it
will need later (the checkpoint's location, the plot's, the data, the checkpoint to resume) and
values that make no sense, so that a bad run fails in seconds naming the flag, not after its work.

Under mpiexec the checks are collective (`collective`): when they fail on any rank, every rank
fails with them, instead of the others training on and waiting for it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .data.raw import iter_chunks, parse_chunk
from .dist_checkpoint import MANIFEST
from .checkpoint import is_checkpoint_file, read_checkpoint_header

# the errors a check raises (and the CLI reports as one line)
CHECK_ERRORS = (ValueError, IndexError, TypeError, KeyError, NotImplementedError, OSError)
RAW_PROBE_BYTES = 1 << 16        # the start of a raw file parsed up front


class PreflightError(ValueError):
    """A flag's value that the run could not use: names the flag."""


def message(e: BaseException) -> str:
    """An error's one-line text (a KeyError's without the repr quotes)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def collective(comm, check):
    """check() on every rank -> its result; when it raises on any rank, every rank raises: its own
    error, or a PreflightError naming the first rank that failed. One process: check()."""
    if comm is None:
        return check()
    try:
        result, err = check(), None
    except CHECK_ERRORS as e:
        result, err = None, e
    failed = [(r, m) for r, m in enumerate(comm.allgather(None if err is None else message(err))) if m]
    if not failed:
        return result
    if err is not None:
        raise err
    rank, msg = failed[0]
    raise PreflightError(f"rank {rank}: {msg}")


def _at_least(flag, value, low, allowed=()):
    if value < low and value not in allowed:
        also = "".join(f" (or {a})" for a in allowed)
        raise PreflightError(f"{flag} must be >= {low}{also}, got {value}")


def check_values(args) -> None:
    """Flag values that make no sense on their own (ranges), named."""
    _at_least("--threads", args.threads, 0)
    _at_least("--mini-batch-size", args.mini_batch_size, 1)
    _at_least("--nepochs", args.nepochs, 1)
    _at_least("--num-batches", args.num_batches, 0)
    _at_least("--num-test-batches", args.num_test_batches, 0)
    _at_least("--test-mini-batch-size", args.test_mini_batch_size, 1, allowed=(-1,))
    _at_least("--data-size", args.data_size, 0)
    if args.max_ind_range != -1 and args.max_ind_range < 2:
        raise PreflightError(f"--max-ind-range must be -1 (off) or >= 2 rows per table, got {args.max_ind_range}")
    if not 0 <= args.mlperf_auc_threshold <= 1:
        raise PreflightError(f"--mlperf-auc-threshold must be in [0, 1], got {args.mlperf_auc_threshold}")
    if args.arch_interaction_op == "dcn":
        _at_least("--dcn-num-layers", args.dcn_num_layers, 1)
        _at_least("--dcn-low-rank-dim", args.dcn_low_rank_dim, 1)
    if args.eps is not None and not 0 <= args.eps < float("inf"):
        raise PreflightError(f"--eps must be finite and >= 0, got {args.eps}")


def _is_sharded_dir(path: Path) -> bool:
    """A directory holding nothing but a sharded checkpoint (or what an unfinished save left)."""
    return all(n == MANIFEST or n.startswith((f"{MANIFEST}.tmp", "gen-")) for n in os.listdir(path))


def _check_save_kind(flag, p: Path, sharded: bool) -> None:
    if p.is_dir():
        if not sharded:
            raise PreflightError(f"{flag} {p}: is a directory; one process writes a checkpoint file there")
        if not _is_sharded_dir(p):
            raise PreflightError(f"{flag} {p}: is a directory that holds other files than a sharded "
                                 f"checkpoint; not writing into it")
    elif p.exists() or p.is_symlink():
        if sharded:
            raise PreflightError(f"{flag} {p}: is a file; under mpiexec the checkpoint is a directory of "
                                 "shards: give a new path")
        if not is_checkpoint_file(p):
            raise PreflightError(f"{flag} {p}: exists and is not a jitkern DLRM checkpoint; not overwriting it")


def _check_writable(flag, path, where: Path) -> None:
    """Create `where` (and its parents) if missing; fail unless a new file can be made in it."""
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PreflightError(f"{flag} {path}: cannot create its directory {where}: {e.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".jitkern-preflight-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(f"{flag} {path}: cannot write in {where}: {e.strerror}") from None


def check_save_target(path, *, sharded: bool, flag: str = "--save-model") -> None:
    """Where checkpoints go: an existing path must be the kind this run writes (a file in one
    process, a directory of shards under MPI); missing parent directories are created; the
    location must take new files."""
    p = Path(path)
    _check_save_kind(flag, p, sharded)
    _check_writable(flag, path, p if p.is_dir() else p.absolute().parent)


def check_plot_target(path, flag: str = "--plot") -> None:
    """The plot: matplotlib importable, and the file writable (its directory created if missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PreflightError(f"{flag} {path}: matplotlib is not installed (pip install matplotlib)") from None
    p = Path(path)
    if p.is_dir():
        raise PreflightError(f"{flag} {path}: is a directory; give a file name such as curves.png")
    _check_writable(flag, path, p.absolute().parent)
    if p.exists() and not os.access(p, os.W_OK):
        raise PreflightError(f"{flag} {path}: not writable")


def check_raw_file(path, flag: str = "--raw-data-file") -> None:
    """A raw Criteo log to be preprocessed: present, and its first lines (up to 64 KiB) parse."""
    try:
        chunks = iter_chunks(path, RAW_PROBE_BYTES)
        buf, first, _ = next(chunks, (None, 1, 0))
        chunks.close()
    except (FileNotFoundError, ValueError) as e:
        raise PreflightError(f"{flag}: {e}") from None
    if buf is not None:
        try:
            parse_chunk(buf, path=path, first_line=first)
        except ValueError as e:
            raise PreflightError(f"{flag}: {e}") from None


def check_load_source(path, arch: dict, flag: str = "--load-model") -> None:
    """The checkpoint to resume: a complete jitkern checkpoint (file or sharded directory) for
    this architecture (its arrays' checksums are verified when it is loaded)."""
    try:
        header = read_checkpoint_header(path)
    except ValueError as e:
        raise PreflightError(f"{flag}: {e}") from None
    if header.get("arch") != arch:
        theirs = header.get("arch") if isinstance(header.get("arch"), dict) else {}
        diff = [k for k in {**theirs, **arch} if theirs.get(k) != arch.get(k)]
        raise PreflightError(f"{flag} {path}: checkpoint is for another architecture (differs in "
                             f"{', '.join(diff) or 'its keys'})")
