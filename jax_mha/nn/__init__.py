"""The Flax modules, which create parameters and call the functional core.

`linen`: `MultiHeadAttention`, `FeedForward`, `TransformerBlock` (also `jax_mha.*`);
`nnx`: their Flax NNX twins (public as `jax_mha.nnx`); `projection`: the projections'
matmul.
"""
