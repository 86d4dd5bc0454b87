"""The modules of `jax_mha.nn.linen` in Flax NNX, with the same parameters and options.

Same parameter names and shapes as the linen modules (`query`, `key`, `value`, `out`
with `kernel`/`bias`; `query_ln`, `key_ln`; `bias_k`, `bias_v`; `norm1`, `norm2`,
`ffn/hidden`, `ffn/output`), so `to_linen_params` / `from_linen_params` move weights
between the two unchanged. Both call the same `jax_mha._attend.attend` and so the same
functional core.

NNX needs the input widths at construction (`in_features`, `d_model`); the KV cache is
NNX state (`nnx.Cache` variables `cached_key`, `cached_value`, `cache_index`) created
by `init_cache`, as in `flax.nnx.MultiHeadAttention`. Dropout is off until
`model.train()` (or `deterministic=False`), as the linen modules' default.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.errors
import jax
import jax.numpy as jnp
from flax import nnx

from jax_mha import _attend
from jax_mha.functional import combine_heads, split_heads
from jax_mha.interop import _placement_problem
from jax_mha.nn.linen import _FlaxCompatibleValueError
from jax_mha.nn.projection import projection_dot_general


class _CacheTraceError(_FlaxCompatibleValueError, flax.errors.TraceContextError):
    """Decoding inside a plain JAX transform, which cannot write the `nnx.Cache`."""


def _first(*values):
    return next(v for v in values if v is not None)


def _dropout_stream(rngs: nnx.Rngs):
    """The "dropout" stream of `rngs` (its "default" stands in, as in flax); None
    when it has neither: the call that drops out then says what to pass."""
    return rngs.dropout if "dropout" in rngs or "default" in rngs else None


def _no_dropout_rng(owner: str, rate: float) -> ValueError:
    call = ", pass rngs=nnx.Rngs(dropout=key) or dropout_rng=key to the call" if owner == "MultiHeadAttention" else ""
    return ValueError(f'{owner}: dropout_rate={rate} with deterministic=False needs a "dropout" rng: build it with '
                      f'rngs=nnx.Rngs(params=..., dropout=...) (or nnx.Rngs(seed)){call}, or set '
                      'deterministic=True (model.eval())')


def _check_dropout(owner: str, dropout: nnx.Dropout, deterministic: bool | None) -> None:
    """Raises when `dropout` will run (rate > 0, not deterministic) with no stream."""
    if dropout.rate > 0.0 and not _first(deterministic, dropout.deterministic, True) and dropout.rngs is None:
        raise _no_dropout_rng(owner, dropout.rate)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention with GQA/MQA, a KV cache, QK-norm, RoPE and head gates.

    The NNX twin of `jax_mha.MultiHeadAttention` (read its docstring for every
    option). `num_kv_heads`, `out_features`, `qkv_bias`, `out_bias`, `dropout_rate`,
    `dtype`, `param_dtype`, `precision`, `kernel_init`, `bias_init`, `out_kernel_init`,
    `out_bias_init`, `implementation`, `decode`, `normalize_qk`, `rope`, `rope_base`,
    `sow_weights`, `add_bias_kv`, `add_zero_attn`, `sinks` and `attention_fn` (flax's hook: a
    callable with `jax_mha.attention`'s signature, called instead of it) are as in
    the linen module; the others:

    Args:
      num_heads: H.
      in_features: d_q, the width of `query`.
      d_model: H*D (flax's `qkv_features`); default `in_features`.
      in_kv_features: d_k, the width of `key`; default `in_features`.
      in_v_features: d_v, the width of `value`; default `in_kv_features`.
      deterministic: the default of the call's `deterministic` (`train()` sets False).
      rngs: `nnx.Rngs` for the initialisers, and its "dropout" stream for dropout.

    Raises:
      ValueError: naming the numbers, for indivisible head counts or a
        `dropout_rate` outside [0, 1).
      TypeError: for an `attention_fn` that is not callable.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        d_model: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        in_v_features: int | None = None,
        out_features: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Callable = nnx.initializers.xavier_uniform(),
        bias_init: Callable = nnx.initializers.zeros,
        out_kernel_init: Callable | None = None,
        out_bias_init: Callable | None = None,
        implementation: str | None = "auto",
        decode: bool = False,
        normalize_qk: bool = False,
        rope: bool = False,
        rope_base: float = 10000.0,
        sow_weights: bool = False,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        attention_fn: Callable | None = None,
        sinks: bool = False,
        rngs: nnx.Rngs,
    ):
        _attend.check_dropout_rate(dropout_rate)
        self.attention_fn = _attend.check_attention_fn(attention_fn)
        self.num_heads = num_heads
        self.d_model = _attend.check_width("d_model", _first(d_model, in_features))
        _attend.check_width("out_features", out_features, allow_none=True)
        self.num_kv_heads, self.head_dim = _attend.head_sizes(num_heads, self.d_model, num_kv_heads)
        self.dropout_rate, self.deterministic = dropout_rate, deterministic
        self.dtype, self.param_dtype, self.implementation = dtype, param_dtype, implementation
        self.decode, self.normalize_qk, self.sow_weights = decode, normalize_qk, sow_weights
        self.rope_base = rope_base if rope else None
        self.add_zero_attn = add_zero_attn
        kv_features = self.num_kv_heads * self.head_dim
        in_kv_features = _first(in_kv_features, in_features)

        def linear(d_in, d_out, use_bias, k_init=kernel_init, b_init=bias_init):
            return nnx.Linear(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              precision=precision, kernel_init=k_init, bias_init=b_init,
                              dot_general=projection_dot_general, rngs=rngs)  # faster gradient on CPU

        self.query = linear(in_features, self.d_model, qkv_bias)
        self.key = linear(in_kv_features, kv_features, qkv_bias)
        self.value = linear(_first(in_v_features, in_kv_features), kv_features, qkv_bias)
        self.out = linear(self.d_model, _first(out_features, self.d_model), out_bias,
                          out_kernel_init or kernel_init, out_bias_init or bias_init)
        layer_norm = lambda: nnx.LayerNorm(self.head_dim, use_bias=False, dtype=_attend.norm_dtype(dtype), param_dtype=param_dtype,
                                           rngs=rngs)
        self.query_ln = layer_norm() if normalize_qk else nnx.data(None)
        self.key_ln = layer_norm() if normalize_qk else nnx.data(None)
        if add_bias_kv:
            init = jax.nn.initializers.normal(stddev=1.0 / math.sqrt(kv_features))  # as the linen module
            self.bias_k = nnx.Param(init(rngs.params(), (kv_features,), param_dtype))
            self.bias_v = nnx.Param(init(rngs.params(), (kv_features,), param_dtype))
        else:
            self.bias_k = self.bias_v = nnx.data(None)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else nnx.data(None)
        stream = _dropout_stream(rngs) if dropout_rate > 0 else None
        self.rngs = nnx.data(None) if stream is None else stream.fork()
        self.cached_key = self.cached_value = self.cache_index = self.cached_segment_ids = nnx.data(None)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None, *, segment_ids: bool = False) -> None:
        """Creates an empty decoding cache (flax.nnx's method).

        Args:
          input_shape: `(B…, L, features)`, an input of the maximum length L.
          dtype: of the cached keys/values; default the computation dtype (`dtype`,
            else `param_dtype`).
          segment_ids: also keep each cached token's segment id (`cached_segment_ids`,
            int32 `(B…, L)`); decoding calls then pass `segment_ids`.
        """
        shape = (*input_shape[:-2], self.num_kv_heads, input_shape[-2], self.head_dim)  # (B…, K, L, D)
        dtype = _first(dtype, self.dtype, self.param_dtype)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
        self.cached_segment_ids = nnx.Cache(jnp.zeros(input_shape[:-1], jnp.int32)) if segment_ids else nnx.data(None)

    def _cache(self, decode: bool | None) -> _attend.Cache | None:
        if not _first(decode, self.decode):
            return None
        if self.cached_key is None:
            raise ValueError("decode=True needs a cache: call init_cache(input_shape) first")
        ids = None if self.cached_segment_ids is None else self.cached_segment_ids[...]
        return _attend.Cache(self.cached_key[...], self.cached_value[...], self.cache_index[...], ids)

    def _dropout_rng(self, deterministic, dropout_rng, rngs):
        if self.dropout_rate == 0.0 or _first(deterministic, self.deterministic) or dropout_rng is not None:
            return dropout_rng
        if isinstance(rngs, nnx.Rngs):
            rngs = rngs.dropout if "dropout" in rngs or "default" in rngs else None
        stream = _first(rngs, self.rngs, False)
        if stream is False:
            raise _no_dropout_rng("MultiHeadAttention", self.dropout_rate)
        return stream()

    def _write_cache(self, cache: _attend.Cache) -> None:
        """Stores the decoding step's cache in the `nnx.Cache` variables.

        Raises:
          ValueError: inside a plain JAX transform (`jax.jit`, `jax.lax.scan` over a
            closure), which cannot update them in place.
        """
        try:
            self.cached_key[...], self.cached_value[...], self.cache_index[...] = cache[:3]
            if cache.segment_ids is not None:
                self.cached_segment_ids[...] = cache.segment_ids
        except flax.errors.TraceContextError as error:
            raise _CacheTraceError("decode=True updates the module's nnx.Cache in place, which a plain jax "
                                   "transform cannot: use nnx.jit (or nnx.split the model, nnx.merge it inside "
                                   "and return nnx.state(model, nnx.Cache))") from error

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None = None,
        value: jax.Array | None = None,
        mask: jax.Array | None = None,
        *,
        bias: jax.Array | None = None,
        is_causal: bool = False,
        local_window_size: int | tuple[int | None, int | None] | None = None,
        q_lengths: jax.Array | None = None,
        kv_lengths: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        head_mask: jax.Array | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        logits_soft_cap: float | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
        decode: bool | None = None,
    ):
        """As `jax_mha.MultiHeadAttention.__call__`; `rngs` (an `nnx.Rngs` or stream)
        may replace `dropout_rng`, `decode` overrides the attribute, and sown weights
        go to `nnx.Intermediate` as `attention_weights`. `segment_ids` (int
        `(B…, N)`, self-attention) needs `init_cache(..., segment_ids=True)` when
        decoding.

        Returns:
          `(B…, N, out_features)`, or `(out, weights (B…, H, N, S))`.

        Raises:
          ValueError: as the linen module's; also for decoding without `init_cache`
            or inside a plain JAX transform (use `nnx.jit`), and for dropout with no
            "dropout" stream (neither at construction nor in the call).
        """
        key, value = _attend.check_inputs(query, key, value)
        _attend.check_widths({"query": query, "key": key, "value": value},
                            {name: getattr(self, name).in_features for name in ("query", "key", "value")})
        q = split_heads(self.query(query), self.num_heads)  # (B…, H, N, D)
        k = split_heads(self.key(key), self.num_kv_heads)  # (B…, K, S, D)
        v = split_heads(self.value(value), self.num_kv_heads)  # (B…, K, S, D)
        if self.normalize_qk:
            q, k = _attend.layer_norm(self.query_ln, q, self.dtype), _attend.layer_norm(self.key_ln, k, self.dtype)
        sow = sow_weights or self.sow_weights
        out, weights, cache = _attend.attend(
            q, k, v, mask=mask, bias=bias, is_causal=is_causal, local_window_size=local_window_size,
            q_lengths=q_lengths, kv_lengths=kv_lengths, segment_ids=segment_ids, positions=positions,
            rope_base=self.rope_base,
            cache=self._cache(decode), bias_kv=None if self.bias_k is None else (self.bias_k[...], self.bias_v[...]),
            sinks=None if self.sinks is None else self.sinks[...],
            add_zero_attn=self.add_zero_attn, head_mask=head_mask, need_weights=return_weights or sow,
            dropout_rate=self.dropout_rate, dropout_rng=self._dropout_rng(deterministic, dropout_rng, rngs),
            deterministic=_first(deterministic, self.deterministic), implementation=self.implementation,
            attention_fn=self.attention_fn, score_mod=score_mod, mask_mod=mask_mod, logits_soft_cap=logits_soft_cap,
        )
        if cache is not None:
            self._write_cache(cache)
        if sow:
            self.sow(nnx.Intermediate, "attention_weights", weights)
        out = self.out(combine_heads(out))  # (B…, N, out_features)
        return (out, weights) if return_weights else out


class FeedForward(nnx.Module):
    """Position-wise feed-forward: Linear(d_ff) → GELU → dropout → Linear(d_model)."""

    def __init__(self, d_model: int, d_ff: int, *, dropout_rate: float = 0.0, deterministic: bool = True,
                 dtype: Any = None, param_dtype: Any = jnp.float32, precision: Any = None, rngs: nnx.Rngs):
        _attend.check_dropout_rate(dropout_rate)
        d_model, d_ff = _attend.check_width("d_model", d_model), _attend.check_width("d_ff", d_ff)
        linear = lambda d_in, d_out: nnx.Linear(d_in, d_out, dtype=dtype, param_dtype=param_dtype,
                                                precision=precision, rngs=rngs)
        self.hidden, self.output = linear(d_model, d_ff), linear(d_ff, d_model)
        self.dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=_dropout_stream(rngs))

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        """`(B…, N, d_model) -> (B…, N, d_model)`.

        Raises:
          ValueError: for dropout when `rngs` had no "dropout" (or "default") stream.
        """
        _check_dropout("FeedForward", self.dropout, deterministic)
        h = jax.nn.gelu(self.hidden(x), approximate=False)  # exact GELU, as torch.nn.GELU's default
        return self.output(self.dropout(h, deterministic=deterministic))


class TransformerBlock(nnx.Module):
    """Self-attention + feed-forward with residuals and LayerNorm: the NNX twin of
    `jax_mha.TransformerBlock` (post-norm by default, pre-norm with `pre_norm=True`).
    `num_heads`, `d_ff`, `num_kv_heads`, `dropout_rate`, `attention_dropout_rate`,
    `pre_norm`, `dtype`, `param_dtype`, `precision`, `implementation`, `decode`,
    `normalize_qk`, `rope`, `rope_base`, `sow_weights`, `attention_fn` and `head_dim`
    (None: `d_model // num_heads`; an int D: attention `num_heads * D` wide) are as in
    the linen block.

    Args:
      d_model: the width of the input and output.
      deterministic: the default of the call's `deterministic` (`train()` sets False).
      rngs: `nnx.Rngs` for the initialisers and dropout.

    Raises:
      ValueError: for a `dropout_rate` or `attention_dropout_rate` outside [0, 1).
    """

    def __init__(
        self, d_model: int, num_heads: int, d_ff: int, *, num_kv_heads: int | None = None,
        head_dim: int | None = None, dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0,
        pre_norm: bool = False, deterministic: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
        precision: Any = None, implementation: str | None = "auto", decode: bool = False, normalize_qk: bool = False,
        rope: bool = False, rope_base: float = 10000.0, sow_weights: bool = False, attention_fn: Callable | None = None,
        rngs: nnx.Rngs,
    ):
        _attend.check_dropout_rate(dropout_rate)
        _attend.check_dropout_rate(attention_dropout_rate, "attention_dropout_rate")
        _attend.check_width("d_ff", d_ff)
        self.pre_norm = pre_norm
        head_dim = _attend.check_width("head_dim", head_dim, allow_none=True)
        width = None if head_dim is None else _attend.check_width("num_heads", num_heads) * head_dim  # None: d_model
        self.attention = MultiHeadAttention(
            num_heads, d_model, d_model=width, out_features=None if width is None else d_model,
            num_kv_heads=num_kv_heads, dropout_rate=attention_dropout_rate,
            deterministic=deterministic, dtype=dtype, param_dtype=param_dtype, precision=precision,
            implementation=implementation, decode=decode, normalize_qk=normalize_qk, rope=rope, rope_base=rope_base,
            sow_weights=sow_weights, attention_fn=attention_fn, rngs=rngs,
        )
        norm = lambda: nnx.LayerNorm(d_model, dtype=_attend.norm_dtype(dtype), param_dtype=param_dtype, rngs=rngs)
        self.norm_dtype = dtype
        self.norm1, self.norm2 = norm(), norm()
        self.ffn = FeedForward(d_model, d_ff, dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
                               param_dtype=param_dtype, precision=precision, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate, deterministic=deterministic, rngs=_dropout_stream(rngs))

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None, *, segment_ids: bool = False) -> None:
        """`init_cache` of the attention: `input_shape` `(B…, L, d_model)`."""
        self.attention.init_cache(input_shape, dtype, segment_ids=segment_ids)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool | None = None,
                 return_weights: bool = False, **attention_args):
        """Applies the block.

        Args:
          x: `(B…, N, d_model)`.
          mask: bool, broadcastable to `(B…, H, N, N)`, True = may attend.
          deterministic: overrides the attribute (disables dropout when True).
          return_weights: also return the attention weights.
          **attention_args: keyword arguments of `MultiHeadAttention.__call__`
            (is_causal, bias, local_window_size, q_lengths, kv_lengths, segment_ids, positions,
            head_mask, score_mod, mask_mod, logits_soft_cap, dropout_rng, rngs, sow_weights, decode).

        Returns:
          `(B…, N, d_model)`, or `(y, weights)` with `return_weights=True`.

        Raises:
          ValueError: for dropout when `rngs` had no "dropout" (or "default") stream,
            and as `MultiHeadAttention.__call__`.
        """
        _check_dropout("TransformerBlock", self.dropout, deterministic)
        drop = lambda y: self.dropout(y, deterministic=deterministic)

        def attend(y):
            result = self.attention(y, mask=mask, deterministic=deterministic, return_weights=return_weights,
                                    **attention_args)
            return result if return_weights else (result, None)

        if self.pre_norm:
            a, weights = attend(_attend.layer_norm(self.norm1, x, self.norm_dtype))
            x = x + drop(a)
            x = x + drop(self.ffn(_attend.layer_norm(self.norm2, x, self.norm_dtype), deterministic=deterministic))
        else:
            a, weights = attend(x)
            x = _attend.layer_norm(self.norm1, x + drop(a), self.norm_dtype)
            x = _attend.layer_norm(self.norm2, x + drop(self.ffn(x, deterministic=deterministic)), self.norm_dtype)
        return (x, weights) if return_weights else x


def to_linen_params(module: nnx.Module) -> dict:
    """The module's parameters as the linen twin's `params` dict (same names and
    shapes): `linen_module.apply({"params": to_linen_params(m)}, x)` equals `m(x)`."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """`{path as names: shape}` of a nested dict's leaves."""
    name = lambda entry: str(getattr(entry, "key", getattr(entry, "name", entry)))
    return {tuple(map(name, path)): jnp.shape(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def from_linen_params(module: nnx.Module, params: dict) -> nnx.Module:
    """Loads a linen twin's `params` into `module` (in place) and returns it.

    Nothing is dropped or made up: a parameter the module has no place for (a
    `query/bias` without `qkv_bias=True`, say) or one it lacks is refused, as the
    linen module refuses them (see `jax_mha.interop`).

    Raises:
      ValueError: naming the paths (and the option that gives a parameter its place),
        when the parameter trees differ in names or shapes.
    """
    ours = to_linen_params(module)
    have, want = _shapes(params), _shapes(ours)
    problem = _placement_problem(set(have) - set(want), set(want) - set(have))
    reshaped = sorted(("/".join(p), have[p], want[p]) for p in set(have) & set(want) if have[p] != want[p])
    if reshaped:
        problem = "; ".join(filter(None, [problem, f"shapes (path, given, the module's) differ: {reshaped}"]))
    if problem:
        raise ValueError(f"linen params do not fit the {type(module).__name__}: {problem}")
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, params))
    nnx.update(module, state)
    return module
