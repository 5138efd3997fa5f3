"""The trainer takes every flag of the reference's dlrm_s_pytorch.py (the list in
tests/data/reference_flags.json, taken from its argparse at 090956e): each is accepted with the
reference's meaning, or refused by the run with one line naming it."""
import json
from pathlib import Path

import pytest

from jitkern.dlrm import flags
from jitkern.dlrm.cli import main

REF = json.loads((Path(__file__).parent / "data" / "reference_flags.json").read_text())
TINY = ["--arch-embedding-size", "20-30", "--arch-mlp-bot", "13-8-4", "--arch-sparse-feature-size", "4",
        "--arch-mlp-top", "4-1", "--num-batches", "2", "--mini-batch-size", "8", "--test-freq", "-1",
        "--progress", "off", "--num-indices-per-lookup", "2"]

# a value for each flag that takes one (the reference's default where it is a valid value here)
VALUES = {"--weighted-pooling": "fixed", "--data-generation": "random", "--data-set": "kaggle",
          "--arch-embedding-size": "20-30", "--arch-mlp-bot": "13-8-4", "--arch-mlp-top": "4-1",
          "--arch-sparse-feature-size": "4", "--loss-function": "bce", "--optimizer": "sgd",
          "--mini-batch-size": "8", "--num-batches": "2", "--data-size": "16", "--print-freq": "1",
          "--num-indices-per-lookup": "2", "--test-freq": "-1", "--test-mini-batch-size": "8",
          "--activation-function": "relu", "--rand-data-dist": "uniform", "--qr-operation": "mult",
          "--data-randomize": "total", "--dist-backend": "", "--quantize-mlp-with-bit": "32",
          "--quantize-emb-with-bit": "32", "--tensor-board-filename": "", "--load-model": "",
          "--save-model": "", "--raw-data-file": "", "--processed-data-file": "", "--mlperf-grad-accum-iter": "1"}
# flags that cannot apply here: refused by the run, the message naming the flag
REFUSED = {"--use-gpu", "--save-onnx", "--plot-compute-graph"}


def _argv(entry):
    flag = entry["flag"]
    if entry["type"] == "store_true":
        return [flag]
    if entry["type"] == "bool":
        return [f"{flag}=True"]
    value = VALUES.get(flag, entry["default"])
    return [f"{flag}={value}"]


def test_the_list_is_the_reference_argparse():
    assert len(REF) == 76 and len({e["flag"] for e in REF}) == 76
    assert {e["type"] for e in REF} >= {"int", "float", "str", "bool", "store_true"}


@pytest.mark.parametrize("entry", REF, ids=[e["flag"] for e in REF])
def test_every_reference_flag_is_accepted_or_refused_by_name(entry, capsys):
    argv = [a for a in TINY if a not in ()]
    argv = argv + _argv(entry)
    parser = flags.build_parser()
    args = parser.parse_args(argv)                          # never "unrecognized arguments"
    dest = entry["flag"].lstrip("-").replace("-", "_")
    assert hasattr(args, dest)
    refused = flags.refusals(args)
    if entry["flag"] in REFUSED:
        assert len(refused) == 1 and refused[0].startswith(entry["flag"]), refused
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and entry["flag"] in err[0], err
    else:
        assert refused == [], refused


def test_values_that_cannot_apply_are_refused_by_name():
    p = flags.build_parser()
    cases = [(["--dist-backend", "nccl"], "--dist-backend nccl"),
             (["--data-generation", "internal"], "--data-generation internal"),
             (["--quantize-mlp-with-bit", "8"], "--precision bf16"),
             (["--quantize-emb-with-bit", "8"], "--inference-only"),
             (["--quantize-emb-with-bit", "6", "--inference-only"], "--quantize-emb-with-bit must be 4, 8 or 32"),
             (["--qr-flag", "--weighted-pooling", "learned"], "--qr-flag with --weighted-pooling"),
             (["--md-flag", "--inference-only", "--quantize-emb-with-bit", "4"], "--md-flag with --quantize-emb-with-bit 4")]
    for argv, text in cases:
        out = flags.refusals(p.parse_args(argv))
        assert out and text in out[0], (argv, out)


@pytest.mark.parametrize("flag", flags.BOOLEAN_FLAGS)
def test_type_bool_flags_read_their_value(flag):
    p = flags.build_parser()
    dest = flag.lstrip("-").replace("-", "_")
    for text, value in (("True", True), ("False", False), ("1", True), ("0", False), ("true", True)):
        assert getattr(p.parse_args([f"{flag}={text}"]), dest) is value
        assert getattr(p.parse_args([flag, text]), dest) is value
    assert getattr(p.parse_args([flag]), dest) is True                  # jitkern's switch form
    with pytest.raises(SystemExit):
        p.parse_args([f"{flag}=maybe"])


def test_reference_defaults_apply_all_at_once_and_given_flags_win():
    ours = flags.parse_args([])
    ref = flags.parse_args(["--reference-defaults"])
    table = {e["flag"].lstrip("-").replace("-", "_"): e["default"] for e in REF}
    for dest, value in flags.REFERENCE_DEFAULTS.items():
        assert table[dest] == value, dest
        assert getattr(ref, dest) == value and getattr(ours, dest) != value, dest
    # every other reference flag has the reference's default already, except where the README says
    raw = flags.build_parser().parse_args([])
    differs = {d for d, v in table.items() if d not in flags.REFERENCE_DEFAULTS and getattr(raw, d) != v}
    assert differs == {"tensor_board_filename"}          # TensorBoard files only when asked for
    assert ref.loss_function == "mse" and ours.loss_function is None
    assert flags.parse_args(["--reference-defaults", "--mini-batch-size", "7"]).mini_batch_size == 7


def test_test_num_workers_follows_num_workers_and_profiling_alias():
    a = flags.parse_args(["--num-workers", "3"])
    assert a.test_num_workers == 3
    assert flags.parse_args(["--num-workers", "3", "--test-num-workers", "1"]).test_num_workers == 1
    assert flags.parse_args(["--enable-profiling"]).profile


def test_local_rank_and_sync_dense_params_notes():
    a = flags.parse_args(["--local_rank", "2", "--sync-dense-params=False"])
    lines = flags.notes(a, under_mpi=True)
    assert any("--local_rank 2 ignored" in s and "MPI" in s for s in lines)
    assert any("--sync-dense-params False ignored" in s for s in lines)
    assert flags.notes(flags.parse_args([]), under_mpi=False) == []
