"""Flax linen modules: they create parameters and call `jax_mha.functional`, nothing more."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_mha.functional import attention, combine_heads, split_heads


@jax.custom_vjp
def _matmul_last_axis(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` over x's last axis: `(…, d_in) @ (d_in, f) -> (…, f)`."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def _matmul_last_axis_fwd(x, w):
    return _matmul_last_axis(x, w), (x, w)


def _matmul_last_axis_bwd(res, dy):
    x, w = res
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())))  # dy wᵀ
    # dw = xᵀ dy. Autodiff hands XLA a dot contracting x's *row* axis, which XLA:CPU
    # runs on its generic (Eigen) kernel, 1.2-1.4x slower than the YNNPACK matmul it
    # uses for row-major operands; a materialised xᵀ (kept by the barrier from being
    # folded back into the dot) costs one copy of x and wins 10-20% on the matmul.
    xt = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)  # (d_in, B…·N)
    dw = xt @ dy.reshape(-1, dy.shape[-1])  # (d_in, f)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul_last_axis.defvjp(_matmul_last_axis_fwd, _matmul_last_axis_bwd)


def projection_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`jax.lax.dot_general` for `nn.Dense(dot_general=...)`: the same product, with a
    kernel gradient that XLA:CPU runs on its fast matmul (see `_matmul_last_axis_bwd`).

    Only Dense's own contraction (last axis of `lhs` with a 2-D kernel), on the CPU
    backend and without precision overrides takes the custom gradient; anything else
    is plain `dot_general`. The parameters and the forward value are unchanged.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    dense_like = (
        tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
        and not tuple(lhs_batch) and not tuple(rhs_batch) and rhs.ndim == 2
    )
    if not dense_like or precision is not None or preferred_element_type is not None or jax.default_backend() != "cpu":
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
        )
    return _matmul_last_axis(lhs, rhs)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with GQA/MQA and head gates.

    Parameters are plain `nn.Dense` layers: `query/kernel (d_q, H*D)`,
    `key/kernel (d_k, K*D)`, `value/kernel (d_v, K*D)`, `out/kernel (H*D, d_model)`;
    head `h` owns columns `h*D:(h+1)*D` of the query kernel (the `split_heads` layout).

    Attributes:
      num_heads: H, query heads.
      d_model: H*D and the output features; default: the last dim of `query`.
      num_kv_heads: K, key/value heads (default H; 1 = multi-query attention).
      qkv_bias: biases on the query/key/value projections.
      out_bias: bias on the output projection.
      dropout_rate: dropout on the attention weights (rng collection "dropout").
      dtype: computation dtype (e.g. jnp.bfloat16); None = inferred from inputs.
      param_dtype: parameter dtype.
      kernel_init: kernel initializer (xavier-uniform, as in the seeds).
      bias_init: bias initializer.
      implementation: see `jax_mha.attention`.
    """

    num_heads: int
    d_model: int | None = None
    num_kv_heads: int | None = None
    qkv_bias: bool = False
    out_bias: bool = True
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.zeros
    implementation: str | None = "xla"

    def _sizes(self, query: jax.Array) -> tuple[int, int, int]:
        """(d_model, num_kv_heads, head_dim), validated."""
        d_model = self.d_model if self.d_model is not None else query.shape[-1]
        num_kv_heads = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        if self.num_heads < 1 or d_model % self.num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}")
        if num_kv_heads < 1 or self.num_heads % num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        return d_model, num_kv_heads, d_model // self.num_heads

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
        mask: jax.Array | None = None,
        *,
        is_causal: bool = False,
        head_mask: jax.Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
        kv_lengths: jax.Array | None = None,
    ):
        """Attends from `query` to `key`/`value`.

        Args:
          query: `(B…, N, d_q)`.
          key: `(B…, S, d_k)`; defaults to `query` (self-attention).
          value: `(B…, S, d_v)`; defaults to `key`.
          mask: bool, broadcastable to `(B…, H, N, S)`, True = may attend.
          is_causal: apply the causal pattern (see `jax_mha.causal_mask`).
          head_mask: float `(H,)` or broadcastable to `(B…, H)`; multiplies each head's
            output before the heads are combined (0 removes a head).
          deterministic: disables dropout.
          return_weights: also return the attention weights.
          kv_lengths: int broadcastable to `(B…)`, valid keys per sequence.

        Returns:
          `(B…, N, d_model)`, or `(out, weights (B…, H, N, S))` with `return_weights`.

        Raises:
          ValueError: naming the numbers, for indivisible head counts, a key/value
            length or batch mismatch, inputs of rank < 2, or a bad mask/head_mask.
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.ndim < 2:
                raise ValueError(f"{name} must have shape (B…, length, features), got shape {x.shape}")
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(
                f"key length {key.shape[-2]} != value length {value.shape[-2]} "
                f"(key {key.shape}, value {value.shape})"
            )
        if not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
            raise ValueError(
                f"query, key, value batch dims differ: {query.shape}, {key.shape}, {value.shape}"
            )
        d_model, num_kv_heads, head_dim = self._sizes(query)

        dense = lambda features, name, bias: nn.Dense(
            features, use_bias=bias, dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=self.kernel_init, bias_init=self.bias_init, name=name,
            dot_general=projection_dot_general,  # same parameters and values; faster gradient on CPU
        )
        q = split_heads(dense(d_model, "query", self.qkv_bias)(query), self.num_heads)  # (B…, H, N, D)
        k = split_heads(dense(num_kv_heads * head_dim, "key", self.qkv_bias)(key), num_kv_heads)  # (B…, K, S, D)
        v = split_heads(dense(num_kv_heads * head_dim, "value", self.qkv_bias)(value), num_kv_heads)  # (B…, K, S, D)

        dropout_active = self.dropout_rate > 0.0 and not deterministic
        result = attention(
            q, k, v, mask,
            is_causal=is_causal,
            dropout_rate=self.dropout_rate,
            dropout_rng=self.make_rng("dropout") if dropout_active else None,
            deterministic=deterministic,
            return_weights=return_weights,
            implementation=self.implementation,
            kv_lengths=kv_lengths,
        )
        out, weights = result if return_weights else (result, None)  # out: (B…, H, N, D)

        if head_mask is not None:
            head_mask = jnp.asarray(head_mask)
            target = out.shape[:-2]  # (B…, H)
            try:
                ok = np.broadcast_shapes(head_mask.shape, target) == target
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"head_mask of shape {head_mask.shape} does not broadcast to (B…, H) = {target}")
            gate = jax.lax.broadcast_to_rank(head_mask[..., None, None], out.ndim)  # (B…, H, 1, 1)
            out = out * gate.astype(out.dtype)

        out = dense(d_model, "out", self.out_bias)(combine_heads(out))  # (B…, N, d_model)
        return (out, weights) if return_weights else out


class FeedForward(nn.Module):
    """Position-wise feed-forward: Dense(d_ff) → GELU → dropout → Dense(d_model)."""

    d_ff: int
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """`(B…, N, d_model) -> (B…, N, d_model)`."""
        d_model = x.shape[-1]
        h = nn.Dense(self.d_ff, dtype=self.dtype, param_dtype=self.param_dtype, name="hidden")(x)
        h = nn.gelu(h, approximate=False)  # exact GELU, as torch.nn.GELU's default
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return nn.Dense(d_model, dtype=self.dtype, param_dtype=self.param_dtype, name="output")(h)


class TransformerBlock(nn.Module):
    """Self-attention + feed-forward, each with a residual and LayerNorm.

    Post-norm (the seeds' and Vaswani et al.'s order) by default:
      `x = LN(x + Dropout(MHA(x)))`, `x = LN(x + Dropout(FFN(x)))`.
    Pre-norm (`pre_norm=True`, trains more stably when deep):
      `x = x + Dropout(MHA(LN(x)))`, `x = x + Dropout(FFN(LN(x)))`.

    Attributes:
      num_heads: attention heads H.
      d_ff: feed-forward hidden width.
      num_kv_heads: key/value heads (GQA/MQA); default H.
      dropout_rate: dropout on the residual branches and inside the feed-forward.
      attention_dropout_rate: dropout on the attention weights.
      pre_norm: LayerNorm before each sub-layer instead of after the residual.
      dtype, param_dtype: computation and parameter dtypes.
      implementation: attention implementation, see `jax_mha.attention`.
    """

    num_heads: int
    d_ff: int
    num_kv_heads: int | None = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    pre_norm: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    implementation: str | None = "xla"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None = None,
        *,
        is_causal: bool = False,
        head_mask: jax.Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """Applies the block.

        Args:
          x: `(B…, N, d_model)`.
          mask: bool, broadcastable to `(B…, H, N, N)`, True = may attend.
          is_causal: causal self-attention.
          head_mask: `(H,)` or broadcastable to `(B…, H)`, gates on the heads.
          deterministic: disables dropout.
          return_weights: also return the attention weights `(B…, H, N, N)`.

        Returns:
          `(B…, N, d_model)`, or `(y, weights)` with `return_weights=True`.
        """
        mha = MultiHeadAttention(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            dropout_rate=self.attention_dropout_rate, dtype=self.dtype,
            param_dtype=self.param_dtype, implementation=self.implementation, name="attention",
        )
        norm1 = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="norm1")
        norm2 = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, name="norm2")
        ffn = FeedForward(self.d_ff, self.dropout_rate, self.dtype, self.param_dtype, name="ffn")
        drop = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)

        def attend(y):
            result = mha(
                y, mask=mask, is_causal=is_causal, head_mask=head_mask,
                deterministic=deterministic, return_weights=return_weights,
            )
            return result if return_weights else (result, None)

        if self.pre_norm:
            a, weights = attend(norm1(x))
            x = x + drop(a)
            x = x + drop(ffn(norm2(x), deterministic=deterministic))
        else:
            a, weights = attend(x)
            x = norm1(x + drop(a))
            x = norm2(x + drop(ffn(x, deterministic=deterministic)))
        return (x, weights) if return_weights else x
