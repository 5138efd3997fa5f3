"""The named DLRM configurations that bench, scale and tune share, and the workload (shapes)
a DLRM poses to the kernels, for the tuner."""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.knobs import Workload

# Criteo Kaggle's 26 categorical cardinalities (the reference DLRM's processed data set)
KAGGLE_TABLES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)

# MLPerf v3+ DLRM-DCNv2's lookups per table and sample (dlrm_main.py --multi_hot_sizes: 214 per sample)
MLPERF_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)

# Criteo Terabyte's 26 cardinalities with ids taken modulo 40M (MLPerf DLRM, --max-ind-range 40000000)
CRITEO_TB_TABLES = (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)


@dataclass(frozen=True)
class ModelConfig:
    """A DLRM architecture: rows per table, embedding dim, bottom MLP [dense, ..., dim], top MLP
    [..., 1] without its input width, and lookups (pooling) per table per sample: `lookups` for
    every table, or `multi_hot` one count per table (lookups is then their rounded mean). dcn:
    the cross network's layers and rank; optimizer: the model's (DLRM's optimizer=)."""
    sizes: tuple
    dim: int
    bottom: tuple
    top: tuple
    lookups: int = 1
    interaction: str = "dot"
    multi_hot: tuple = ()
    dcn_layers: int = 3
    dcn_rank: int = 512
    optimizer: str = "sgd"

    @property
    def pooling(self) -> tuple:
        """Lookups per sample of each table."""
        return tuple(self.multi_hot) if self.multi_hot else (self.lookups,) * len(self.sizes)

    def model_kwargs(self) -> dict:
        kw = dict(embedding_sizes=list(self.sizes), embedding_dim=self.dim, bottom_mlp=list(self.bottom),
                  top_mlp=list(self.top), interaction=self.interaction)
        if self.interaction == "dcn":
            kw.update(dcn_layers=self.dcn_layers, dcn_rank=self.dcn_rank)
        if self.optimizer != "sgd":
            kw.update(optimizer=self.optimizer)
        return kw

    def workload(self, batch: int, threads=(1,), itemsize: int = 4, precision: str = "fp32") -> Workload:
        return dlrm_workload(self.sizes, self.dim, self.bottom, self.top, batch, threads,
                             pooling=self.lookups, interaction=self.interaction, itemsize=itemsize,
                             cross=(self.dcn_layers, self.dcn_rank) if self.interaction == "dcn" else None,
                             precision=precision)


CONFIGS = {
    "kaggle": ModelConfig(KAGGLE_TABLES, 16, (13, 512, 256, 64, 16), (512, 256, 1)),
    "kaggle-multihot": ModelConfig(KAGGLE_TABLES, 16, (13, 512, 256, 64, 16), (512, 256, 1), lookups=20),
    "mlperf": ModelConfig((200_000,) * 26, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1)),
    # the MLPerf model at full size: 5 tables of 25-40M rows, 96 GB of fp32 tables (plan it, do not allocate it)
    "mlperf-full": ModelConfig(CRITEO_TB_TABLES, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1)),
    "paper-small": ModelConfig((1_000_000,) * 8, 64, (512, 512, 64), (1024, 1024, 1024, 1), lookups=100),
    # MLPerf v3+ DLRM-DCNv2 (dlrm_main.py --interaction_type=dcn --adagrad), tables capped as "mlperf"'s
    "mlperf-dcn": ModelConfig((200_000,) * 26, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1),
                              lookups=round(sum(MLPERF_MULTI_HOT) / 26), interaction="dcn",
                              multi_hot=MLPERF_MULTI_HOT, optimizer="adagrad"),
    # a quick check that everything runs
    "tiny": ModelConfig((1000,) * 8, 16, (13, 64, 16), (64, 1), lookups=2),
}


def interaction_width(num_tables: int, dim: int, interaction: str, self_interaction: bool = False) -> int:
    """Width of the top MLP's input: D + P for dot (P pairs of the T+1 vectors), D*(T+1) for cat and
    dcn (its cross layers keep the width)."""
    f = num_tables + 1
    if interaction in ("cat", "dcn"):
        return dim * f
    return dim + (f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2)


def dlrm_workload(sizes, dim, bottom, top, batch, threads=(1,), *, pooling=1, interaction="dot",
                  self_interaction=False, itemsize=4, cross=None, precision="fp32") -> Workload:
    """The kernels' shapes in one DLRM step at `batch`: every MLP layer, table and the interaction;
    cross: (layers, rank) of a dcn model, whose cross layers are two linear layers each (n -> r -> n);
    precision: the MLPs' GEMMs' ("fp32" or "bf16")."""
    top_in = interaction_width(len(sizes), dim, interaction, self_interaction)
    layers = list(zip(bottom[:-1], bottom[1:])) + list(zip([top_in, *top[:-1]], top))
    if cross is not None and cross[0] > 0:
        layers += [(top_in, cross[1]), (cross[1], top_in)]
    return Workload(
        linears=tuple(dict.fromkeys((batch, int(i), int(o)) for i, o in layers)),
        tables=tuple(dict.fromkeys((int(r), int(dim), int(pooling), batch, itemsize) for r in sizes)),
        interactions=((batch, len(sizes) + 1, int(dim)),) if interaction == "dot" else (),
        threads=tuple(threads), precisions=(precision,))
