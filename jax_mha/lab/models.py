"""The decoder-only Transformer every task trains, built from `TransformerBlock`.

One model class, `Decoder`: token embedding + positions → `num_layers` causal blocks →
final LayerNorm → a linear head over the task's vocabulary. A task only sets the
sizes (`vocab_size`, `max_len`) and decides which positions its loss scores; the copy
task and a character language model are the same network with different heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.functional import IMPLEMENTATIONS
from jax_mha.lab.head_types import logits_and_attention_weights  # noqa: F401  (re-exported: its home before)
from jax_mha.nn.linen import MultiHeadAttention, TransformerBlock, _require_dropout_rng, _require_mutable_cache

POSITIONAL = ("learned", "sinusoidal")
MIXERS = ("attention", "gated_conv")  # the sequence mixer of every block, see ModelConfig.mixer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder."""

    vocab_size: int = 14  # the copy task's PAD, BOS, SEP, EOS + 10 symbols (CopyTaskConfig.vocab_size)
    max_len: int = 64  # longest input the positional table covers (the copy task reads 2L + 2)
    d_model: int = 256  # fixed across the head-count sweep (seed 004, E12.2)
    num_heads: int = 8  # the variable of the sweep; head dim = d_model // num_heads
    # None: heads share d_model (size d_model // num_heads, the Vaswani sweep). An int D:
    # every head has size D and attention projects to num_heads * D, whatever d_model
    # is, which separates "more heads" from "smaller heads" (Bhojanapalli et al. 2020).
    head_dim: int | None = None
    num_layers: int = 2  # one layer can copy via absolute positions; two leave room for an induction circuit
    # 4 * d_model, as in Vaswani et al. 0: attention only, no feed-forward half in any block
    # (`AttentionOnlyBlock`; the toy models of Elhage et al. 2021 and Zoology's MQAR models).
    d_ff: int = 1024
    dropout_rate: float = 0.0  # the copy task has infinite fresh data: nothing to regularise
    pre_norm: bool = True  # with the final norm below, the GPT-2 layout: stable at lr 1e-3 without tuning
    positional: str = "learned"  # "learned" or "sinusoidal", see Decoder
    implementation: str = "xla"  # attention path; "xla" is the one that can return weights
    # The sequence mixer of every block: "attention" (multi-head attention), or "gated_conv"
    # (`GatedConvMixer`: short causal convolutions, a long causal convolution and a
    # multiplicative gate, the H3/Hyena-style baseline of Zoology; needs d_ff=0, no heads).
    mixer: str = "attention"
    conv_kernel: int = 3  # taps of the gated-conv mixer's short convolutions (unused by attention)

    def __post_init__(self):
        """Raises ValueError (TypeError for a non-int size) naming the bad field."""
        for field in ("vocab_size", "max_len", "d_model", "num_heads", "num_layers", "d_ff", "conv_kernel"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{field} must be an int, got {value!r}")
            if value < (0 if field == "d_ff" else 1):
                raise ValueError(f"{field} must be >= {0 if field == 'd_ff' else 1}, got {value}")
        if not 0.0 <= self.dropout_rate < 1.0:  # also False for NaN
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.positional not in POSITIONAL:
            raise ValueError(f"positional must be one of {POSITIONAL}, got {self.positional!r}")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, (int, np.integer))
                                          or self.head_dim < 1):
            raise ValueError(f"head_dim must be None or an int >= 1, got {self.head_dim!r}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}, got {self.mixer!r}")
        if self.mixer == "gated_conv" and self.d_ff:
            raise ValueError(f"mixer='gated_conv' blocks have no feed-forward half: set d_ff=0, got {self.d_ff}")
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            # the name only: asking a path would start the backend (before jax.distributed.initialize)
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {self.implementation!r}")


    @property
    def size_per_head(self) -> int:
        """D, the size of one head: `head_dim`, or `d_model // num_heads` when it is None."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def attention_width(self) -> int:
        """H * D, the width of the query/key/value projections (and the output's input)."""
        return self.num_heads * self.size_per_head


# Fields added after results were saved, left out of `model_to_dict` at their default, so
# the dicts (and the fingerprints of saved runs that hold them) of attention models are
# what they were (as `jax_mha.lab.data.task_to_dict` does for tasks).
_LATER_FIELDS = {"mixer": "attention", "conv_kernel": 3}


def model_to_dict(config: ModelConfig) -> dict:
    """The config as plain data (fingerprints, results.json): `dataclasses.asdict`, less
    each field of `_LATER_FIELDS` at its default; `ModelConfig(**d)` restores it."""
    return {k: v for k, v in dataclasses.asdict(config).items()
            if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}


def sinusoidal_positions(length: int, d_model: int) -> jax.Array:
    """Vaswani et al.'s table, `(length, d_model)`: sin on even, cos on odd features."""
    pos = jnp.arange(length)[:, None]
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(0, d_model, 2) / d_model)[None, :]
    table = jnp.zeros((length, d_model))
    table = table.at[:, 0::2].set(jnp.sin(pos * freq))
    return table.at[:, 1::2].set(jnp.cos(pos * freq[:, : d_model // 2]))


def check_tokens(tokens, vocab_size: int, max_len: int | None = None) -> None:
    """Token ids must be ints in `[0, vocab_size)` (an id outside would embed as NaN
    or wrap around); a traced array is checked for dtype and length only.

    Raises:
      TypeError: for a non-integer dtype.
      ValueError: naming the first bad id, or a length above `max_len`.
    """
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise TypeError(f"tokens must be integers, got dtype {jnp.result_type(tokens)}")
    if max_len is not None and jnp.shape(tokens)[-1] > max_len:
        raise ValueError(f"sequence length {jnp.shape(tokens)[-1]} exceeds max_len={max_len}")
    if isinstance(tokens, jax.core.Tracer):
        return  # values unknown while tracing: check before jit (greedy_generate does)
    values = np.asarray(tokens)
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
        raise ValueError(f"token id {values[bad].flat[0]} is outside [0, vocab_size={vocab_size})")


class AttentionOnlyBlock(nn.Module):
    """A `TransformerBlock` without its feed-forward half: `x + Dropout(MHA(LN(x)))`
    (pre-norm) or `LN(x + Dropout(MHA(x)))` (post-norm). What `ModelConfig(d_ff=0)`
    builds: the attention-only models of Elhage et al. 2021 and Olsson et al. 2022,
    in which every path from the input to the logits goes through heads, so a circuit
    such as an induction head has to be made of heads. Parameters `attention` and
    `norm1`, named as in `TransformerBlock` (whose other parameters it lacks).

    Attributes are `TransformerBlock`'s of the same names (`head_dim=None`: d_model // H).
    """

    num_heads: int
    head_dim: int | None = None
    dropout_rate: float = 0.0
    pre_norm: bool = True
    implementation: str | None = "auto"
    decode: bool = False
    attention_fn: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True, return_weights: bool = False,
                 **attention_args):
        """`(B…, N, d_model) -> (B…, N, d_model)`, or `(y, weights (B…, H, N, N))` with
        `return_weights`; `attention_args` as in `TransformerBlock.__call__`.

        Raises:
          ValueError: for dropout (`deterministic=False`) without a "dropout" rng, and as
            `MultiHeadAttention.__call__`.
        """
        _require_dropout_rng(self, self.dropout_rate, deterministic)
        width = None if self.head_dim is None else self.num_heads * self.head_dim  # None: d_model
        mha = MultiHeadAttention(
            num_heads=self.num_heads, d_model=width, out_features=None if width is None else x.shape[-1],
            dropout_rate=0.0, implementation=self.implementation, decode=self.decode,
            attention_fn=self.attention_fn, name="attention")
        norm = nn.LayerNorm(name="norm1")
        out = mha(norm(x) if self.pre_norm else x, deterministic=deterministic, return_weights=return_weights,
                  **attention_args)
        a, weights = out if return_weights else (out, None)
        x = x + nn.Dropout(self.dropout_rate)(a, deterministic=deterministic)
        x = x if self.pre_norm else norm(x)
        return (x, weights) if return_weights else x


def causal_conv(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Depthwise causal convolution, `y[…, t, c] = Σ_{j < K} kernel[j, c] · x[…, t - j, c]`
    (x is 0 before position 0): `x (B…, T, C)`, `kernel (K, C)` -> `(B…, T, C)`. A few
    taps (K <= 8) as K shifted copies; a long filter as one product with the `(T, T, C)`
    lower-triangular Toeplitz matrix of its taps. Either way the output at t is a sum
    over positions <= t only, exactly (later positions get weight 0, not a rounding
    residue as an FFT would leave)."""
    t, k = x.shape[-2], min(kernel.shape[0], x.shape[-2])
    if k <= 8:
        pad = [(0, 0)] * (x.ndim - 2) + [(k - 1, 0), (0, 0)]
        padded = jnp.pad(x, pad)  # (B…, T + K - 1, C)
        taps = kernel[:k].reshape((k,) + (1,) * (x.ndim - 1) + (-1,))  # (K, 1…, 1, C): tap j broadcasts over B…, T
        return sum(taps[j] * padded[..., k - 1 - j : k - 1 - j + t, :] for j in range(k))
    lag = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # (T, T): t - s
    toeplitz = jnp.where(((lag >= 0) & (lag < k))[..., None], kernel[jnp.clip(lag, 0, k - 1)], 0.0)  # (T, T, C)
    return jnp.einsum("tsc,...sc->...tc", toeplitz, x)


class GatedConvMixer(nn.Module):
    """A gated-convolution sequence mixer, the H3/Hyena-style baseline of Zoology (Arora
    et al. 2023; H3: Fu et al. 2023, Hyena: Poli et al. 2023): `(B…, T, d) -> (B…, T, d)`,
    causal (the output at t reads positions <= t only).

        q, k, v = split(Dense(3d)(x))        # (B…, T, d) each
        q, k, v = causal_conv(·, short)      # depthwise, short: (kernel_size, 3d) taps
        y = q ⊙ causal_conv(k ⊙ v, long)     # long: (max_len, d), a filter over the whole sequence
        out = Dense(d)(y)

    The short convolutions let a position see its last few tokens (at a value, `k ⊙ v`
    binds the value to the key just before it); the long one carries those products down
    the sequence, and the gate `q` reads them at a query. All pairs of the context share
    the same d channels (H3 with one-dimensional heads), so the width this needs grows
    with the number of pairs, where attention looks a key up by content.

    Parameters: `in_proj`, `short_filter`, `long_filter`, `out_proj`. The filters start
    normal with standard deviation 1/sqrt(taps) (a LeCun-normal depthwise convolution).

    Attributes:
      max_len: taps of the long filter; inputs up to this length.
      kernel_size: taps of the short convolutions (Zoology's short convolutions: 3).
    """

    max_len: int
    kernel_size: int = 3

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, t = x.shape[-1], x.shape[-2]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds the long filter's max_len={self.max_len}")
        taps = lambda n: nn.initializers.normal(1.0 / math.sqrt(n))
        short = self.param("short_filter", taps(self.kernel_size), (self.kernel_size, 3 * d))
        long = self.param("long_filter", taps(self.max_len), (self.max_len, d))
        q, k, v = jnp.split(causal_conv(nn.Dense(3 * d, name="in_proj")(x), short), 3, axis=-1)
        return nn.Dense(d, name="out_proj")(q * causal_conv(k * v, long[:t]))


class GatedConvBlock(nn.Module):
    """`x + Dropout(GatedConvMixer(LN(x)))` (pre-norm) or `LN(x + Dropout(…(x)))`
    (post-norm), `(B…, T, d) -> (B…, T, d)`: the block of `ModelConfig(mixer="gated_conv")`,
    with no feed-forward half (Zoology's state mixer: the identity). Parameters `mixer`
    and `norm1`."""

    max_len: int
    kernel_size: int = 3
    dropout_rate: float = 0.0
    pre_norm: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        _require_dropout_rng(self, self.dropout_rate, deterministic)
        norm = nn.LayerNorm(name="norm1")
        y = GatedConvMixer(self.max_len, self.kernel_size, name="mixer")(norm(x) if self.pre_norm else x)
        x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        return x if self.pre_norm else norm(x)


class Decoder(nn.Module):
    """Token embedding + positions → `num_layers` causal blocks → LayerNorm → logits.

    Positions are learned by default: the copy head must attend exactly L+1 tokens
    back, and a learned table lets query and key positions line up for that one
    offset directly; the sinusoidal table (no parameters, extrapolates) is there to
    compare. Parameters: `embed`, `positions` (learned only), `block_{i}`,
    `final_norm`, `logits`. With `ModelConfig(d_ff=0)` every block is an
    `AttentionOnlyBlock` (no feed-forward half); with `mixer="gated_conv"` a
    `GatedConvBlock` (no heads: no head_mask, attention weights or KV-cache decoding).

    With `decode=True` (same parameters) every block keeps a KV cache and the model
    keeps `cache/position` (the next position to write): `init` with tokens of the
    cache length, then apply chunk by chunk with `mutable=["cache"]` (see `generate`).

    `attention_fn` replaces every block's attention core (`MultiHeadAttention`'s
    hook), with the same parameters: the trainer sets
    `jax_mha.parallel.ring_attention_fn(mesh)` on a mesh with a "sequence" axis, so
    each device holds T/P tokens (`jax_mha.lab.train.jit_train_chunk`).
    """

    config: ModelConfig
    decode: bool = False  # KV-cache decoding (see `generate`): blocks keep a "cache", positions continue from it
    attention_fn: Callable | None = None  # None: jax_mha.attention; not part of the config (same parameters)

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
          tokens: int `(B…, T)`, `T <= max_len`, ids in `[0, vocab_size)` (checked when
            concrete, see `check_tokens`).
          head_mask: float `(num_layers, H)` gates on every head (1 keeps, 0 removes);
            default all ones.
          deterministic: disables dropout.
          return_weights: also return the attention weights of every layer.

        Returns:
          float32 logits `(B…, T, vocab_size)`, or `(logits, weights)` with weights
          `(num_layers, B…, H, T, T)`.

        Raises:
          TypeError, ValueError: bad tokens (see `check_tokens`) or a head_mask of the
            wrong shape; ValueError for dropout without a "dropout" rng, or decoding
            without `mutable=["cache"]`; for a head_mask, weights or decoding of a
            model without attention (`mixer="gated_conv"`).
        """
        cfg = self.config
        check_tokens(tokens, cfg.vocab_size, cfg.max_len)
        _require_dropout_rng(self, cfg.dropout_rate, deterministic)
        if cfg.mixer != "attention" and (head_mask is not None or return_weights or self.decode):
            raise ValueError(f"mixer={cfg.mixer!r} has no heads: no head_mask, return_weights or decode")
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
        x = x + jnp.broadcast_to(self._position_rows(table, tokens.shape[-1]), x.shape)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        all_weights = []
        for layer in range(cfg.num_layers):
            if cfg.mixer != "attention":
                x = self._block(layer)(x, deterministic=deterministic)
                continue
            out = self._block(layer)(
                x, is_causal=True, head_mask=None if head_mask is None else head_mask[layer],
                deterministic=deterministic, return_weights=return_weights,
            )
            x, weights = out if return_weights else (out, None)
            all_weights.append(weights)
        x = nn.LayerNorm(name="final_norm")(x)
        logits = nn.Dense(cfg.vocab_size, name="logits")(x).astype(jnp.float32)  # (B…, T, V)
        return (logits, jnp.stack(all_weights)) if return_weights else logits


    def _block(self, layer: int) -> nn.Module:
        """Block `layer`: a `TransformerBlock`, or an `AttentionOnlyBlock` when `d_ff == 0`
        (same names, `block_{layer}/attention` and `/norm1`, so the analyses find its heads),
        or a `GatedConvBlock` for `mixer="gated_conv"`."""
        cfg = self.config
        if cfg.mixer == "gated_conv":
            return GatedConvBlock(max_len=cfg.max_len, kernel_size=cfg.conv_kernel, dropout_rate=cfg.dropout_rate,
                                  pre_norm=cfg.pre_norm, name=f"block_{layer}")
        common = dict(num_heads=cfg.num_heads, head_dim=cfg.head_dim, dropout_rate=cfg.dropout_rate,
                      pre_norm=cfg.pre_norm, implementation=cfg.implementation, decode=self.decode,
                      attention_fn=self.attention_fn, name=f"block_{layer}")
        return TransformerBlock(d_ff=cfg.d_ff, **common) if cfg.d_ff else AttentionOnlyBlock(**common)

    def _position_rows(self, table: jax.Array, length: int) -> jax.Array:
        """Rows `p … p + length - 1` of the `(max_len, d)` table: p = 0, or with
        `decode` the cached position (advanced by `length` after `init`)."""
        if not self.decode:
            return table[:length]  # (T, d)
        initialized = self.has_variable("cache", "position")
        if initialized:
            _require_mutable_cache(self)
        position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        start = position.value if initialized else jnp.array(0, jnp.int32)
        if initialized:
            position.value = start + length
        return jax.lax.dynamic_slice_in_dim(table, start, length, axis=0)  # (T, d)


# The copy task's name for the same network (its checkpoints and analyses use it).
CopyTransformer = Decoder


def greedy_generate(params, model: Decoder, prompt, num_tokens: int, *, head_mask=None) -> jax.Array:
    """Continues `prompt` by `num_tokens` greedy (argmax) tokens.

    Each new token is the argmax of the model run on the sequence so far; the model is
    re-run on a fixed-length buffer, so one compilation serves every step (no KV
    cache: fine for the short sequences here).

    Args:
      params: the model's parameters.
      model: a `Decoder`.
      prompt: int `(B, P)`, ids in `[0, vocab_size)`, `P >= 1`.
      num_tokens: new tokens, `P + num_tokens <= max_len`.
      head_mask: optional `(num_layers, H)` gates.

    Returns:
      int32 `(B, P + num_tokens)`: the prompt followed by the generated tokens.

    Raises:
      TypeError, ValueError: bad prompt ids or dtype, `num_tokens < 0`, or a total
        length above `max_len`.
    """
    cfg = model.config
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be int (B, P) with P >= 1, got shape {prompt.shape}")
    if num_tokens < 0 or prompt.shape[1] + num_tokens > cfg.max_len:
        raise ValueError(f"prompt length {prompt.shape[1]} + num_tokens={num_tokens} must be in "
                         f"[{prompt.shape[1]}, max_len={cfg.max_len}]")
    check_tokens(prompt, cfg.vocab_size)
    return _generate(params, model, prompt.astype(jnp.int32), num_tokens, head_mask)


@functools.partial(jax.jit, static_argnames=("model", "num_tokens"))
def _generate(params, model, prompt, num_tokens, head_mask):
    b, p = prompt.shape
    buffer = jnp.zeros((b, p + num_tokens), jnp.int32).at[:, :p].set(prompt)

    def body(t, buffer):
        logits = model.apply({"params": params}, buffer, head_mask=head_mask)  # causal: later slots unseen
        return buffer.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))

    return jax.lax.fori_loop(p, p + num_tokens, body, buffer)


def generate(
    params, model: Decoder, prompt, num_tokens: int, *, temperature: float = 0.0, key: jax.Array | None = None,
    head_mask=None,
) -> jax.Array:
    """Continues `prompt` by `num_tokens` tokens through the KV cache.

    The prompt is read in one chunk (filling every block's cache), then each new
    token is one call on a single position: O(T) work per token where
    `greedy_generate` re-runs the whole sequence. `temperature=0` is greedy (the
    argmax, equal to `greedy_generate`); `temperature > 0` samples from
    `softmax(logits / temperature)` with `fold_in(key, t)` at position t.

    Args:
      params: the model's parameters (those of `Decoder(config)`; decoding adds none).
      model: a `Decoder` (its `decode` flag is ignored: a decoding twin is built).
      prompt: int `(B, P)`, ids in `[0, vocab_size)`, `P >= 1`.
      num_tokens: new tokens, `P + num_tokens <= max_len`.
      temperature: 0 (greedy) or a finite number > 0.
      key: PRNG key, required when `temperature > 0`.
      head_mask: optional `(num_layers, H)` gates.

    Returns:
      int32 `(B, P + num_tokens)`: the prompt followed by the generated tokens.

    Raises:
      TypeError, ValueError: as `greedy_generate`; a negative or non-finite
        temperature; `temperature > 0` without a key.
    """
    _check_prompt(model.config, prompt, num_tokens)
    if not 0.0 <= temperature < math.inf:  # NaN fails too
        raise ValueError(f"temperature must be 0 (greedy) or a finite number > 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError(f"temperature={temperature} samples: pass key=jax.random.key(...)")
    key = jax.random.key(0) if key is None else key  # typed, as callers' keys usually are: one compilation
    prompt = jnp.asarray(prompt).astype(jnp.int32)
    if num_tokens == 0:
        return prompt
    return _generate_cached(params, model.config, prompt, num_tokens, jnp.float32(temperature), key, head_mask)


def _check_prompt(cfg: ModelConfig, prompt, num_tokens: int) -> None:
    shape = jnp.shape(prompt)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"prompt must be int (B, P) with P >= 1, got shape {shape}")
    if num_tokens < 0 or shape[1] + num_tokens > cfg.max_len:
        raise ValueError(f"prompt length {shape[1]} + num_tokens={num_tokens} must be in "
                         f"[{shape[1]}, max_len={cfg.max_len}]")
    check_tokens(prompt, cfg.vocab_size)



def empty_cache(config: ModelConfig, batch_size: int, length: int):
    """The `"cache"` collection of `Decoder(config, decode=True)` for `batch_size`
    sequences of up to `length` tokens, empty (every index 0); no parameters built."""
    model = Decoder(config, decode=True)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((batch_size, length), jnp.int32))["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decode_step(params, config: ModelConfig, head_mask=None):
    """`step(cache, tokens (B, n)) -> (cache, logits (B, n, V))`: the next `n` tokens
    of every sequence through the KV cache (`Decoder(config, decode=True)`)."""
    model = Decoder(config, decode=True)

    def step(cache, tokens):
        logits, variables = model.apply({"params": params, "cache": cache}, tokens, head_mask=head_mask,
                                        mutable=["cache"])
        return variables["cache"], logits

    return step


@functools.partial(jax.jit, static_argnames=("config", "num_tokens"))
def _generate_cached(params, config, prompt, num_tokens, temperature, key, head_mask):
    """Greedy and sampled decoding are one program (the temperature is traced)."""
    b, p = prompt.shape
    cache = empty_cache(config, b, p + num_tokens)
    run = decode_step(params, config, head_mask)

    def step(cache, tokens, t):
        """Feeds `tokens (B, n)`; returns the cache and the token for position t: (B,)."""
        cache, logits = run(cache, tokens)
        last = logits[:, -1]  # (B, V)
        scaled = last / jnp.where(temperature > 0, temperature, 1.0)
        sample = jax.random.categorical(jax.random.fold_in(key, t), scaled, axis=-1)
        pick = jnp.where(temperature > 0, sample, jnp.argmax(last, -1))  # (B,)
        return cache, pick.astype(jnp.int32)

    cache, first = step(cache, prompt, p)
    buffer = jnp.zeros((b, p + num_tokens), jnp.int32).at[:, :p].set(prompt).at[:, p].set(first)

    def body(t, carry):
        cache, buffer = carry
        cache, nxt = step(cache, jax.lax.dynamic_slice_in_dim(buffer, t - 1, 1, axis=1), t)
        return cache, buffer.at[:, t].set(nxt)

    _, buffer = jax.lax.fori_loop(p + 1, p + num_tokens, body, (cache, buffer))
    return buffer
