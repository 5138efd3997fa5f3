"""dlrm_main.py's command line (facebookresearch/dlrm's torchrec_dlrm, the MLPerf DLRM-DCNv2
trainer, at 090956e) as the trainer's own flags: each underscored flag becomes its dashed
equivalent before parsing, so one parser and one set of checks serve both references.

Giving a dlrm_main.py flag and the dashed flag of the same setting is an error (which would win
is not obvious); so is a value that has no meaning here (`--interaction_type projection`).
"""
from __future__ import annotations

NUM_SPARSE = 26          # dlrm_main.py's Criteo model: 26 tables,
NUM_DENSE = 13           # 13 dense features


class FlagError(ValueError):
    """A dlrm_main.py flag that cannot be translated; the message names it."""


def _dashes(text: str) -> str:
    return "-".join(p.strip() for p in text.split(","))


def _interaction(text: str) -> str:
    kinds = {"original": "dot", "dcn": "dcn"}
    if text.lower() in kinds:
        return kinds[text.lower()]
    if text.lower() == "projection":
        raise FlagError("--interaction_type projection: the projection interaction is not supported; "
                        "use original (the dot interaction) or dcn")
    raise FlagError(f"--interaction_type must be original, dcn or projection, got {text!r}")


def _dataset(text: str) -> str:
    names = {"criteo_1t": "terabyte", "criteo_kaggle": "kaggle"}
    if text not in names:
        raise FlagError(f"--dataset_name must be one of {tuple(names)}, got {text!r}")
    return names[text]


def _undersampling(text: str) -> str:
    try:
        keep = float(text)
    except ValueError:
        raise FlagError(f"--undersampling_rate must be a number in (0, 1], got {text!r}") from None
    return repr(1.0 - keep)  # the share of negatives kept -> the share dropped


# dlrm_main.py flag -> (dashed flag, value conversion) for flags that take a value
_VALUED = {
    "--embedding_dim": ("--arch-sparse-feature-size", str),
    "--dense_arch_layer_sizes": ("--arch-mlp-bot", lambda v: f"{NUM_DENSE}-{_dashes(v)}"),
    "--over_arch_layer_sizes": ("--arch-mlp-top", _dashes),
    "--interaction_type": ("--arch-interaction-op", _interaction),
    "--dcn_num_layers": ("--dcn-num-layers", str),
    "--dcn_low_rank_dim": ("--dcn-low-rank-dim", str),
    "--learning_rate": ("--learning-rate", str),
    "--batch_size": ("--mini-batch-size", str),
    "--test_batch_size": ("--test-mini-batch-size", str),
    "--num_embeddings_per_feature": ("--arch-embedding-size", _dashes),
    "--multi_hot_sizes": ("--multi-hot-sizes", _dashes),
    "--multi_hot_distribution_type": ("--multi-hot-distribution-type", str),
    "--lr_warmup_steps": ("--lr-num-warmup-steps", str),
    "--lr_decay_start": ("--lr-decay-start-step", str),
    "--lr_decay_steps": ("--lr-num-decay-steps", str),
    "--epochs": ("--nepochs", str),
    "--seed": ("--numpy-rand-seed", str),
    "--limit_train_batches": ("--num-batches", str),
    "--limit_test_batches": ("--num-test-batches", str),
    "--dataset_name": ("--data-set", _dataset),
    "--undersampling_rate": ("--data-sub-sample-rate", _undersampling),
    "--in_memory_binary_criteo_path": ("--processed-data-file", str),
    "--validation_freq_within_epoch": ("--test-freq", str),
}
# switches with a dashed meaning
_SWITCHES = {"--adagrad": ("--optimizer", "adagrad"), "--shuffle_batches": ("--data-randomize", "total"),
             "--shuffle_training_set": ("--data-randomize", "total")}
# accepted, changing nothing here (what each controls is printed as a note)
_IGNORED_SWITCHES = {
    "--drop_last_training_batch": "the last short training batch is trained on",
    "--pin_memory": "there is no device to copy batches to",
    "--mmap_mode": "datasets are read memory-mapped already",
    "--allow_tf32": "fp32 GEMMs accumulate in fp32 (TF32 is a GPU format)",
    "--print_sharding_plan": "the table plan is printed at start under mpiexec",
    "--print_lr": "the learning rate is printed with each loss line's schedule",
    "--collect_multi_hot_freqs_stats": "access-frequency statistics are not collected",
}
_IGNORED_VALUED = {
    "--limit_val_batches": "jitkern evaluates on one held-out split (--limit_test_batches sizes it)",
    "--num_embeddings": None,   # used below: rows of every table when --num_embeddings_per_feature is absent
    "--interaction_branch1_layer_sizes": "only the projection interaction uses it",
    "--interaction_branch2_layer_sizes": "only the projection interaction uses it",
}
_REFUSED = {
    "--synthetic_multi_hot_criteo_path": "the materialised multi-hot dataset is not read; give the one-hot data "
                                         "(--in_memory_binary_criteo_path) with --multi_hot_sizes: it is expanded "
                                         "on the fly, seeded as the materialisation script does",
}


def _split(argv):
    """argv as (flag, value or None, its tokens) items; values of '--flag=value' and '--flag value'
    alike (a following token that starts with '--' is not a value)."""
    items, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and "=" in tok:
            items.append((*tok.split("=", 1), [tok]))
        elif tok.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            items.append((tok, argv[i + 1], argv[i:i + 2]))
            i += 1
        else:
            items.append((tok, None, [tok]))
        i += 1
    return items


def translate(argv: list) -> tuple[list, list]:
    """(argv with every dlrm_main.py flag replaced by its dashed equivalent, notes to print)."""
    items = _split(list(argv))
    given = {flag for flag, _, _ in items}
    out, notes, sources = [], [], {}
    rows = None
    for flag, value, tokens in items:
        dashed = None
        if flag in _VALUED:
            if value is None:
                raise FlagError(f"{flag} needs a value")
            dashed, convert = _VALUED[flag]
            out += [dashed, convert(value)]
            if flag == "--in_memory_binary_criteo_path":
                out += ["--data-generation", "dataset"]
        elif flag in _SWITCHES:
            dashed, setting = _SWITCHES[flag]
            out += [dashed, setting]
        elif flag in _IGNORED_SWITCHES or flag in _IGNORED_VALUED:
            if flag == "--num_embeddings":
                rows = value
            else:
                why = _IGNORED_SWITCHES.get(flag) or _IGNORED_VALUED[flag]
                notes.append(f"note: {flag} ignored: {why}")
            continue
        elif flag in _REFUSED:
            raise FlagError(f"{flag}: {_REFUSED[flag]}")
        else:
            out += tokens
            continue
        other = dashed if dashed in given else sources.get(dashed, flag)
        if other != flag and dashed != "--data-randomize":  # two shuffle switches agree
            raise FlagError(f"{flag} and {other} both set {dashed.lstrip('-')}: give one of them")
        sources[dashed] = flag
    if rows is not None and "--num_embeddings_per_feature" not in given:
        if "--arch-embedding-size" in given:
            raise FlagError("--num_embeddings and --arch-embedding-size both set the table sizes: give one of them")
        out += ["--arch-embedding-size", "-".join([rows] * NUM_SPARSE)]
    return out, notes
