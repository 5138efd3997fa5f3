"""The named DLRM configurations that bench, scale and tune share, and the workload (shapes)
a DLRM poses to the kernels, for the tuner."""
from __future__ import annotations

from dataclasses import dataclass

from ..codegen.knobs import Workload

# Criteo Kaggle's 26 categorical cardinalities (the reference DLRM's processed data set)
KAGGLE_TABLES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)

# Criteo Terabyte's 26 cardinalities with ids taken modulo 40M (MLPerf DLRM, --max-ind-range 40000000)
CRITEO_TB_TABLES = (39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                    11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)


@dataclass(frozen=True)
class ModelConfig:
    """A DLRM architecture: rows per table, embedding dim, bottom MLP [dense, ..., dim], top MLP
    [..., 1] without its input width, and lookups (pooling) per table per sample."""
    sizes: tuple
    dim: int
    bottom: tuple
    top: tuple
    lookups: int = 1
    interaction: str = "dot"

    def model_kwargs(self) -> dict:
        return dict(embedding_sizes=list(self.sizes), embedding_dim=self.dim, bottom_mlp=list(self.bottom),
                    top_mlp=list(self.top), interaction=self.interaction)

    def workload(self, batch: int, threads=(1,), itemsize: int = 4) -> Workload:
        return dlrm_workload(self.sizes, self.dim, self.bottom, self.top, batch, threads,
                             pooling=self.lookups, interaction=self.interaction, itemsize=itemsize)


CONFIGS = {
    "kaggle": ModelConfig(KAGGLE_TABLES, 16, (13, 512, 256, 64, 16), (512, 256, 1)),
    "kaggle-multihot": ModelConfig(KAGGLE_TABLES, 16, (13, 512, 256, 64, 16), (512, 256, 1), lookups=20),
    "mlperf": ModelConfig((200_000,) * 26, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1)),
    # the MLPerf model at full size: 5 tables of 25-40M rows, 96 GB of fp32 tables (plan it, do not allocate it)
    "mlperf-full": ModelConfig(CRITEO_TB_TABLES, 128, (13, 512, 256, 128), (1024, 1024, 512, 256, 1)),
    "paper-small": ModelConfig((1_000_000,) * 8, 64, (512, 512, 64), (1024, 1024, 1024, 1), lookups=100),
    # a quick check that everything runs
    "tiny": ModelConfig((1000,) * 8, 16, (13, 64, 16), (64, 1), lookups=2),
}


def interaction_width(num_tables: int, dim: int, interaction: str, self_interaction: bool = False) -> int:
    """Width of the top MLP's input: D + P for dot (P pairs of the T+1 vectors), D*(T+1) for cat."""
    f = num_tables + 1
    if interaction == "cat":
        return dim * f
    return dim + (f * (f + 1) // 2 if self_interaction else f * (f - 1) // 2)


def dlrm_workload(sizes, dim, bottom, top, batch, threads=(1,), *, pooling=1, interaction="dot",
                  self_interaction=False, itemsize=4) -> Workload:
    """The kernels' shapes in one DLRM step at `batch`: every MLP layer, table and the interaction."""
    top_in = interaction_width(len(sizes), dim, interaction, self_interaction)
    layers = list(zip(bottom[:-1], bottom[1:])) + list(zip([top_in, *top[:-1]], top))
    return Workload(
        linears=tuple(dict.fromkeys((batch, int(i), int(o)) for i, o in layers)),
        tables=tuple(dict.fromkeys((int(r), int(dim), int(pooling), batch, itemsize) for r in sizes)),
        interactions=((batch, len(sizes) + 1, int(dim)),) if interaction == "dot" else (),
        threads=tuple(threads))
