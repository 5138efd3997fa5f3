"""Public kernels: checked wrappers over generated code. References live in ops.reference."""
from .activation import sigmoid_backward, sigmoid_forward
from .bf16 import BF16Array, join_float32, split_float32
from .blocks import gather_blocks, scatter_blocks, sum_blocks
from .cross import cross_layer_backward, cross_layer_forward
from .embedding import (
    SplitBF16Table,
    embedding_bag_adagrad_,
    embedding_bag_adagrad_exact_,
    embedding_bag_backward,
    embedding_bag_forward,
    embedding_bag_per_sample_weights_backward,
    embedding_bag_sgd_,
    empty_table,
)
from .embedding.quantized import QuantizedTable, embedding_bag_quantized_forward, quantize_rowwise
from .gemm import batch_reduce_gemm, gemm, linear_backward, linear_forward
from .interaction import (
    interaction_cat_backward,
    interaction_cat_forward,
    interaction_dot_backward,
    interaction_dot_forward,
)
from .loss import sigmoid_bce_backward, sigmoid_bce_forward, sigmoid_loss_backward, sigmoid_loss_forward
from .optim import adagrad_, sgd_, split_sgd_

__all__ = [
    "BF16Array", "adagrad_", "batch_reduce_gemm", "cross_layer_backward", "cross_layer_forward",
    "embedding_bag_adagrad_", "embedding_bag_adagrad_exact_",
    "embedding_bag_backward", "embedding_bag_forward",
    "embedding_bag_per_sample_weights_backward",
    "embedding_bag_sgd_", "empty_table", "gemm", "interaction_cat_backward", "interaction_cat_forward",
    "interaction_dot_backward", "interaction_dot_forward", "linear_backward", "linear_forward",
    "SplitBF16Table", "sgd_", "split_sgd_", "split_float32", "join_float32", "sigmoid_backward",
    "sigmoid_bce_backward", "sigmoid_bce_forward",
    "sigmoid_forward", "sigmoid_loss_backward", "sigmoid_loss_forward",
    "QuantizedTable", "embedding_bag_quantized_forward", "quantize_rowwise",
    "gather_blocks", "scatter_blocks", "sum_blocks",
]
