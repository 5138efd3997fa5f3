"""Training loop, MLPerf learning-rate schedule, evaluation and atomic, resumable checkpoints."""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

from .atomic import atomic_write
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
        if not math.isfinite(self.base_lr) or self.base_lr < 0:
            raise ValueError(f"learning rate must be finite and >= 0, got {self.base_lr}")
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


# --------------------------------------------------------------------------- checkpoints

_MAGIC = b"JITKERN-DLRM-CK1"           # 16 bytes: format name and version
_END = b"JITKERN-DLRM-END"
_ALIGN = 64


class CheckpointError(ValueError):
    """A file that is not a complete jitkern DLRM checkpoint, or one for another architecture."""


def model_arch(model: DLRM) -> dict:
    return {"embedding_sizes": model.embedding_sizes, "embedding_dim": model.embedding_dim,
            "bottom_mlp": model.bottom_mlp, "top_mlp": model.top_mlp[1:], "interaction": model.interaction,
            "self_interaction": model.self_interaction}


def save_checkpoint(path: str, model: DLRM, meta: dict) -> None:
    """Write model parameters and `meta` (JSON-able) atomically: temp file, fsync, rename."""
    if getattr(model, "comm", None) is not None:     # hybrid parallel: a directory, each rank its tables
        from .dist_checkpoint import save_checkpoint as save_sharded
        return save_sharded(path, model, meta, model_arch(model))
    sd = model.state_dict()
    entries, offset = [], 0
    for name, a in sd.items():
        entries.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset,
                        "nbytes": a.nbytes})
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = {"arch": model_arch(model), "meta": meta, "arrays": entries, "data_bytes": offset}
    with atomic_write(path) as f:
        crcs = []
        # header is written twice: a placeholder now, the one with checksums at the end
        f.write(b"\0" * 16)
        for a in sd.values():
            mv = memoryview(np.ascontiguousarray(a)).cast("B")
            crcs.append(zlib.crc32(mv))
            f.write(mv)
            f.write(b"\0" * (-(-a.nbytes // _ALIGN) * _ALIGN - a.nbytes))
        for e, c in zip(entries, crcs):
            e["crc32"] = c
        blob = json.dumps(header).encode()
        f.write(blob)
        f.write(_END + struct.pack("<QQ", offset, len(blob)))
        f.seek(0)
        f.write(_MAGIC)


def read_checkpoint_header(path: str) -> dict:
    """The checkpoint's header (arch, meta, array table); CheckpointError if foreign or truncated."""
    if os.path.isdir(path):                          # a sharded checkpoint (saved by several ranks)
        from .dist_checkpoint import read_manifest
        return read_manifest(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(16)
            if magic != _MAGIC:
                raise CheckpointError(f"{path}: not a jitkern DLRM checkpoint (bad magic)")
            if size < 16 + len(_END) + 16:
                raise CheckpointError(f"{path}: truncated checkpoint ({size} bytes)")
            f.seek(size - len(_END) - 16)
            end = f.read(len(_END) + 16)
            if end[:len(_END)] != _END:
                raise CheckpointError(f"{path}: truncated or corrupt checkpoint (no end marker)")
            data_bytes, hlen = struct.unpack("<QQ", end[len(_END):])
            if 16 + data_bytes + hlen + len(_END) + 16 != size:
                raise CheckpointError(f"{path}: truncated or corrupt checkpoint (size {size} does not match)")
            f.seek(16 + data_bytes)
            header = json.loads(f.read(hlen))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt checkpoint header") from None
    return header


def load_checkpoint(path: str, model: DLRM) -> dict:
    """Verify the checkpoint fully (arch, shapes, checksums), then load it into `model`; returns meta."""
    if os.path.isdir(path):                          # sharded: any rank count loads its own arrays
        from .dist_checkpoint import load_checkpoint as load_sharded
        return load_sharded(path, model, model_arch(model))
    header = read_checkpoint_header(path)
    arch = model_arch(model)
    if header["arch"] != arch:
        diff = [k for k in arch if header["arch"].get(k) != arch[k]]
        raise CheckpointError(f"{path}: checkpoint is for another architecture (differs in {', '.join(diff)})")
    shapes = model.state_shapes()
    entries = {e["name"]: e for e in header["arrays"]}
    if set(entries) != set(shapes):
        raise CheckpointError(f"{path}: checkpoint arrays do not match the model's parameters")
    for name, e in entries.items():
        if tuple(e["shape"]) != shapes[name] or e["dtype"] != "float32":
            raise CheckpointError(f"{path}: {name} is {e['dtype']} {e['shape']}, expected float32 {shapes[name]}")
    with open(path, "rb") as f:
        for name, e in entries.items():             # first pass: checksums, before touching the model
            f.seek(16 + e["offset"])
            crc, left = 0, e["nbytes"]
            while left:
                chunk = f.read(min(left, 1 << 24))
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
            if crc != e["crc32"]:
                raise CheckpointError(f"{path}: checksum mismatch in {name} (corrupt checkpoint)")
        sd = model.state_dict()                      # live arrays: read straight into the parameters
        for name, e in entries.items():
            f.seek(16 + e["offset"])
            f.readinto(memoryview(sd[name]).cast("B"))
    if model.embedding_precision != "fp32" or getattr(model, "comm", None) is not None:
        model.load_state_dict(sd)                    # re-split the tables read as fp32; take each rank's pieces
    return header["meta"]


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
    progress: bool | None = None      # None: a tqdm bar when stderr is a terminal


@dataclass
class TrainState:
    step: int = 0                     # optimizer steps taken
    epoch: int = 0                    # position of the next batch: epoch and index in it
    batch: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    losses: list = field(default_factory=list)     # [step, mean loss since last print]
    evals: list = field(default_factory=list)      # {"step":, "loss":, "auc":, "accuracy":, "samples":}


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


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

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        m = evaluate(self.model, self.test_data.batches(0))
        m["step"] = self.state.step
        if self.timer is not None:
            self.timer.add("evaluation", time.perf_counter() - t0)
        self.state.evals.append(m)
        self.log(f"Testing at it {self.state.step}/{self.total_steps()}: loss {m['loss']:.6f}, "
                 f"accuracy {100 * m['accuracy']:.3f} %, auc {m['auc']:.4f} ({m['samples']} samples)")
        return m

    def save(self) -> None:
        if self.opts.save_model:
            meta = {"state": _json_safe(asdict(self.state)), "schedule": asdict(self.schedule)}
            save_checkpoint(self.opts.save_model, self.model, meta)

    def run(self) -> TrainState:
        """Train from the current state to the end of the last epoch (or the AUC threshold);
        evaluates and saves at the end."""
        st, n = self.state, len(self.train_data)
        if st.batch >= n:                   # resumed from a run that finished its (shorter) epoch
            st.epoch, st.batch = st.epoch + 1, 0
        if self.opts.test_freq > 0 and st.step == 0:
            self.evaluate()                  # the untrained model's metrics, for contrast
        bar = self._progress()
        self._pending, self._since = [], time.perf_counter()
        try:
            stop = False
            while st.epoch < self.opts.nepochs and not stop:
                stop = self._run_epoch(bar)
                if not stop:
                    st.epoch, st.batch = st.epoch + 1, 0
        finally:
            if bar is not None:
                bar.close()
        if st.batch == 0 and st.epoch > 0:
            st.epoch, st.batch = st.epoch - 1, n     # position "after the last batch" of the last epoch
        self.evaluate()
        self.save()
        return st

    def _run_epoch(self, bar) -> bool:
        """The rest of the current epoch; True when the AUC threshold stopped training."""
        it = self.train_data.batches(self.state.epoch, self.state.batch)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            if self.timer is not None:
                self.timer.add("data", time.perf_counter() - t0)
            if batch is None:
                return False
            self._step(batch)
            if bar is not None:
                bar.update(1)
            if self._after_step():
                return True

    def _step(self, batch) -> None:
        """One train_step at the scheduled rate; errors name the batch and epoch."""
        st = self.state
        t1 = time.perf_counter()
        try:
            loss = self.model.train_step(batch.dense, batch.offsets, batch.indices, batch.labels,
                                         self.schedule(st.step))
        except (ValueError, IndexError, TypeError) as e:
            raise type(e)(f"batch {st.batch} of epoch {st.epoch}: {e}") from None
        st.train_seconds += time.perf_counter() - t1
        st.step, st.batch, st.samples = st.step + 1, st.batch + 1, st.samples + batch.size
        self._pending.append(loss)

    def _after_step(self) -> bool:
        """Report, evaluate and save as the options ask; True when the AUC threshold is reached."""
        st, opts = self.state, self.opts
        last = st.batch == len(self.train_data) and st.epoch == opts.nepochs - 1
        if (opts.print_freq > 0 and st.step % opts.print_freq == 0) or last:
            self._since = self._report(self._pending, self._since)
            self._pending = []
        if (opts.test_freq > 0 and st.step % opts.test_freq == 0) and not last:
            m = self.evaluate()
            self.save()
            if opts.mlperf_auc_threshold > 0 and m["auc"] >= opts.mlperf_auc_threshold:
                self.log(f"MLPerf AUC threshold {opts.mlperf_auc_threshold} reached; stopping")
                return True
        return False

    def _report(self, pending, since) -> float:
        st = self.state
        now = time.perf_counter()
        st.losses.append([st.step, float(np.mean(pending))])
        msg = f"Finished training it {st.batch}/{len(self.train_data)} of epoch {st.epoch}, loss {np.mean(pending):.6f}"
        if self.opts.print_time:
            msg += f", {1e3 * (now - since) / len(pending):.2f} ms/it"
        self.log(msg)
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


def state_from_meta(meta: dict) -> TrainState:
    """The TrainState stored in a checkpoint's meta."""
    try:
        return TrainState(**meta["state"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint meta lacks a valid training state ({e})") from None
