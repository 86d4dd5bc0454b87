"""The delayed copy task (Katharopoulos et al. 2020; Jelassi et al. 2024).

A sequence is `BOS x1 … xL SEP x1 … xL EOS` (then PAD up to the longest L). A
decoder reads it left to right; the loss is scored only on the second copy and EOS,
whose tokens can only be known by looking back L+1 positions: no attention, no copy.
A position-aligned copy (output_i = input_i) would be solved by the residual stream
alone and measure nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4  # content symbols are FIRST_SYMBOL … FIRST_SYMBOL + num_symbols - 1


@dataclasses.dataclass(frozen=True)
class CopyTaskConfig:
    """What sequences look like."""

    length: int = 16  # L, symbols per copy (the longest, when min_length is set)
    min_length: int | None = None  # None: every example has L symbols; else L ~ U{min_length … length}, padded
    num_symbols: int = 10  # content vocabulary: chance accuracy on a symbol is 1/num_symbols
    reverse: bool = False  # the second half is x_L … x_1: the offset now varies per position

    def __post_init__(self):
        if self.length < 1 or self.num_symbols < 2:
            raise ValueError(f"need length >= 1 and num_symbols >= 2, got length={self.length}, num_symbols={self.num_symbols}")
        if self.min_length is not None and not 1 <= self.min_length <= self.length:
            raise ValueError(f"min_length={self.min_length} must be in [1, length={self.length}]")

    @property
    def vocab_size(self) -> int:
        return FIRST_SYMBOL + self.num_symbols

    @property
    def seq_len(self) -> int:
        """T, the model's input length: `2L + 2` (tokens minus the last)."""
        return 2 * self.length + 2


def make_batch(key: jax.Array, config: CopyTaskConfig, batch_size: int) -> dict[str, jax.Array]:
    """Samples a batch of the copy task; jittable (config and batch_size static).

    Args:
      key: PRNG key; the same key gives the same batch.
      config: the task.
      batch_size: B.

    Returns:
      dict with int32 `inputs (B, T)` = tokens[:-1], int32 `targets (B, T)` =
      tokens[1:], bool `scored (B, T)`: True where the target is a second-copy symbol
      or EOS. `T = 2L + 2`.
    """
    max_len = config.length
    symbols_key, length_key = jax.random.split(key)
    symbols = jax.random.randint(
        symbols_key, (batch_size, max_len), FIRST_SYMBOL, FIRST_SYMBOL + config.num_symbols, jnp.int32
    )
    if config.min_length is None:
        lengths = jnp.full((batch_size, 1), max_len, jnp.int32)
    else:
        lengths = jax.random.randint(length_key, (batch_size, 1), config.min_length, max_len + 1, jnp.int32)

    pos = jnp.arange(2 * max_len + 3)[None, :]  # token positions, (1, 2L+3)
    first = (pos >= 1) & (pos <= lengths)
    second = (pos >= lengths + 2) & (pos <= 2 * lengths + 1)
    offset = pos - lengths - 2  # index into the second copy
    source = jnp.where(config.reverse, lengths - 1 - offset, offset)
    gather = lambda idx: jnp.take_along_axis(symbols, jnp.clip(idx, 0, max_len - 1), axis=1)
    tokens = jnp.select(
        [pos == 0, first, pos == lengths + 1, second, pos == 2 * lengths + 2],
        [jnp.full_like(pos, BOS), gather(pos - 1), jnp.full_like(pos, SEP), gather(source), jnp.full_like(pos, EOS)],
        PAD,
    ).astype(jnp.int32)  # (B, 2L+3)
    scored = (pos >= lengths + 2) & (pos <= 2 * lengths + 2)  # targets x1…xL and EOS
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "scored": scored[:, 1:]}


def chance_accuracy(config: CopyTaskConfig) -> float:
    """Scored-token accuracy of a model that knows positions but sees no content.

    It can place EOS (1 of L+1 scored tokens per example, at the longest L) and guess
    each symbol with probability 1/num_symbols.
    """
    l = config.length
    return (l / config.num_symbols + 1) / (l + 1)
