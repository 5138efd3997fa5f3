"""How the ranks of a DLRM job start and end: the communicator from mpiexec's environment, and
fault handling (a failing rank ends every rank promptly, non-zero, named).

mpi4py is imported only when the launcher's environment says there is more than one rank, so
single-process runs never initialise MPI.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import traceback

from . import peer_watch

# Environment variables that launchers set for every rank: the world size, and the rank.
_WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _env_int(names):
    for var in names:
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return None


def launch_rank():
    """This process's rank when a launcher started more than one, else None (MPI untouched)."""
    size = _env_int(_WORLD_SIZE_VARS)
    return _env_int(_RANK_VARS) if size is not None and size > 1 else None


def write_lines(text: str, stream=None) -> None:
    """Write `text` to `stream` (stderr) as whole lines, one write and flush each, prefixed
    `[rank R] ` under a multi-rank launch: mpiexec forwards each rank's writes as they come, so a
    line written in pieces (print writes its newline apart) could be joined with another rank's."""
    stream = sys.stderr if stream is None else stream
    rank = launch_rank()
    prefix = "" if rank is None else f"[rank {rank}] "
    for line in text.rstrip("\n").split("\n"):
        stream.write(f"{prefix}{line}\n")
        stream.flush()


def comm_from_env():
    """COMM_WORLD when this process was started by mpiexec with more than one rank, else None.

    Looks at the launcher's environment first so that a plain `python script.py` never imports
    mpi4py (importing mpi4py.MPI initialises MPI).
    """
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                size = int(value)
            except ValueError:
                continue
            if size > 1:
                from mpi4py import MPI
                install_fault_handlers(MPI.COMM_WORLD)
                return MPI.COMM_WORLD
            return None
    return None


def node_groups(comm, ranks_per_node: int = 0) -> tuple:
    """The ranks of each node, nodes in order of their lowest rank: contiguous blocks of
    `ranks_per_node` (JITKERN_RANKS_PER_NODE, to emulate nodes on one machine) when given, else
    MPI's shared-memory split. Collective."""
    P = comm.Get_size()
    if ranks_per_node > 0:
        return tuple(tuple(range(lo, min(lo + ranks_per_node, P))) for lo in range(0, P, ranks_per_node))
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = local.allreduce(comm.Get_rank(), op=MPI.MIN)
    local.Free()
    leaders = comm.allgather(leader)
    return tuple(tuple(r for r in range(P) if leaders[r] == lead) for lead in sorted(set(leaders)))


# --------------------------------------------------------------------------- faults

_FAULT_STATE = {}
EXIT_GRACE_S = 10.0      # how long a rank at exit waits for the others before aborting the job
ABORT_DRAIN_S = 0.2      # how long a failing rank lets its stderr be forwarded before aborting


def describe_ranks() -> str:
    """'rank 0: pid 123 on host, ...' for the ranks of the communicator with fault handlers."""
    peers = _FAULT_STATE.get("peers", [])
    return "ranks: " + ", ".join(f"{r}=pid {pid} on {h}" for r, (h, pid) in enumerate(peers))


def install_fault_handlers(comm) -> None:
    """Make any failure end every rank promptly, non-zero, naming the failing rank.

    - An uncaught exception on a rank prints `jitkern: rank R of P failed: ...` and calls
      comm.Abort(1), which makes mpiexec kill all ranks (no rank is left waiting in a collective).
    - A rank killed by a signal (or dying in native code): mpiexec (MPICH's hydra) kills every
      other rank at once; a watcher process per host (peer_watch.py) prints
      `jitkern: rank R of P (pid N on HOST) died ...`. For ranks on hosts without pidfds,
      `describe_ranks` (printed by rank 0 at start) maps the pid mpiexec reports to a rank.
    - A rank that exits without an exception (sys.exit, return) while others still run: an
      atexit guard aborts after EXIT_GRACE_S instead of hanging in MPI_Finalize.
    Idempotent; a communicator of size 1 needs nothing.
    """
    if comm.Get_size() <= 1 or _FAULT_STATE.get("installed"):
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    peers = comm.allgather((socket.gethostname(), os.getpid()))
    _FAULT_STATE.update(installed=True, rank=rank, size=size, peers=peers)
    peer_watch.start(rank, size, peers)
    comm.Barrier()          # the lines exist before any rank opens its own
    peer_watch.attach()
    comm.Barrier()          # and are all open before their names go
    peer_watch.cleanup()

    def excepthook(kind, value, tb):
        # the naming line first: mpiexec may drop a dying rank's last output while it tears
        # the job down, and a short pause lets its I/O forwarding drain before the abort
        peer_watch.disarm()  # the others are about to be killed: this rank has said what happened
        sys.stderr.flush()
        write_lines(f"jitkern: rank {rank} of {size} failed: {kind.__name__}: {value}; aborting all ranks")
        write_lines("".join(traceback.format_exception(kind, value, tb)))
        time.sleep(ABORT_DRAIN_S)
        comm.Abort(1)

    sys.excepthook = excepthook
    # its own communicator: the exit barrier must never match a collective the others are in
    atexit.register(_exit_together, comm.Dup())


def _exit_together(comm) -> None:
    """At interpreter exit, wait (bounded) for every rank to get here too; abort if they do not.

    A rank that leaves early (sys.exit, a return from main) would otherwise sit in MPI_Finalize
    while the others wait in a collective for it: a hang. Normal runs end within moments of
    each other, since the last steps, evaluation and checkpoint are collective.
    """
    peer_watch.disarm()  # past this barrier the others may exit at any moment, normally
    req = comm.Ibarrier()
    deadline = time.monotonic() + EXIT_GRACE_S
    while not req.Test():
        if time.monotonic() > deadline:
            rank, size = comm.Get_rank(), comm.Get_size()
            sys.stderr.flush()
            write_lines(f"jitkern: rank {rank} of {size} is exiting but other ranks did not finish "
                        f"within {EXIT_GRACE_S:.0f} s (one exited early or is stuck); aborting all ranks")
            comm.Abort(1)
        time.sleep(0.01)
