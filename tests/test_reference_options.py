"""The reference's run options in jitkern's trainer: checkpoints with optimizer state and table
tricks resume exactly, the optional extras (mlperf-logging, tensorboardX) and their clear errors
when absent, --mlperf-grad-accum-iter as the reference, --debug-mode, --print-wall-time and
quantized inference."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from jitkern.ops import reference as R
from jitkern.dlrm import DLRM, RandomData
from jitkern.dlrm.cli import main
from jitkern.dlrm.tables import QR
from jitkern.dlrm.checkpoint import load_checkpoint, save_checkpoint
from jitkern.dlrm.train import Trainer, TrainOptions

DATA = Path(__file__).parent / "data"
SIZES = [300, 500, 40]
ARCH = dict(embedding_sizes=SIZES, embedding_dim=4, bottom_mlp=[13, 8, 4], top_mlp=[8, 1], seed=727)
OPTIONS = [dict(), dict(loss="mse", loss_threshold=0.45, activation="sigmoid"), dict(qr=QR()),
           dict(qr=QR(30, 3, "concat"), bottom_mlp=[13, 8, 8]), dict(md_dims=[2, None, 3]),
           dict(weighted_pooling="learned"), dict(loss="wbce", loss_weights=(0.3, 0.7))]
OPTIMIZED = [dict(optimizer="adagrad"), dict(optimizer="rwsadagrad", weighted_pooling="learned"),
             dict(optimizer="adagrad", md_dims=[2, None, 3]), dict(optimizer="sgd", table_optimizer="rowwise_adagrad")]
LINE = re.compile(r"Finished training it (\d+)/(\d+) of epoch (\d+), loss ([0-9.]+)")


def _batches(n=6, seed=3):
    return list(RandomData(SIZES, 13, 32, n, num_indices_per_lookup=4, seed=seed).batches())


def _train(m, batches):
    return [m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.05) for b in batches]


def _resume_exactly(tmp_path, kw):
    arch = {**ARCH, **kw}
    bs = _batches()
    straight = DLRM(**arch)
    losses = _train(straight, bs)
    first = DLRM(**arch)
    _train(first, bs[:3])
    save_checkpoint(str(tmp_path / "ck"), first, {})
    resumed = DLRM(**{**arch, "seed": 99})
    load_checkpoint(str(tmp_path / "ck"), resumed)
    assert _train(resumed, bs[3:]) == losses[3:]
    a, b = straight.checkpoint_arrays(), resumed.checkpoint_arrays()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    return a


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_checkpoints_resume_exactly_with_the_reference_options(tmp_path, kw):
    arrays = _resume_exactly(tmp_path, kw)
    assert not any(k.startswith("state.") for k in arrays)               # SGD keeps no state


@pytest.mark.parametrize("kw", OPTIMIZED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_checkpoints_keep_the_optimizer_state(tmp_path, kw):
    arrays = _resume_exactly(tmp_path, kw)
    states = [k for k in arrays if k.startswith("state.")]
    assert states and all(np.any(arrays[k] > 0) for k in states), states


def test_a_checkpoint_for_other_options_is_refused(tmp_path):
    m = DLRM(**ARCH, qr=QR())
    save_checkpoint(str(tmp_path / "ck"), m, {})
    with pytest.raises(ValueError, match="differs in qr"):
        load_checkpoint(str(tmp_path / "ck"), DLRM(**ARCH))
    with pytest.raises(ValueError, match="differs in qr, weighted_pooling"):
        load_checkpoint(str(tmp_path / "ck"), DLRM(**ARCH, weighted_pooling="learned"))


def test_model_option_errors():
    with pytest.raises(ValueError, match="loss must be one of"):
        DLRM(**ARCH, loss="hinge")
    with pytest.raises(ValueError, match="loss_weights .* go with loss='wbce'"):
        DLRM(**ARCH, loss="wbce")
    with pytest.raises(ValueError, match="qr concat doubles the width"):
        DLRM(**{**ARCH, "bottom_mlp": [13, 8]}, qr=QR(100, 4, "concat"))
    with pytest.raises(ValueError, match=r"2 x embedding_dim \(qr concat\) 8"):
        DLRM(**ARCH, qr=QR(30, 4, "concat"))
    with pytest.raises(ValueError, match="weighted_pooling with qr or md"):
        DLRM(**ARCH, qr=QR(), weighted_pooling="learned")
    with pytest.raises(ValueError, match="bf16 Split-SGD tables take SGD only"):
        DLRM(**ARCH, embedding_precision="bf16", weighted_pooling="learned")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        DLRM(**ARCH, optimizer="adam")
    with pytest.raises(ValueError, match=r"md_dims widths must be in \[1, embedding_dim=4\]"):
        DLRM(**ARCH, md_dims=[5, None, None])


# --------------------------------------------------------------------------- the reference's accumulation


def test_grad_accum_is_the_references():
    """--mlperf-grad-accum-iter N: the reference zeroes the gradients right before the N-th
    batch's backward, so only every N-th batch updates; its printed losses (recorded with
    mlperf-logging installed) come out of the trainer with grad_accum=N."""
    rec = json.loads((DATA / "reference_losses_mlperf.json").read_text())
    case = rec["cases"][0]
    m = DLRM(**ARCH, loss="bce_prob")
    src = RandomData(SIZES, 13, 32, 12, num_indices_per_lookup=4, seed=727)
    test = RandomData(SIZES, 13, 32, 2, num_indices_per_lookup=4, seed=728)
    lines = []
    Trainer(m, src, test, TrainOptions(lr=0.1, print_freq=4, progress=False, grad_accum=2), log=lines.append).run()
    got = [[int(x[1]), int(x[3]), x[4]] for x in map(LINE.search, lines) if x]
    assert [g[:2] for g in got] == [c[:2] for c in case["losses"]]
    for g, c in zip(got, case["losses"]):
        assert abs(float(g[2]) - float(c[2])) <= 1e-5


def test_mlperf_logging_replays_the_reference(capsys):
    pytest.importorskip("mlperf_logging")
    rec = json.loads((DATA / "reference_losses_mlperf.json").read_text())
    for case in rec["cases"]:
        assert main(rec["base"].split() + case["flags"].split() + ["--progress", "off", "--test-freq", "4"]) == 0
        out = capsys.readouterr().out
        got = [[int(x[1]), int(x[3]), x[4]] for x in LINE.finditer(out)]
        assert all(abs(float(g[2]) - float(c[2])) <= 1e-5 for g, c in zip(got, case["losses"])), (got, case)
        for key in ("init_start", "run_start", "epoch_start", "eval_start", "eval_accuracy", "run_stop"):
            assert f'"key": "{key}"' in out, key


# --------------------------------------------------------------------------- extras and output options

TINY = ["--arch-embedding-size", "20-30", "--arch-mlp-bot", "13-16", "--arch-sparse-feature-size", "16",
        "--arch-mlp-top", "8-1", "--num-batches", "4", "--mini-batch-size", "8", "--progress", "off",
        "--data-generation", "random", "--print-freq", "2", "--test-freq", "-1", "--num-indices-per-lookup", "2"]


@pytest.mark.parametrize("flag, module, package", [(["--mlperf-logging"], "mlperf_logging", "mlperf-logging"),
                                                   (["--tensor-board-filename", "tb"], "tensorboardX", "tensorboardX")])
def test_extras_flags_without_the_package_are_a_clear_error(flag, module, package, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)          # as if not installed
    assert main(TINY + flag) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag[0] in err[0] and f"pip install {package}" in err[0], err


def test_tensor_board_writes_event_files(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.chdir(tmp_path)
    assert main(TINY + ["--tensor-board-filename", "run_x", "--test-freq", "2"]) == 0
    assert list((tmp_path / "run_x").glob("events.out.tfevents.*"))


def test_debug_mode_wall_time_and_precision(capsys):
    assert main(TINY + ["--debug-mode", "--print-precision", "2", "--print-wall-time"]) == 0
    out = capsys.readouterr().out
    assert "model arch:" in out and "mini-batch: 3" in out
    assert "initial parameters (weights and bias):" in out and "updated parameters (weights and bias):" in out
    assert re.search(r"Finished training it 2/4 of epoch 0, loss [0-9.]+ \(\d\d:\d\d\)", out)
    assert re.search(r"\[ ?-?\d\.\d\d[ \]]", out)                  # arrays with 2 digits


def test_quantized_inference_equals_dequantized_tables(tmp_path, capsys):
    m = DLRM(**{**ARCH, "embedding_dim": 16, "bottom_mlp": [13, 16]})
    b = _batches(1)[0]
    for bits in (8, 4):
        q = DLRM(**{**ARCH, "embedding_dim": 16, "bottom_mlp": [13, 16]})
        deq = DLRM(**{**ARCH, "embedding_dim": 16, "bottom_mlp": [13, 16]})
        q.quantize_tables(bits)
        deq.emb = [R.dequantize_rowwise(t).astype(np.float32) for t in q.emb]
        np.testing.assert_allclose(q.forward(b.dense, b.offsets, b.indices),
                                   deq.forward(b.dense, b.offsets, b.indices), rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="plain fp32 tables"):
            q.quantize_tables(bits)
    ck = str(tmp_path / "ck")
    argv = TINY + ["--arch-embedding-size", "300-500-40", "--save-model", ck]
    assert main(argv) == 0
    assert main(argv[:-2] + ["--load-model", ck, "--inference-only", "--quantize-emb-with-bit", "4"]) == 0
    out = capsys.readouterr().out
    assert "tables quantized row-wise to 4 bits" in out and "Testing at it 4/4" in out
    del m


def test_one_process_options_are_named_under_mpi():
    from jitkern.dlrm import cli, flags, preflight
    for argv, text in ((["--md-flag"], "--md-flag"), (["--qr-flag"], "--qr-flag"),
                       (["--weighted-pooling", "learned"], "--weighted-pooling learned")):
        with pytest.raises(preflight.PreflightError, match=f"{text}: runs in one process only"):
            cli._one_process_only(flags.parse_args(argv))
    cli._one_process_only(flags.parse_args(["--loss-function", "mse", "--activation-function", "sigmoid"]))
    for opt in ("adagrad", "rwsadagrad"):                 # the optimizers train under mpiexec too
        cli._one_process_only(flags.parse_args(["--optimizer", opt]))


def test_optimizer_pairs_follow_the_reference():
    from jitkern.dlrm.optimizers import describe, make_optimizers
    cases = {("sgd", None): ("sgd", "sgd"), ("adagrad", None): ("adagrad", "adagrad"),
             ("rwsadagrad", None): ("adagrad", "rowwise_adagrad"), ("sgd", "rowwise_adagrad"): ("sgd", "rowwise_adagrad"),
             ("adagrad", "sgd"): ("adagrad", "sgd")}
    for (opt, table), names in cases.items():
        dense, tab = make_optimizers(opt, table)
        assert (dense.name, tab.name) == names
        assert describe(dense, tab) == ("sgd" if names == ("sgd", "sgd") else "/".join(names))
    dense, tab = make_optimizers("rwsadagrad", eps=1e-7)
    assert dense.eps == tab.eps == 1e-7 and make_optimizers("adagrad")[1].eps == 1e-10
    assert tab.state(5, 3).shape == (5,) and make_optimizers("adagrad")[1].state(5, 3).shape == (5, 3)
    with pytest.raises(ValueError, match="table_optimizer must be one of"):
        make_optimizers("sgd", "adam")
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        make_optimizers("adagrad", eps=-1)
