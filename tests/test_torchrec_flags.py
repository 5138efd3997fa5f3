"""dlrm_main.py's (TorchRec DLRM-DCNv2) command line: each underscored flag maps to its dashed
equivalent, mixing the two for one setting is refused, and multi-hot sizes shape the batches."""
import re

import numba
import numpy as np
import pytest

from jitkern.dlrm import flags, sources, synth
from jitkern.dlrm.torchrec_flags import NUM_SPARSE, FlagError, translate

MLPERF = ("--embedding_dim 128 --dense_arch_layer_sizes 512,256,128 --over_arch_layer_sizes 1024,1024,512,256,1 "
          "--interaction_type=dcn --dcn_num_layers=3 --dcn_low_rank_dim=512 --adagrad --learning_rate 0.005 "
          "--num_embeddings_per_feature 40,39,17,74,20,3,71,15,63,40,30,40,10,22,11,15,4,9,14,40,40,40,59,12,10,36 "
          "--multi_hot_sizes 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1 "
          "--multi_hot_distribution_type uniform --batch_size 64 --epochs 2 --lr_warmup_steps 5 "
          "--lr_decay_start 7 --lr_decay_steps 9 --eps 1e-8 --seed 5").split()


def test_mlperf_dcn_command_line_maps_to_the_dashed_flags():
    args = flags.parse_args(MLPERF)
    assert args.arch_sparse_feature_size == 128
    assert args.arch_mlp_bot == "13-512-256-128" and args.arch_mlp_top == "1024-1024-512-256-1"
    assert args.arch_interaction_op == "dcn" and args.dcn_num_layers == 3 and args.dcn_low_rank_dim == 512
    assert args.optimizer == "adagrad" and args.learning_rate == 0.005 and args.eps == 1e-8
    assert args.arch_embedding_size.split("-")[:3] == ["40", "39", "17"]
    assert args.multi_hot_sizes.split("-")[20] == "100" and args.multi_hot_distribution_type == "uniform"
    assert (args.mini_batch_size, args.nepochs, args.numpy_rand_seed) == (64, 2, 5)
    assert (args.lr_num_warmup_steps, args.lr_decay_start_step, args.lr_num_decay_steps) == (5, 7, 9)


def test_original_is_the_dot_model_and_projection_is_refused(capsys):
    assert flags.parse_args(["--interaction_type", "original"]).arch_interaction_op == "dot"
    with pytest.raises(SystemExit):
        flags.parse_args(["--interaction_type", "projection"])
    assert "projection interaction is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("argv,named", [
    (["--batch_size", "8", "--mini-batch-size", "16"], "--batch_size and --mini-batch-size"),
    (["--mini-batch-size=16", "--batch_size=8"], "--batch_size and --mini-batch-size"),
    (["--adagrad", "--optimizer", "sgd"], "--adagrad and --optimizer"),
    (["--learning_rate", "1", "--learning-rate", "2"], "--learning_rate and --learning-rate"),
    (["--num_embeddings", "10", "--arch-embedding-size", "4-4"], "--num_embeddings and --arch-embedding-size"),
])
def test_mixing_the_two_references_for_one_setting_is_an_error(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        flags.parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_num_embeddings_sizes_every_table_and_ignored_switches_are_noted():
    args = flags.parse_args(["--num_embeddings", "77", "--pin_memory", "--allow_tf32"])
    assert args.arch_embedding_size == "-".join(["77"] * NUM_SPARSE)
    notes = flags.notes(args, under_mpi=False)
    assert any("--pin_memory ignored" in n for n in notes) and any("--allow_tf32 ignored" in n for n in notes)


def test_translation_leaves_other_flags_alone():
    argv = ["--round-targets=True", "--local_rank", "0", "--mini-batch-size", "4"]
    assert translate(argv)[0] == argv
    with pytest.raises(FlagError, match="synthetic_multi_hot_criteo_path"):
        translate(["--synthetic_multi_hot_criteo_path", "/x"])


@pytest.mark.parametrize("generation", ["synthetic", "random"])
@pytest.mark.parametrize("dist", ["uniform", "pareto"])
def test_multi_hot_sizes_give_each_table_its_fixed_pooling(generation, dist):
    args = flags.parse_args(["--data-generation", generation, "--arch-embedding-size", "50-60-70",
                             "--multi-hot-sizes", "3-1-5", "--multi-hot-distribution-type", dist,
                             "--num-batches", "2", "--mini-batch-size", "8", "--num-test-batches", "1"])
    train, _ = sources.build_generated(args, [50, 60, 70], 13, 8)
    b = next(iter(train.batches()))
    for t, (k, rows) in enumerate(zip((3, 1, 5), (50, 60, 70))):
        if generation == "synthetic" or dist == "pareto":   # the reference's generator merges repeats in a bag
            assert len(b.indices[t]) == 8 * k
            np.testing.assert_array_equal(b.offsets[t], np.arange(0, 8 * k, k))
        assert 0 <= b.indices[t].min() and b.indices[t].max() < rows


def test_multi_hot_sizes_count_must_match_the_tables():
    args = flags.parse_args(["--arch-embedding-size", "50-60", "--multi-hot-sizes", "3-1-5"])
    with pytest.raises(ValueError, match="--multi-hot-sizes gives 3 sizes for 2 tables"):
        sources.build_generated(args, [50, 60], 13, 8)


class _OneHot:
    embedding_sizes = [6, 9]
    num_dense = 2

    def __len__(self):
        return 1

    def batches(self, epoch=0, start=0):
        yield synth.Batch(np.zeros((3, 2), np.float32), np.tile(np.arange(3), (2, 1)),
                          [np.array([0, 5, 5]), np.array([8, 1, 0])], np.zeros(3, np.float32))


@pytest.mark.parametrize("dist", ["uniform", "pareto"])
def test_one_hot_expansion_draws_as_the_materialisation_script(dist):
    """Id r of table t becomes [r, m_t[r]], m_t drawn from legacy NumPy seeded 0, tables in order."""
    x = sources.MultiHotExpansion(_OneHot(), [2, 4], dist)
    rs = np.random.RandomState(0)
    want = []
    for rows, k in ((6, 2), (9, 4)):
        if dist == "uniform":
            extra = rs.randint(0, rows, size=(rows, k - 1))
        else:
            with np.errstate(invalid="ignore"):
                extra = rs.pareto(a=0.25, size=(rows, k - 1)).astype(np.int32) % rows
        want.append(np.concatenate([np.arange(rows)[:, None], extra], axis=1))
    b = next(iter(x.batches()))
    np.testing.assert_array_equal(b.indices[0], want[0][[0, 5, 5]].reshape(-1))
    np.testing.assert_array_equal(b.indices[1], want[1][[8, 1, 0]].reshape(-1))
    np.testing.assert_array_equal(b.offsets, [[0, 2, 4], [0, 4, 8]])
    assert len(x) == 1 and x.num_dense == 2


MLPERF_ROWS = ("40000000,39060,17295,7424,20265,3,7122,1543,63,40000000,3067956,405282,10,2209,11938,155,4,976,"
               "14,40000000,40000000,40000000,590152,12973,108,36")
MLPERF_HOTS = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"


def test_dlrm_main_dcn_command_line_trains(capsys):
    """MLPerf's DLRM-DCNv2 command line, its tables capped at 2000 rows and its widths scaled down,
    on the synthetic data: the test AUC rises by at least 0.1 within 150 steps."""
    from jitkern.dlrm.cli import main
    rows = ",".join(str(min(int(r), 2000)) for r in MLPERF_ROWS.split(","))
    argv = ("--embedding_dim 16 --dense_arch_layer_sizes 32,16 --over_arch_layer_sizes 64,32,1 "
            "--interaction_type=dcn --dcn_num_layers=2 --dcn_low_rank_dim=16 --adagrad --learning_rate 0.02 "
            f"--num_embeddings_per_feature {rows} --multi_hot_sizes {MLPERF_HOTS} --multi_hot_distribution_type uniform "
            "--batch_size 128 --limit_train_batches 150 --limit_test_batches 8 --data-generation synthetic "
            "--test-freq 150 --progress off --threads 1").split()
    threads = numba.get_num_threads()
    assert main(argv) == 0, capsys.readouterr().err
    assert numba.get_num_threads() == threads           # --threads is the run's own setting
    out = capsys.readouterr().out
    assert "interaction='dcn'" in out and "optimizer='adagrad/adagrad'" in out
    aucs = [float(a) for a in re.findall(r"Testing at it \d+/\d+: .* auc ([0-9.]+)", out)]
    assert len(aucs) == 2 and aucs[1] >= aucs[0] + 0.1, out
