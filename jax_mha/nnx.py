"""`jax_mha.nnx`: the Flax NNX twins of the linen modules (defined in `jax_mha.nn.nnx`)."""

from jax_mha.nn.nnx import FeedForward, MultiHeadAttention, TransformerBlock, from_linen_params, to_linen_params

__all__ = ["FeedForward", "MultiHeadAttention", "TransformerBlock", "from_linen_params", "to_linen_params"]
