"""PLACEHOLDER until the kernel issue lands: delegates to the NumPy references."""
from .reference import ( # noqa: F401
    embedding_bag_forward,
    embedding_bag_backward,
    embedding_bag_sgd_,
    embedding_bag_adagrad_,
)
