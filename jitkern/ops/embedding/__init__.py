"""Embedding bags: the pooled-gather forward, the coalesced sparse backward, and the fused sparse
updates (SGD, BF16 Split-SGD, row-wise and element-wise Adagrad), with the tables they run on.

    forward.py     embedding_bag_forward
    backward.py    embedding_bag_backward
    sgd.py         embedding_bag_sgd_ (fp32 and SplitBF16Table)
    adagrad.py     embedding_bag_adagrad_ (row-wise)
    adagrad_exact.py  embedding_bag_adagrad_exact_ (element-wise, on adagrad.py's paths)
    split_bf16.py  SplitBF16Table
    layout.py      the layout knob of SplitBF16Table (split halves or row pairs)
    quantized.py   QuantizedTable, embedding_bag_quantized_forward (8- and 4-bit row-wise tables)
    psw.py         embedding_bag_per_sample_weights_backward (learned weighted pooling)
    grouping.py    grouping a batch's entries by row: hashed linking, radix sorting
    _rows.py       row helpers shared by the kernels, table memory (empty_table), scratch
    _validate.py   argument and bag checks
    _knobs.py      the problem the embedding knobs are posed, and their runners' inputs
"""
from ._rows import SPECIALISED_D, empty_table
from .adagrad import embedding_bag_adagrad_
from .adagrad_exact import embedding_bag_adagrad_exact_
from .backward import embedding_bag_backward
from .forward import embedding_bag_forward
from .layout import LAYOUT  # noqa: F401  (declares the layout knob from_float32 asks)
from .psw import embedding_bag_per_sample_weights_backward
from .sgd import embedding_bag_sgd_
from .split_bf16 import SplitBF16Table, layout_for

__all__ = ["SPECIALISED_D", "SplitBF16Table", "embedding_bag_adagrad_", "embedding_bag_adagrad_exact_", "layout_for",
           "embedding_bag_backward",
           "embedding_bag_forward", "embedding_bag_per_sample_weights_backward", "embedding_bag_sgd_", "empty_table"]
