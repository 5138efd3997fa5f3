"""Training loop, MLPerf learning-rate schedule and evaluation; resumable through checkpoint.py."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .checkpoint import CheckpointError, save_checkpoint
from .interrupt import Interrupted, deferred_signals
from .metrics import evaluate_scores
from .model import DLRM, StageTimer

# --------------------------------------------------------------------------- LR schedule


@dataclass(frozen=True)
class LRSchedule:
    """The reference's LRPolicyScheduler (MLPerf DLRM): linear warmup, then polynomial (power 2) decay.

    Step s (0-based) trains with the rate the reference's scheduler holds after s+1 of its steps:
    warmup base*c/W for c = s+1 < W; decay max(1e-7, base*((N - (c - S)) / N)**2) for
    S <= c < S + N; otherwise the last rate set (frozen after decay or between the phases), or
    the base rate when there is no decay phase.
    """

    base_lr: float
    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0

    MIN_LR = 1e-7

    def __post_init__(self):
        if not 0 <= self.base_lr <= float(np.finfo(np.float32).max):      # NaN fails too
            raise ValueError(f"learning rate must be finite and >= 0 (in float32, the precision updates "
                             f"apply it in), got {self.base_lr}")
        if min(self.warmup_steps, self.decay_start_step, self.decay_steps) < 0:
            raise ValueError("LR warmup/decay step counts must be >= 0")
        if self.decay_steps > 0 and self.decay_start_step < self.warmup_steps:
            raise ValueError(f"LR warmup ({self.warmup_steps} steps) must finish before the decay starts "
                             f"(step {self.decay_start_step})")

    def _rate(self, c: int):
        """The rate the scheduler sets at its step count c, or None where it keeps the last one."""
        w, s, n = self.warmup_steps, self.decay_start_step, self.decay_steps
        if c < w:
            return self.base_lr * (1.0 - (w - c) / w)
        if s <= c < s + n:
            return max(self.MIN_LR, self.base_lr * ((n - (c - s)) / n) ** 2)
        return None

    def __call__(self, step: int) -> float:
        c = step + 1
        rate = self._rate(c)
        if rate is not None or self.decay_steps == 0:
            return self.base_lr if rate is None else rate
        # frozen at the last rate set: end of decay, else end of warmup, else never set
        last = min(c - 1, self.decay_start_step + self.decay_steps - 1) if c >= self.decay_start_step \
            else min(c - 1, self.warmup_steps - 1)
        rate = self._rate(last) if last >= 1 else None
        return self.base_lr if rate is None else rate


# --------------------------------------------------------------------------- evaluation


def evaluate(model: DLRM, batches) -> dict:
    """Log loss, accuracy and ROC AUC of the model's probabilities over all given batches."""
    labels, probs = [], []
    for b in batches:
        probs.append(model.forward(b.dense, b.offsets, b.indices).copy())
        labels.append(b.labels)
    if not labels:
        raise ValueError("no evaluation batches")
    return evaluate_scores(np.concatenate(labels), np.concatenate(probs))


# --------------------------------------------------------------------------- the loop


@dataclass
class TrainOptions:
    lr: float = 0.01
    warmup_steps: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0
    nepochs: int = 1
    print_freq: int = 1
    print_time: bool = False
    test_freq: int = -1
    save_model: str = ""
    mlperf_auc_threshold: float = 0.0
    mlperf_acc_threshold: float = 0.0   # stop once test accuracy exceeds it (0: off)
    progress: bool | None = None      # None: a tqdm bar when stderr is a terminal
    print_wall_time: bool = False     # loss lines end in " (HH:MM)"
    grad_accum: int = 1               # --mlperf-grad-accum-iter: the reference's: only every N-th batch updates
    hooks: tuple = ()                 # objects told of losses, evaluations and epochs (runlog.py)


@dataclass
class TrainState:
    step: int = 0                     # optimizer steps taken
    epoch: int = 0                    # position of the next batch: epoch and index in it
    batch: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    losses: list = field(default_factory=list)     # [step, mean loss since last print]
    evals: list = field(default_factory=list)      # {"step":, "loss":, "auc":, "accuracy":, "samples":}
    pending_losses: list = field(default_factory=list)   # losses of the steps since the last print
    pending_samples: list = field(default_factory=list)  # and their batch sizes


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


class _StopVote:
    """Whether to stop at a step boundary. One process: when it has received a signal. Under MPI:
    when any rank has, by a non-blocking allreduce (max) of the ranks' signals posted at the
    previous boundary and waited for at this one (a step's compute hides its latency), so every
    rank stops after the same step, at most one step after the first signal."""

    def __init__(self, comm):
        self.comm = None if comm is None else comm.Dup()   # its own: never matches the model's collectives
        self.req = None
        self.send, self.recv = np.zeros(1, np.int64), np.zeros(1, np.int64)

    def _collect(self) -> int:
        if self.req is None:
            return 0
        self.req.Wait()
        self.req = None
        return int(self.recv[0])

    def __call__(self, signum: int) -> int:
        """At a step boundary: this process's signal (0: none) -> the agreed signal (0: go on)."""
        if self.comm is None:
            return signum
        from mpi4py import MPI
        agreed = self._collect()
        self.send[0] = signum
        self.req = self.comm.Iallreduce(self.send, self.recv, op=MPI.MAX)
        return agreed

    def agree(self, signum: int) -> int:
        """Blocking: the largest signal any rank has received (0: none), the vote in flight included."""
        if self.comm is None:
            return signum
        from mpi4py import MPI
        return max(self._collect(), self.comm.allreduce(int(signum), op=MPI.MAX))

    def close(self) -> None:
        if self.comm is not None:
            self._collect()
            self.comm.Free()
            self.comm = None


class Trainer:
    """Runs epochs of train_step over a batch source, evaluating and checkpointing as asked."""

    def __init__(self, model: DLRM, train_data, test_data, opts: TrainOptions, *, log=print,
                 state: TrainState | None = None, timer: StageTimer | None = None):
        self.model, self.train_data, self.test_data, self.opts = model, train_data, test_data, opts
        self.schedule = LRSchedule(opts.lr, opts.warmup_steps, opts.decay_start_step, opts.decay_steps)
        self.state = state or TrainState()
        self.timer = timer
        self.log = log

    def total_steps(self) -> int:
        return self.opts.nepochs * len(self.train_data)

    def _hook(self, name, *args) -> None:
        for h in self.opts.hooks:
            getattr(h, name)(*args)

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        self._hook("eval_start", self.state)
        m = evaluate(self.model, self.test_data.batches(0))
        m["step"] = self.state.step
        if self.timer is not None:
            self.timer.add("evaluation", time.perf_counter() - t0)
        self.state.evals.append(m)
        self.log(f"Testing at it {self.state.step}/{self.total_steps()}: loss {m['loss']:.6f}, "
                 f"accuracy {100 * m['accuracy']:.3f} %, auc {m['auc']:.4f} ({m['samples']} samples)")
        self._hook("evaluated", self.state, m)
        return m

    def save(self) -> None:
        if self.opts.save_model:
            meta = {"state": _json_safe(asdict(self.state)), "schedule": asdict(self.schedule)}
            save_checkpoint(self.opts.save_model, self.model, meta)

    def run(self) -> TrainState:
        """Train from the current state to the end of the last epoch (or the AUC threshold);
        evaluates and saves at the end. SIGINT/SIGTERM stop training after the current step
        (under MPI every rank after the same one): the checkpoint is saved, then Interrupted
        is raised."""
        st, n = self.state, len(self.train_data)
        if st.batch >= n:                   # resumed from a run that finished its (shorter) epoch
            st.epoch, st.batch = st.epoch + 1, 0
        with deferred_signals() as pending:
            vote = _StopVote(getattr(self.model, "comm", None))
            if self.opts.test_freq > 0 and st.step == 0:
                self.evaluate()              # the untrained model's metrics, for contrast
            bar = self._progress()
            self._since = time.perf_counter()
            try:
                signum = self._train_epochs(bar, pending, vote)
            finally:
                if bar is not None:
                    bar.close()
            signum = vote.agree(max(signum, pending.signum))     # one during the last step too
            if st.batch == 0 and st.epoch > 0:
                st.epoch, st.batch = st.epoch - 1, n  # position "after the last batch" of the last epoch
            if not signum:
                self.evaluate()
            self.save()
            signum = signum or vote.agree(pending.signum)         # or during the final evaluation
            vote.close()
        if signum:
            raise Interrupted(signum, st.step, self.opts.save_model or None)
        return st

    def _train_epochs(self, bar, pending, vote) -> int:
        """Epochs from the current position to the end, the AUC threshold or an agreed stop
        request; -> the signal that stopped training (0: none did)."""
        st = self.state
        while st.epoch < self.opts.nepochs:
            self._hook("epoch_start", st)
            stop = self._run_epoch(bar, pending, vote)
            if stop is not None:
                return stop
            self._hook("epoch_end", st)
            st.epoch, st.batch = st.epoch + 1, 0
        return 0

    def _run_epoch(self, bar, pending, vote):
        """The rest of the current epoch; -> None at its end, else why training stops: 0 for the
        AUC threshold, the signal's number for an interrupt every process agreed on."""
        it = self.train_data.batches(self.state.epoch, self.state.batch)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            if self.timer is not None:
                self.timer.add("data", time.perf_counter() - t0)
            if batch is None:
                return None
            self._step(batch)
            if bar is not None:
                bar.update(1)
            if self._after_step():
                return 0
            signum = vote(pending.signum)
            if signum:
                return signum

    def _step(self, batch) -> None:
        """One train_step at the scheduled rate; errors name the batch and epoch. With grad_accum N
        (--mlperf-grad-accum-iter), as the reference: it zeroes the gradients right before the
        N-th batch's backward, so only every N-th batch updates (with its own gradient) and the
        others are forward only."""
        st = self.state
        t1 = time.perf_counter()
        update = (st.batch + 1) % self.opts.grad_accum == 0
        try:
            if update:
                loss = self.model.train_step(batch.dense, batch.offsets, batch.indices, batch.labels,
                                             self.schedule(st.step))
            else:
                loss = self.model.batch_loss(batch.dense, batch.offsets, batch.indices, batch.labels)
        except (ValueError, IndexError, TypeError) as e:
            raise type(e)(f"batch {st.batch} of epoch {st.epoch}: {e}") from None
        st.train_seconds += time.perf_counter() - t1
        st.step, st.batch, st.samples = st.step + update, st.batch + 1, st.samples + batch.size
        st.pending_losses.append(loss)
        st.pending_samples.append(batch.size)

    def _after_step(self) -> bool:
        """Report, evaluate and save as the options ask; True when the AUC threshold is reached."""
        st, opts = self.state, self.opts
        end_of_epoch = st.batch == len(self.train_data)
        last = end_of_epoch and st.epoch == opts.nepochs - 1
        # as the reference: every print_freq batches of an epoch, and at its end
        if (opts.print_freq > 0 and st.batch % opts.print_freq == 0) or end_of_epoch:
            self._since = self._report(self._since)
        if (opts.test_freq > 0 and st.step % opts.test_freq == 0) and not last:
            m = self.evaluate()
            self.save()
            return self._threshold_reached(m)
        return False

    def _threshold_reached(self, m) -> bool:
        opts = self.opts
        if opts.mlperf_auc_threshold > 0 and m["auc"] >= opts.mlperf_auc_threshold:
            self.log(f"MLPerf AUC threshold {opts.mlperf_auc_threshold} reached; stopping")
            return True
        if opts.mlperf_acc_threshold > 0 and m["accuracy"] > opts.mlperf_acc_threshold:
            self.log(f"MLPerf accuracy threshold {opts.mlperf_acc_threshold} reached; stopping")
            return True
        return False

    def _report(self, since) -> float:
        st = self.state
        now = time.perf_counter()
        loss = _mean_loss(st.pending_losses, st.pending_samples)
        st.losses.append([st.step, loss])
        msg = f"Finished training it {st.batch}/{len(self.train_data)} of epoch {st.epoch}, loss {loss:.6f}"
        if self.opts.print_time:
            msg += f", {1e3 * (now - since) / len(st.pending_losses):.2f} ms/it"
        if self.opts.print_wall_time:
            msg += time.strftime(" (%H:%M)")
        self.log(msg)
        self._hook("train_loss", st, loss)
        st.pending_losses, st.pending_samples = [], []
        return now

    def _progress(self):
        show = self.opts.progress if self.opts.progress is not None else sys.stderr.isatty()
        if not show:
            return None
        from tqdm import tqdm
        bar = tqdm(total=self.total_steps(), initial=self.state.step, unit="it", leave=False)
        log = self.log
        self.log = lambda msg: bar.write(msg) if log is print else log(msg)
        return bar


def _mean_loss(losses, samples) -> float:
    """The mean loss per sample since the last print (the reference's): batch losses weighted by
    their sizes where the sizes differ (a plain mean otherwise, and for older checkpoints)."""
    if len(samples) == len(losses) and len(set(samples)) > 1:
        return float(np.dot(losses, samples) / np.sum(samples))
    return float(np.mean(losses))


def state_from_meta(meta: dict) -> TrainState:
    """The TrainState stored in a checkpoint's meta."""
    try:
        state = TrainState(**meta["state"])
        state.pending_losses = [math.nan if v is None else v for v in state.pending_losses]  # JSON's NaN
        return state
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint meta lacks a valid training state ({e})") from None
