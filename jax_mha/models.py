"""The decoder-only Transformer of the copy task, built from `TransformerBlock`."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_mha.modules import TransformerBlock


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the copy-task decoder."""

    vocab_size: int = 14  # PAD, BOS, SEP, EOS + 10 symbols (CopyTaskConfig.vocab_size)
    max_len: int = 64  # longest input the positional table covers (>= 2L + 2)
    d_model: int = 256  # fixed across the head-count sweep (seed 004, E12.2)
    num_heads: int = 8  # the variable of the sweep; head dim = d_model // num_heads
    num_layers: int = 2  # one layer can copy via absolute positions; two leave room for an induction circuit
    d_ff: int = 1024  # 4 * d_model, as in Vaswani et al.
    dropout_rate: float = 0.0  # the task has infinite fresh data: nothing to regularise
    pre_norm: bool = True  # with the final norm below, the GPT-2 layout: stable at lr 1e-3 without tuning
    positional: str = "learned"  # "learned" or "sinusoidal", see CopyTransformer
    implementation: str = "xla"  # attention path; "xla" is the one that can return weights

    def __post_init__(self):
        if self.positional not in ("learned", "sinusoidal"):
            raise ValueError(f"positional must be 'learned' or 'sinusoidal', got {self.positional!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")


def sinusoidal_positions(length: int, d_model: int) -> jax.Array:
    """Vaswani et al.'s table, `(length, d_model)`: sin on even, cos on odd features."""
    pos = jnp.arange(length)[:, None]
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(0, d_model, 2) / d_model)[None, :]
    table = jnp.zeros((length, d_model))
    table = table.at[:, 0::2].set(jnp.sin(pos * freq))
    return table.at[:, 1::2].set(jnp.cos(pos * freq[:, : d_model // 2]))


class CopyTransformer(nn.Module):
    """Token embedding + positions → `num_layers` causal blocks → LayerNorm → logits.

    Positions are learned by default: the copy head must attend exactly L+1 tokens
    back, and a learned table lets query and key positions line up for that one
    offset directly; the sinusoidal table (no parameters, extrapolates) is there to
    compare.
    """

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        head_mask: jax.Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """Next-token logits.

        Args:
          tokens: int `(B…, T)`, `T <= max_len`.
          head_mask: float `(num_layers, H)` gates on every head (1 keeps, 0 removes);
            default all ones.
          deterministic: disables dropout.
          return_weights: also return the attention weights of every layer.

        Returns:
          float32 logits `(B…, T, vocab_size)`, or `(logits, weights)` with weights
          `(num_layers, B…, H, T, T)`.

        Raises:
          ValueError: if T exceeds max_len or head_mask has the wrong shape.
        """
        cfg = self.config
        t = tokens.shape[-1]
        if t > cfg.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={cfg.max_len}")
        if head_mask is not None and jnp.shape(head_mask) != (cfg.num_layers, cfg.num_heads):
            raise ValueError(
                f"head_mask must have shape (num_layers, num_heads) = {(cfg.num_layers, cfg.num_heads)}, "
                f"got {jnp.shape(head_mask)}"
            )
        x = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed")(tokens)  # (B…, T, d)
        if cfg.positional == "learned":
            table = self.param("positions", nn.initializers.normal(0.02), (cfg.max_len, cfg.d_model))
        else:
            table = sinusoidal_positions(cfg.max_len, cfg.d_model)
        x = x + jnp.broadcast_to(table[:t], x.shape)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)

        all_weights = []
        for layer in range(cfg.num_layers):
            block = TransformerBlock(
                num_heads=cfg.num_heads, d_ff=cfg.d_ff, dropout_rate=cfg.dropout_rate,
                pre_norm=cfg.pre_norm, implementation=cfg.implementation, name=f"block_{layer}",
            )
            out = block(
                x, is_causal=True, head_mask=None if head_mask is None else head_mask[layer],
                deterministic=deterministic, return_weights=return_weights,
            )
            x, weights = out if return_weights else (out, None)
            all_weights.append(weights)
        x = nn.LayerNorm(name="final_norm")(x)
        logits = nn.Dense(cfg.vocab_size, name="logits")(x).astype(jnp.float32)  # (B…, T, V)
        return (logits, jnp.stack(all_weights)) if return_weights else logits
