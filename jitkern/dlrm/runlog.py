"""What a training run reports beyond its printed lines: MLPerf :::MLLOG events (--mlperf-logging,
through the optional mlperf-logging package) and TensorBoard event files (--tensor-board-filename,
through the optional tensorboardX package), as the reference writes them.

The Trainer calls every hook's epoch_start, epoch_end, eval_start, evaluated and train_loss.
"""
from __future__ import annotations

import importlib
import logging
import sys


class Hook:
    """A run's observer; every method does nothing unless overridden."""

    def epoch_start(self, st) -> None:
        pass

    def epoch_end(self, st) -> None:
        pass

    def eval_start(self, st) -> None:
        pass

    def evaluated(self, st, metrics) -> None:
        pass

    def train_loss(self, st, loss) -> None:
        pass

    def close(self, status: str = "success") -> None:
        pass


class MissingPackage(ValueError):
    """A flag needs an optional package that is not installed."""


def require(module: str, flag: str, extra: str) -> object:
    """Import an optional package for a flag, or a one-line error naming both."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(f"{flag} needs the {extra} package, which is not installed "
                          f"(pip install {extra}, or jitkern's extra: pip install -e \".[reference]\")") from None


class MLPerfLog(Hook):
    """MLPerf :::MLLOG lines (on stdout), the events and keys the reference logs."""

    def __init__(self, nbatches: int):
        mllog = require("mlperf_logging.mllog", "--mlperf-logging", "mlperf-logging")
        self.c = importlib.import_module("mlperf_logging.mllog.constants")
        self.log = mllog.get_mllogger()
        for h in self.log.logger.handlers:            # its console handler: to this process's stdout now
            if type(h) is logging.StreamHandler:     # (devnull on ranks > 0; a test's capture)
                h.stream = sys.stdout                 # (setStream would flush the old one, maybe closed)
        self.nbatches = max(1, nbatches)
        self.log.event(key=self.c.CACHE_CLEAR, value=True)
        self.log.start(key=self.c.INIT_START, value=None)

    def run_start(self, args) -> None:
        c, log = self.c, self.log
        log.end(key=c.INIT_STOP, value=None)
        log.start(key=c.RUN_START, value=None)
        log.event(key=c.SUBMISSION_BENCHMARK, value="dlrm")
        for key, value in ((c.SEED, args.numpy_rand_seed), (c.GLOBAL_BATCH_SIZE, args.mini_batch_size),
                           (c.OPT_BASE_LR, args.learning_rate), (c.OPT_LR_WARMUP_STEPS, args.lr_num_warmup_steps),
                           ("sgd_opt_base_learning_rate", args.learning_rate),
                           ("lr_decay_start_steps", args.lr_decay_start_step),
                           ("sgd_opt_learning_rate_decay_steps", args.lr_num_decay_steps),
                           ("sgd_opt_learning_rate_decay_poly_power", 2)):
            log.event(key=key, value=value)

    def epoch_start(self, st) -> None:
        c = self.c
        self.log.start(key=c.BLOCK_START, value=None, metadata={c.FIRST_EPOCH_NUM: st.epoch + 1, c.EPOCH_COUNT: 1})
        self.log.start(key=c.EPOCH_START, value=None, metadata={c.EPOCH_NUM: st.epoch + 1})

    def epoch_end(self, st) -> None:
        c = self.c
        self.log.end(key=c.EPOCH_STOP, value=None, metadata={c.EPOCH_NUM: st.epoch + 1})
        self.log.end(key=c.BLOCK_STOP, value=None, metadata={c.FIRST_EPOCH_NUM: st.epoch + 1})

    def _epoch_num(self, st) -> float:
        return st.batch / self.nbatches + st.epoch + 1

    def eval_start(self, st) -> None:
        self.log.start(key=self.c.EVAL_START, value=None, metadata={self.c.EPOCH_NUM: self._epoch_num(st)})

    def evaluated(self, st, metrics) -> None:
        c = self.c
        self.log.event(key=c.EVAL_ACCURACY, value=metrics["auc"], metadata={c.EPOCH_NUM: self._epoch_num(st)})
        self.log.end(key=c.EVAL_STOP, value=None, metadata={c.EPOCH_NUM: self._epoch_num(st)})

    def close(self, status: str = "success") -> None:
        c = self.c
        self.log.end(key=c.RUN_STOP, value=None,
                     metadata={c.STATUS: c.SUCCESS if status == "success" else c.ABORTED})


class TensorBoardLog(Hook):
    """TensorBoard scalars in ./NAME: Train/Loss at every print, Test/Acc (and Test/AUC) at every test."""

    def __init__(self, name: str, nbatches: int):
        tbx = require("tensorboardX", "--tensor-board-filename", "tensorboardX")
        self.writer = tbx.SummaryWriter("./" + name)
        self.nbatches = nbatches

    def _iter(self, st) -> int:
        return self.nbatches * st.epoch + st.batch

    def train_loss(self, st, loss) -> None:
        self.writer.add_scalar("Train/Loss", loss, self._iter(st))

    def evaluated(self, st, metrics) -> None:
        self.writer.add_scalar("Test/Acc", metrics["accuracy"], self._iter(st))
        self.writer.add_scalar("Test/AUC", metrics["auc"], self._iter(st))

    def close(self, status: str = "success") -> None:
        self.writer.close()
