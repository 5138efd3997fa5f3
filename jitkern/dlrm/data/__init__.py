"""Criteo data for the DLRM: raw logs -> memory-mapped binary, readers, and a batch loader.

Preprocess (raw Kaggle train.txt or Terabyte day_0..day_23, plain or .gz):

    python -m jitkern preprocess --raw train.txt --out criteo_kaggle [--min-frequency 3 | --max-ind-range M]
    python -m jitkern preprocess --dataset terabyte --raw day_{0..23}.gz --out criteo_tb --max-ind-range 10000000

Layout (see layout.py): DIR/{dense.npy (N, 13) float32 log(x+1), sparse.npy (N, 26) int32 ids,
labels.npy (N,) float32, meta.json, COMPLETE}; splits are row ranges recorded in meta.json.

Load and iterate (what the trainer calls):

    ds = load_preprocessed(path, split="train")    # or "val", "test"
    # path: a preprocessed dir, an MLPerf PREFIX_{train,val,test}.bin (or PREFIX), or a TorchRec
    # dir of day_{d}_{dense,sparse,labels}.npy
    ds.dense, ds.sparse, ds.labels     # (N, 13) float32, (N, 26) ids, (N,) float32; memory-mapped
                                       # (or converted per slice: src[a:b] -> ndarray)
    ds.cardinalities, len(ds)          # 26 ints (ids of table j are < cardinalities[j]), N
    for batch in iterate_batches(ds, batch_size, shuffle=False, seed=0, block_size=65536,
                                 max_ind_range=None, drop_last=False):
        ...  # jitkern.dlrm.batch.Batch: dense (B, 13) f32, offsets (26, B) i64 = arange(B) per
             # table (one lookup per table), indices 26 x (B,) i64, labels (B,) f32
    table_sizes(ds, max_ind_range)     # embedding rows per table under that modulo
"""
from .layout import LayoutError, write_preprocessed
from .loader import iterate_batches, make_batch, table_sizes
from .preprocess import main, preprocess
from .raw import RawDataError, parse_chunk, read_raw
from .readers import (CriteoDataset, RowView, load_layout, load_mlperf_bin, load_preprocessed,
                      load_torchrec)

__all__ = ["main", "preprocess", "load_preprocessed", "load_layout", "load_mlperf_bin", "load_torchrec",
           "iterate_batches", "make_batch", "table_sizes", "CriteoDataset", "RowView", "LayoutError",
           "RawDataError", "parse_chunk", "read_raw", "write_preprocessed"]
