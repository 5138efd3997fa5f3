"""A pure-NumPy DLRM with manual backprop, built only from jitkern.ops.

    from jitkern.dlrm import DLRM, SyntheticData
    m = DLRM(embedding_sizes=[1000] * 8, embedding_dim=16, bottom_mlp=[13, 64, 16], top_mlp=[64, 1])
    for b in SyntheticData(m.embedding_sizes, 13, batch_size=256, num_batches=10).batches():
        loss = m.train_step(b.dense, b.offsets, b.indices, b.labels, lr=0.1)

DLRM(..., comm=comm) builds the hybrid-parallel DistributedDLRM (importing this package loads
it; mpi4py is imported only when a communicator is used); its tables are sharded by a plan of
plan_sharding (the cost-model planner; DLRM(..., comm=comm, sharding=...) takes a kind or a plan).
"""
from .batch import Batch
from .configs import CONFIGS, ModelConfig
from .data import iterate_batches, load_preprocessed, table_sizes
from .dist import DistributedDLRM
from .model import DLRM
from .planner import ShardingPlan, TableSharding, plan_sharding
from .synth import RandomData, SyntheticData

__all__ = ["DLRM", "DistributedDLRM", "Batch", "SyntheticData", "RandomData", "load_preprocessed",
           "iterate_batches", "table_sizes", "CONFIGS", "ModelConfig", "plan_sharding", "ShardingPlan",
           "TableSharding"]
