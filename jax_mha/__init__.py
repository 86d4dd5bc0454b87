"""jax_mha: multi-head attention in JAX/Flax — a pure functional core and thin linen modules."""

from jax_mha.functional import (
    rotary_embedding,
    attention,
    attention_entropy,
    causal_mask,
    combine_heads,
    lengths_mask,
    padding_mask,
    split_heads,
)
from jax_mha.modules import FeedForward, MultiHeadAttention, TransformerBlock

__version__ = "0.1.0"

__all__ = [
    "FeedForward",
    "MultiHeadAttention",
    "TransformerBlock",
    "attention",
    "attention_entropy",
    "causal_mask",
    "combine_heads",
    "lengths_mask",
    "padding_mask",
    "split_heads",
]
