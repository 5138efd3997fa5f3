"""Name a rank that dies without a word (SIGKILL, the OOM killer, a crash in native code).

A killed rank cannot report itself, the survivors are killed by mpiexec within a millisecond
(too soon for them to say anything: measured, a watcher thread inside each rank got its line out
in 1 run of 3), and MPICH's mpiexec then prints the pid of whichever process it noticed first,
at times a rank it killed itself. So the lowest rank on each host starts one small watcher
process in a session of its own (out of mpiexec's reach), holding the job's stderr. It waits on
Linux pidfds of every rank on its host; when the first of them ends while no rank has said
goodbye, it is reported as

    jitkern: rank R of P (pid N on HOST) died without an error (killed by a signal?)

Ranks say goodbye (`disarm`) when they exit normally or have reported their own exception,
by setting their byte in a small flag file the watcher reads. Linux only (pidfd_open, 5.3+);
elsewhere nothing is started and rank 0's `ranks: R=pid ...` start-up line is what remains.

Run as a script (no package import: it starts in ~20 ms), this file is the watcher:
    python peer_watch.py FLAGS SIZE HOST R:PID...
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile

_STATE: dict = {}


def _flag_path(peers, host) -> str:
    """The flag file of this job on this host: named after the lowest same-host rank's pid."""
    first = min(pid for h, pid in peers if h == host)
    return os.path.join(tempfile.gettempdir(), f"jitkern-ranks-{first}.flags")


def start(rank: int, size: int, peers) -> bool:
    """Called by every rank with [(host, pid)] by rank; the lowest rank of each host starts the
    watcher for its host. Returns whether this rank started one."""
    if _STATE or not hasattr(os, "pidfd_open"):
        return False
    host = peers[rank][0]
    local = [r for r, (h, _) in enumerate(peers) if h == host]
    _STATE.update(rank=rank, path=_flag_path(peers, host))
    if local[0] != rank or len(local) < 2:
        return False
    try:
        with open(_STATE["path"], "wb") as f:
            f.write(bytes(size))
        subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), _STATE["path"], str(size), host]
                         + [f"{r}:{peers[r][1]}" for r in local],
                         stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return False
    return True


def disarm() -> None:
    """This rank is ending with a word of its own (normal exit, or its exception reported)."""
    path = _STATE.get("path")
    if path is None:
        return
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, b"\1", _STATE["rank"])
    finally:
        os.close(fd)


def _watch(path: str, size: int, host: str, ranks: dict) -> int:
    """Wait for the first of the ranks {rank: pid} to end; report it unless some rank has said goodbye."""
    poller, fds = select.poll(), {}
    ended = []
    for r, pid in ranks.items():
        try:
            fd = os.pidfd_open(pid)
        except OSError:     # gone before we looked: it just ended
            ended.append(r)
            continue
        fds[fd] = r
        poller.register(fd, select.POLLIN)
    try:
        if not ended:
            ended = sorted(fds[fd] for fd, _ in poller.poll())
        try:
            with open(path, "rb") as f:
                flags = f.read()
        except OSError:
            flags = b""
        # a goodbye anywhere (a normal end under way, an exception reported, mpiexec killing the
        # rest after an abort) explains what follows: only a death in silence is reported
        if not any(flags):
            r = ended[0]
            also = f" (ranks {', '.join(map(str, ended))} ended together)" if len(ended) > 1 else ""
            sys.stderr.write(f"jitkern: rank {r} of {size} (pid {ranks[r]} on {host}) died without an error "
                             f"(killed by a signal?){also}\n")
            sys.stderr.flush()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    _path, _size, _host = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.exit(_watch(_path, _size, _host, {int(r): int(p) for r, p in (a.split(":") for a in sys.argv[4:])}))
