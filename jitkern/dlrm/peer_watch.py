"""Name a rank that dies without a word (SIGKILL, the OOM killer, a crash in native code).

A killed rank cannot report itself, mpiexec kills the survivors too soon for them to speak, and
its own report may name a rank it killed. So the lowest rank on each host starts one small
watcher process in a session of its own (out of mpiexec's reach), holding the job's stderr; when
the first rank on its host ends while no rank has said goodbye, it prints

    jitkern: rank R of P (pid N on HOST) died without an error (killed by a signal?)

Each rank holds the write end of a life line (a FIFO) whose read end the watcher polls. A dying
process closes its files before its address space is torn down, and mpiexec learns of a death
only from such files closing, so the first line to close is the rank that died. A pidfd per
rank covers a line that a forked child keeps open. Ranks say goodbye (`disarm`) by writing a
byte on their line when they exit normally or have reported their own exception. Linux only
(pidfd_open, 5.3+); elsewhere nothing is started and rank 0's `ranks: R=pid ...` start-up line
is what remains.

Run as a script (no package import, so it starts at once), this file is the watcher:
    python peer_watch.py SIZE HOST R:PID:FD...      (FD: the inherited read end of rank R's line)
"""
from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile

_STATE: dict = {}
GOODBYE = b"\1"


def _line_dir(peers, host) -> str:
    """The directory of this job's life lines on this host: named after the lowest same-host rank's pid."""
    first = min(pid for h, pid in peers if h == host)
    return os.path.join(tempfile.gettempdir(), f"jitkern-ranks-{first}")


def start(rank: int, size: int, peers) -> bool:
    """Step 1 of 3, called by every rank with [(host, pid)] by rank: the lowest rank of each host
    makes the life lines of its host and starts the watcher. Returns whether this rank started one.
    Then every rank, after a barrier, calls `attach`, and after a second barrier `cleanup`."""
    if _STATE or not hasattr(os, "pidfd_open"):
        return False
    host = peers[rank][0]
    local = [r for r, (h, _) in enumerate(peers) if h == host]
    _STATE.update(rank=rank, dir=_line_dir(peers, host), leader=local[0] == rank)
    if local[0] != rank or len(local) < 2:
        return False
    path, reads = _STATE["dir"], []
    try:
        shutil.rmtree(path, ignore_errors=True)  # left by a job whose lowest rank had our pid
        os.mkdir(path, 0o700)
        for r in local:
            os.mkfifo(os.path.join(path, f"r{r}"), 0o600)
            reads.append(os.open(os.path.join(path, f"r{r}"), os.O_RDONLY | os.O_NONBLOCK))
        subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(size), host]
                         + [f"{r}:{peers[r][1]}:{fd}" for r, fd in zip(local, reads)],
                         stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=reads)
    except OSError:
        return False
    finally:
        for fd in reads:  # the watcher holds its own copies; without it the lines cannot open
            os.close(fd)
    return True


def attach() -> None:
    """Step 2: open this rank's life line for writing (the watcher holds its read end)."""
    if "dir" not in _STATE or "fd" in _STATE:
        return
    try:
        _STATE["fd"] = os.open(os.path.join(_STATE["dir"], f"r{_STATE['rank']}"), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no watcher on this host (a single local rank, no pidfds, it failed to start)
        pass


def cleanup() -> None:
    """Step 3: every rank holds its line open: the names are no longer needed."""
    if _STATE.get("leader"):
        shutil.rmtree(_STATE["dir"], ignore_errors=True)


def disarm() -> None:
    """This rank is ending with a word of its own (normal exit, or its exception reported)."""
    fd = _STATE.get("fd")
    if fd is None:
        return
    try:
        os.write(fd, GOODBYE)
    except OSError:  # the watcher is gone
        pass


def _drain(fd: int) -> tuple[bytes, bool]:
    """Everything readable on a line now, and whether it has closed."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return data, False
        except OSError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def _watch(size: int, host: str, ranks: dict) -> int:
    """Wait for the first of the ranks {rank: (pid, line fd)} to end; report it unless some rank said goodbye."""
    poller, owner, ended = select.poll(), {}, []
    for r, (pid, line) in ranks.items():
        os.set_blocking(line, False)
        owner[line] = (r, "line")
        poller.register(line, select.POLLIN)
        try:
            fd = os.pidfd_open(pid)
        except OSError:     # gone before we looked: it just ended
            ended.append(r)
            continue
        owner[fd] = (r, "pid")
        poller.register(fd, select.POLLIN)
    goodbye = False
    while not ended and not goodbye:
        for fd, _ in poller.poll():
            r, kind = owner[fd]
            if kind == "pid":
                ended.append(r)
                continue
            data, closed = _drain(fd)
            goodbye |= GOODBYE in data
            if closed:
                ended.append(r)
                poller.unregister(fd)  # a closed FIFO stays readable
    # a goodbye anywhere (a normal end under way, an exception reported, mpiexec killing the
    # rest after an abort) explains what follows: only a death in silence is reported
    goodbye |= any(GOODBYE in _drain(line)[0] for _, line in ranks.values())
    if not goodbye:  # several ended by the time we looked (mpiexec kills the rest at once): name them all
        ended = sorted(set(ended))
        pids = ", ".join(str(ranks[r][0]) for r in ended)
        who = (f"rank {ended[0]} of {size} (pid {pids} on {host})" if len(ended) == 1 else
               f"one of ranks {', '.join(map(str, ended))} of {size} (pids {pids} on {host}, which ended "
               f"before this watcher saw which went first)")
        sys.stderr.write(f"jitkern: {who} died without an error (killed by a signal?)\n")
        sys.stderr.flush()
    return 0


if __name__ == "__main__":
    _size, _host = int(sys.argv[1]), sys.argv[2]
    _ranks = {}
    for _arg in sys.argv[3:]:
        _r, _pid, _fd = map(int, _arg.split(":"))
        _ranks[_r] = (_pid, _fd)
    sys.exit(_watch(_size, _host, _ranks))
