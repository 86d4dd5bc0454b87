"""jax_mha: multi-head attention in JAX/Flax — a pure functional core and thin linen modules.

`jax_mha.nnx` holds the Flax NNX twins of the modules (import it explicitly).
"""

import jax as _jax

from jax_mha.functional import (
    attention,
    attention_entropy,
    attention_statistics,
    block_schedule,
    causal_mask,
    combine_heads,
    lengths_mask,
    merge_attentions,
    padding_mask,
    rotary_embedding,
    split_heads,
)
from jax_mha.interop import from_flax, from_torch_state_dict, mask_from_torch, to_flax, to_torch_state_dict
from jax_mha.nn.linen import FeedForward, MultiHeadAttention, TransformerBlock

# `jax.export` refuses custom calls without a serialization guarantee unless told; the
# GPU kernel (Pallas' Triton backend) is one. Pass these to export a model that calls
# the kernels for a GPU: `jax.export.export(f, platforms=["cuda"],
# disabled_checks=jax_mha.EXPORT_DISABLED_CHECKS)` (docs/accelerators.md, "Export").
KERNEL_CUSTOM_CALL_TARGETS = ("__gpu$xla.gpu.triton",)
EXPORT_DISABLED_CHECKS = tuple(_jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_CUSTOM_CALL_TARGETS)

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "EXPORT_DISABLED_CHECKS",
    "KERNEL_CUSTOM_CALL_TARGETS",
    "FeedForward",
    "MultiHeadAttention",
    "TransformerBlock",
    "attention",
    "attention_entropy",
    "attention_statistics",
    "block_schedule",
    "causal_mask",
    "combine_heads",
    "from_flax",
    "from_torch_state_dict",
    "lengths_mask",
    "mask_from_torch",
    "merge_attentions",
    "padding_mask",
    "rotary_embedding",
    "split_heads",
    "to_flax",
    "to_torch_state_dict",
]
