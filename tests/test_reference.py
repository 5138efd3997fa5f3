"""jitkern's trainer against the reference dlrm_s_pytorch.py (facebookresearch/dlrm at 090956e):
the same command lines print the same training losses (to 5 decimals), replayed from what the
reference printed (tests/data/reference_losses.json, see tests/data/README.md), so no torch is
needed here. The reference's processed Kaggle .npz is read and trained on the same way."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from jitkern.dlrm import DLRM
from jitkern.dlrm.cli import main
from jitkern.dlrm.tables import md_solver

DATA = Path(__file__).parent / "data"
LOSSES = json.loads((DATA / "reference_losses.json").read_text())
LINE = re.compile(r"Finished training it (\d+)/(\d+) of epoch (\d+), loss ([0-9.naif]+)")


def _losses(argv, capsys):
    assert main(argv + ["--progress", "off", "--test-freq", "-1"]) == 0, capsys.readouterr().err
    return [[int(m[1]), int(m[3]), m[4]] for m in LINE.finditer(capsys.readouterr().out)]


def _same(mine, ref):
    """The same print points, the same losses to 5 decimals (printed with 6)."""
    assert [m[:2] for m in mine] == [r[:2] for r in ref], (mine, ref)
    for m, r in zip(mine, ref):
        assert abs(float(m[2]) - float(r[2])) <= 1e-5 + 1e-12, (mine, ref)


CASES = [c for c in LOSSES["cases"] if c["returncode"] == 0]


@pytest.mark.parametrize("case", CASES, ids=[c["flags"] for c in CASES])
def test_reference_command_lines_print_the_reference_losses(case, capsys):
    _same(_losses(LOSSES["base"].split() + case["flags"].split(), capsys), case["losses"])


def test_default_loss_is_the_reference_bce_unsaturated(capsys):
    """Issue 19's command line: jitkern's default loss (BCE from the logits) and the reference's
    --loss-function=bce print the same six losses (no probability rounds to 0 or 1 there)."""
    full = json.loads((DATA / "reference_losses_full.json").read_text())
    bce = next(c for c in full["cases"] if c["flags"] == "--loss-function=bce")
    assert [r[2] for r in bce["losses"]][0] == "0.694349" and bce["losses"][-1][2] == "0.693727"
    _same(_losses(full["base"].split(), capsys), bce["losses"])
    _same(_losses(full["base"].split() + ["--loss-function=bce"], capsys), bce["losses"])


def test_md_solver_is_the_reference_algorithm():
    ref = json.loads((DATA / "reference_md_dims.json").read_text())
    for case in ref:
        assert md_solver(case["rows"], case["alpha"], case["d0"], case["round_dims"]) == case["dims"], case


def test_learned_pooling_weights_train_as_the_reference():
    """The per-sample-weight gradient path: after the reference's 12 steps, its learned pooling
    weights (tests/data/reference_final_weights.npz) and ours agree."""
    ref = np.load(DATA / "reference_final_weights.npz")
    from jitkern.dlrm import RandomData
    sizes = [300, 500, 40]
    m = DLRM(sizes, 4, [13, 8, 4], [8, 1], seed=727, loss="bce_prob", weighted_pooling="learned")
    for b in RandomData(sizes, 13, 32, 12, num_indices_per_lookup=4, seed=727).batches():
        m.train_step(b.dense, b.offsets, b.indices, b.labels, 0.1)
    sd = m.state_dict()
    for t in range(3):
        theirs = ref[f"learned/v_W_l.{t}"]
        assert np.abs(theirs - 1).max() > 1e-6                  # they moved
        np.testing.assert_allclose(sd[f"emb.{t}.pool_weight"], theirs, rtol=0, atol=2e-7)
        np.testing.assert_allclose(sd[f"emb.{t}.weight"], ref[f"learned/emb_l.{t}.weight"], rtol=0, atol=2e-6)


def _kaggle_input(tmp_path):
    """The reference's processed files as its bench script expects them in ./input."""
    d = tmp_path / "input"
    d.mkdir()
    for f in ("kaggleAdDisplayChallenge_processed.npz", "train_day_count.npz"):
        shutil.copy(DATA / "reference_kaggle" / f, d / f)
    return d


def test_reference_processed_npz_trains_as_the_reference(tmp_path, capsys, monkeypatch):
    """The reference's processed Kaggle .npz (made by its own code from the 100-row sample): the
    same permutation of the training rows, the same model init after it, the same losses."""
    case = json.loads((DATA / "reference_kaggle" / "losses.json").read_text())
    monkeypatch.chdir(tmp_path)
    _kaggle_input(tmp_path)
    _same(_losses(case["argv"], capsys), case["losses"])
