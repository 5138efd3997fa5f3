"""PLACEHOLDER until the kernel issue lands: delegates to the NumPy references."""
from .reference import ( # noqa: F401
    interaction_dot_forward,
    interaction_dot_backward,
    interaction_cat_forward,
    interaction_cat_backward,
)
