"""Flax linen modules: they create parameters and call the functional core, nothing more.

`MultiHeadAttention` projects with plain `nn.Dense` layers and hands the heads to
`jax_mha._attend.attend` (RoPE, the decoding cache step, PyTorch's extra keys, head
gates), which calls `jax_mha.attention`. `jax_mha.nnx` holds the same modules in
`flax.nnx`, with the same parameter names and shapes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict

from jax_mha import _attend
from jax_mha.functional import combine_heads, split_heads
from jax_mha.interop import _attention_parameters, _placement_problem
from jax_mha.nn.projection import projection_dot_general


class _FlaxCompatibleValueError(ValueError):
    """A one-line ValueError that code catching flax's error for the same mistake (a
    second base class) still catches; flax's link to its error page is left out."""

    def __init__(self, message: str):
        Exception.__init__(self, message)

    def __reduce__(self):
        return type(self), (str(self),)


class _CacheImmutableError(_FlaxCompatibleValueError, flax.errors.ModifyScopeVariableError):
    """Decoding applied without `mutable=["cache"]`."""


class _NoDropoutRngError(_FlaxCompatibleValueError, flax.errors.InvalidRngError):
    """Dropout applied without a "dropout" rng."""


def _require_mutable_cache(module: nn.Module) -> None:
    """Raises, before any write, when decoding cannot write the "cache" collection."""
    if not module.is_mutable_collection("cache"):
        raise _CacheImmutableError(f'{type(module).__name__}(decode=True) writes the "cache" collection at every '
                                   'step: call apply(variables, x, mutable=["cache"]) and keep the returned cache')


def _require_dropout_rng(module: nn.Module, rate: float, deterministic: bool, key_argument: bool = False) -> None:
    """Raises when dropout at `rate` will run (not `deterministic`) without a "dropout" rng."""
    if rate > 0.0 and not deterministic and not module.has_rng("dropout"):
        argument = " or dropout_rng=key" if key_argument else ""
        raise _NoDropoutRngError(f'{type(module).__name__}: dropout_rate={rate} with deterministic=False needs a '
                                 f'"dropout" rng: pass apply(..., rngs={{"dropout": key}}){argument}, '
                                 'or set deterministic=True')


def extra_kv_init(features: int) -> Callable:
    """Initialiser of `bias_k`/`bias_v` `(K*D,)`: N(0, 1/(K*D)), what PyTorch's
    `xavier_normal_` gives its `(1, 1, E)` tensors."""
    return nn.initializers.normal(stddev=1.0 / math.sqrt(features))


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, §3.2.2) with GQA/MQA, a KV cache,
    QK-norm, RoPE and head gates.

    Parameters are plain `nn.Dense` layers: `query/kernel (d_q, H*D)`,
    `key/kernel (d_k, K*D)`, `value/kernel (d_v, K*D)`, `out/kernel (H*D, out_features)`;
    head `h` owns columns `h*D:(h+1)*D` of the query kernel (the `split_heads`
    layout). With `normalize_qk`: `query_ln/scale (D,)` and `key_ln/scale (D,)`
    (flax's names and shapes). With `add_bias_kv`: `bias_k (K*D,)`, `bias_v (K*D,)`.

    Decoding (`decode=True`, flax's scheme): `init` with an input of the maximum
    length L creates the `"cache"` collection: `cached_key (B…, K, L, D)`,
    `cached_value (B…, K, L, D)` (our head-major layout; flax's is `(B…, L, K, D)`)
    and `cache_index` (int32). Each `apply(..., mutable=["cache"])` then takes the
    next token, or a chunk of n tokens, writes its keys and values at `cache_index`
    and attends causally to everything written so far (`is_causal` is implied); RoPE
    positions continue from `cache_index`. Writing past L raises a `ValueError`
    outside jit; under jit, where the index is traced, the outputs of such a call
    are NaN instead.

    Given weights (`apply({"params": params}, ...)`, e.g. from `jax_mha.interop`)
    must fit the options: a parameter the module has no place for (a `query/bias`
    without `qkv_bias=True`, an `out/bias` with `out_bias=False`, `bias_k` without
    `add_bias_kv`, `query_ln` without `normalize_qk`), which flax would silently
    ignore, raises a `ValueError` naming the option, as does one it needs and lacks.

    Attributes:
      num_heads: H, query heads.
      d_model: H*D (flax's `qkv_features`); default: the last dim of `query`.
      num_kv_heads: K, key/value heads (default H; 1 = multi-query attention).
      out_features: width of the output; default `d_model`.
      qkv_bias: biases on the query/key/value projections.
      out_bias: bias on the output projection.
      dropout_rate: dropout on the attention weights (rng collection "dropout"), in
        [0, 1) (checked at construction).
      dtype: computation dtype (e.g. jnp.bfloat16); None = inferred from inputs.
      param_dtype: parameter dtype.
      precision: `jax.lax.Precision` of the four projections. The attention itself
        always scales and soft-maxes in float32 (unlike flax, it takes no precision).
      kernel_init, bias_init: initialisers of the projections (xavier-uniform and
        zeros, as in the seeds).
      out_kernel_init, out_bias_init: of the output projection; default the above.
      implementation: see `jax_mha.attention`.
      decode: keep a KV cache and decode (see above).
      normalize_qk: QK-norm (Dehghani et al. 2023): LayerNorm without bias over each
        head's q and k before the logits.
      rope: rotary position embeddings on q and k (Su et al. 2021; rotate-half).
      rope_base: RoPE's wavelength base.
      sow_weights: always sow the weights into "intermediates" (see `__call__`).
      add_bias_kv: PyTorch's: a learned key and value every query also attends to.
      add_zero_attn: PyTorch's: a zero key and value every query also attends to.
      sinks: attention sinks (gpt-oss): a parameter `sinks (H,)`, zeros at init, one
        logit per head for a virtual key of value zero (see `jax_mha.attention`).
      attention_fn: flax's hook: a callable with `jax_mha.attention`'s signature,
        called instead of it (default None: `jax_mha.attention`). It receives the heads
        `q (B…, H, N, D)`, `k, v (B…, K, S, D)` after RoPE (and the cache step) and
        the keywords `mask, bias, is_causal, local_window_size, q_lengths,
        kv_lengths, q_segment_ids, kv_segment_ids, return_weights, dropout_rate,
        dropout_rng, deterministic, implementation`, plus `score_mod`, `mask_mod`,
        `logits_soft_cap` when the call gives them; it returns `(B…, H, N, Dv)`, or
        `(out, weights)` when `return_weights`. Fix core options for every call with
        `functools.partial(jax_mha.attention, ...)`; `jax_mha.parallel.ring_attention_fn`
        splits the sequence over a mesh. Not a callable: `TypeError` at construction.
    """

    num_heads: int
    d_model: int | None = None
    num_kv_heads: int | None = None
    out_features: int | None = None
    qkv_bias: bool = False
    out_bias: bool = True
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.zeros
    out_kernel_init: Callable | None = None
    out_bias_init: Callable | None = None
    implementation: str | None = "auto"
    decode: bool = False
    normalize_qk: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    sow_weights: bool = False
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    attention_fn: Callable | None = None
    sinks: bool = False

    def __post_init__(self):
        _attend.check_dropout_rate(self.dropout_rate)
        _attend.check_attention_fn(self.attention_fn)
        _attend.check_width("num_heads", self.num_heads)
        _attend.check_width("d_model", self.d_model, allow_none=True)
        _attend.check_width("num_kv_heads", self.num_kv_heads, allow_none=True)
        _attend.check_width("out_features", self.out_features, allow_none=True)
        super().__post_init__()

    def _built_widths(self) -> dict:
        """`{name: input width}` of the query/key/value kernels that already exist
        (empty while `init` has not created them yet)."""
        params = self.variables.get("params", {})
        widths = {}
        for name in ("query", "key", "value"):
            kernel = params.get(name, {}).get("kernel")
            if kernel is not None:
                widths[name] = nn.meta.unbox(kernel).shape[0]  # (d_in, features)
        return widths

    def _check_loaded_params(self) -> None:
        """Refuses given parameters this configuration has no place for (flax would
        ignore them silently) or lacks (see `jax_mha.interop`).

        Raises:
          ValueError: naming the parameters and the option to change.
        """
        params = self.variables.get("params")
        if self.is_initializing() or not params:
            return
        have = set(flatten_dict(params))
        want = _attention_parameters({"qkv_bias": self.qkv_bias, "out_bias": self.out_bias,
                                      "normalize_qk": self.normalize_qk, "add_bias_kv": self.add_bias_kv,
                                      "sinks": self.sinks})
        missing = set() if self.is_mutable_collection("params") else want - have  # mutable: flax may create them
        problem = _placement_problem(have - want, missing)
        if problem:
            raise ValueError(f"MultiHeadAttention params: {problem}")

    def _dense(self, features: int, name: str, use_bias: bool, out: bool = False) -> nn.Dense:
        return nn.Dense(
            features, use_bias=use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
            precision=self.precision, name=name, dot_general=projection_dot_general,  # faster gradient on CPU
            kernel_init=(self.out_kernel_init or self.kernel_init) if out else self.kernel_init,
            bias_init=(self.out_bias_init or self.bias_init) if out else self.bias_init,
        )

    def _layer_norm(self, name: str) -> nn.LayerNorm:
        return nn.LayerNorm(use_bias=False, dtype=_attend.norm_dtype(self.dtype), param_dtype=self.param_dtype,
                            name=name)

    def _cache(self, k: jax.Array, v: jax.Array, segment_ids=None) -> _attend.Cache | None:
        """The cache to decode with, or None when not decoding or while `init`
        creates it (flax's rule: the first call runs the plain forward pass).

        Raises:
          ValueError: when decoding outside `init` without a cache (`apply` would
            otherwise run a plain non-causal pass and create a 1-token cache).
        """
        if not self.decode:
            return None
        initialized = self.has_variable("cache", "cached_key")
        if not initialized and not self.is_initializing():
            raise ValueError('decode=True needs the "cache" collection from init (with an input of the maximum '
                             'length): apply({"params": params, "cache": cache}, x, mutable=["cache"])')
        if initialized:
            _require_mutable_cache(self)
        key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        ids = None
        if self.has_variable("cache", "cached_segment_ids") or (not initialized and segment_ids is not None):
            # Kept only when init saw segment_ids: each cached token's segment (B…, L).
            ids = self.variable("cache", "cached_segment_ids", jnp.zeros, k.shape[:-3] + k.shape[-2:-1], jnp.int32)
        return _attend.Cache(key.value, value.value, index.value, None if ids is None else ids.value) \
            if initialized else None

    def _extra_kv(self, features: int):
        if not self.add_bias_kv:
            return None
        return tuple(self.param(name, extra_kv_init(features), (features,), self.param_dtype)
                     for name in ("bias_k", "bias_v"))

    @nn.compact
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
        deterministic: bool = True,
        dropout_rng: jax.Array | None = None,
        return_weights: bool = False,
        sow_weights: bool = False,
    ):
        """Attends from `query` to `key`/`value`.

        Args:
          query: `(B…, N, d_q)`.
          key: `(B…, S, d_k)`; defaults to `query` (self-attention).
          value: `(B…, S, d_v)`; defaults to `key`.
          mask: bool, broadcastable to `(B…, H, N, S)`, True = may attend.
          bias: float, broadcastable to `(B…, H, N, S)`, added to the logits (ALiBi,
            relative positions; `-inf` masks).
          is_causal: apply the causal pattern (see `jax_mha.causal_mask`).
          local_window_size: `(left, right)` or an int, as in `jax_mha.attention`.
          q_lengths, kv_lengths: int broadcastable to `(B…)`: valid queries / keys
            per sequence (rows past `q_lengths` output zeros before `out`).
          segment_ids: int `(B…, N)` of a self-attention call: packed sequences, a
            token attends only to tokens of its own segment (`q_segment_ids` of
            `jax_mha.attention`). With `decode=True`, give them to `init` (the cache
            then keeps each cached token's segment, `cached_segment_ids`) and on
            every decoding call (the new tokens' segments).
          positions: RoPE positions `(N,)` or `(B…, N)` of a self-attention call (e.g.
            for left-padded prompts); default `0 … N-1`, or from `cache_index`.
          head_mask: float `(H,)` or broadcastable to `(B…, H)`; multiplies each head's
            output before the heads are combined (0 removes a head).
          score_mod, mask_mod, logits_soft_cap: as in `jax_mha.attention`
            (FlexAttention's score and mask functions, Gemma 2's soft cap); passed to
            `attention_fn` only when given, like `local_window_size` a per-call
            option (fix one for every call with `attention_fn=functools.partial(...)`).
          deterministic: disables dropout.
          dropout_rng: key for the weights' dropout; default `make_rng("dropout")`.
          return_weights: also return the attention weights.
          sow_weights: sow the weights into "intermediates" as `attention_weights`
            (flax's name; `apply(..., mutable=["intermediates"])` returns them).

        Returns:
          `(B…, N, out_features)`, or `(out, weights (B…, H, N, S))` with
          `return_weights` (S grows by one per `add_bias_kv`/`add_zero_attn` key,
          whose columns come last, as in PyTorch; L when decoding).

        Raises:
          ValueError: naming the numbers, for indivisible head counts, a key/value
            length or batch mismatch, inputs of rank < 2, input widths other than the
            existing kernels', a bad mask/head_mask, decoding past the cache,
            decoding without the cache from `init` or without `mutable=["cache"]`,
            dropout without a "dropout" rng or `dropout_rng`, and given `params` with
            a parameter this configuration has no place for (or lacks; the message
            names the option, e.g. `qkv_bias=True`).
        """
        key, value = _attend.check_inputs(query, key, value)
        _attend.check_widths({"query": query, "key": key, "value": value}, self._built_widths())
        self._check_loaded_params()
        d_model = self.d_model if self.d_model is not None else query.shape[-1]
        kv_heads, head_dim = _attend.head_sizes(self.num_heads, d_model, self.num_kv_heads)
        q = split_heads(self._dense(d_model, "query", self.qkv_bias)(query), self.num_heads)  # (B…, H, N, D)
        k = split_heads(self._dense(kv_heads * head_dim, "key", self.qkv_bias)(key), kv_heads)  # (B…, K, S, D)
        v = split_heads(self._dense(kv_heads * head_dim, "value", self.qkv_bias)(value), kv_heads)  # (B…, K, S, D)
        if self.normalize_qk:
            q = _attend.layer_norm(self._layer_norm("query_ln"), q, self.dtype)
            k = _attend.layer_norm(self._layer_norm("key_ln"), k, self.dtype)
        cache = self._cache(k, v, segment_ids)
        sow = sow_weights or self.sow_weights
        if self.dropout_rate > 0.0 and not deterministic and dropout_rng is None:
            _require_dropout_rng(self, self.dropout_rate, deterministic, key_argument=True)
            dropout_rng = self.make_rng("dropout")
        out, weights, cache = _attend.attend(
            q, k, v, mask=mask, bias=bias, is_causal=is_causal, local_window_size=local_window_size,
            q_lengths=q_lengths, kv_lengths=kv_lengths, segment_ids=segment_ids, positions=positions,
            rope_base=self.rope_base if self.rope else None, cache=cache,
            bias_kv=self._extra_kv(kv_heads * head_dim), add_zero_attn=self.add_zero_attn,
            head_mask=head_mask, need_weights=return_weights or sow, dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng, deterministic=deterministic, implementation=self.implementation,
            attention_fn=self.attention_fn, score_mod=score_mod, mask_mod=mask_mod, logits_soft_cap=logits_soft_cap,
            sinks=self.param("sinks", nn.initializers.zeros, (self.num_heads,), self.param_dtype) if self.sinks else None,
        )
        if cache is not None:
            for name, x in zip(("cached_key", "cached_value", "cache_index", "cached_segment_ids"), cache):
                if x is not None:
                    self.put_variable("cache", name, x)
        if sow:
            self.sow("intermediates", "attention_weights", weights)
        out_features = self.out_features if self.out_features is not None else d_model
        out = self._dense(out_features, "out", self.out_bias, out=True)(combine_heads(out))  # (B…, N, out)
        return (out, weights) if return_weights else out


class FeedForward(nn.Module):
    """Position-wise feed-forward: Dense(d_ff) → GELU → dropout → Dense(d_model)."""

    d_ff: int
    dropout_rate: float = 0.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    def __post_init__(self):
        _attend.check_dropout_rate(self.dropout_rate)
        _attend.check_width("d_ff", self.d_ff)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """`(B…, N, d_model) -> (B…, N, d_model)`.

        Raises:
          ValueError: for dropout (`deterministic=False`) without a "dropout" rng.
        """
        _require_dropout_rng(self, self.dropout_rate, deterministic)
        dense = lambda features, name: nn.Dense(
            features, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, name=name
        )
        h = dense(self.d_ff, "hidden")(x)
        h = nn.gelu(h, approximate=False)  # exact GELU, as torch.nn.GELU's default
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        return dense(x.shape[-1], "output")(h)


class TransformerBlock(nn.Module):
    """Self-attention + feed-forward, each with a residual and LayerNorm.

    Post-norm (the seeds' and Vaswani et al.'s order) by default:
      `x = LN(x + Dropout(MHA(x)))`, `x = LN(x + Dropout(FFN(x)))`.
    Pre-norm (`pre_norm=True`, trains more stably when deep):
      `x = x + Dropout(MHA(LN(x)))`, `x = x + Dropout(FFN(LN(x)))`.

    Decoding: with `decode=True` the attention keeps a KV cache (see
    `MultiHeadAttention`); `init` with an input of the maximum length, then apply
    token by token (or chunk by chunk) with `mutable=["cache"]`. Everything else in
    the block works per token, so the outputs equal the full causal forward pass.

    Attributes:
      num_heads: attention heads H.
      d_ff: feed-forward hidden width.
      num_kv_heads: key/value heads (GQA/MQA); default H.
      dropout_rate: dropout on the residual branches and inside the feed-forward.
      attention_dropout_rate: dropout on the attention weights.
        (Both in [0, 1), checked at construction: a `ValueError` names the value.)
      pre_norm: LayerNorm before each sub-layer instead of after the residual.
      dtype, param_dtype: computation and parameter dtypes.
      precision: precision of every projection (attention and feed-forward).
      implementation: attention implementation, see `jax_mha.attention`.
      decode, normalize_qk, rope, rope_base, sow_weights, attention_fn: as in
        `MultiHeadAttention`.
      head_dim: D, the size of each head. None (default): `d_model // num_heads`.
        An int: the attention projects d_model to `num_heads * head_dim` and back
        (`MultiHeadAttention(d_model=num_heads * head_dim, out_features=d_model)`),
        so num_heads need not divide d_model and the head count and head size vary
        apart (Bhojanapalli et al. 2020). Same parameter names either way.
    """

    num_heads: int
    d_ff: int
    num_kv_heads: int | None = None
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    pre_norm: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: str | None = "auto"
    decode: bool = False
    normalize_qk: bool = False
    rope: bool = False
    rope_base: float = 10000.0
    sow_weights: bool = False
    attention_fn: Callable | None = None
    head_dim: int | None = None

    def __post_init__(self):
        _attend.check_dropout_rate(self.dropout_rate)
        _attend.check_dropout_rate(self.attention_dropout_rate, "attention_dropout_rate")
        _attend.check_attention_fn(self.attention_fn)
        _attend.check_width("d_ff", self.d_ff)
        _attend.check_width("num_heads", self.num_heads)
        _attend.check_width("head_dim", self.head_dim, allow_none=True)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool = True,
                 return_weights: bool = False, **attention_args):
        """Applies the block.

        Args:
          x: `(B…, N, d_model)`.
          mask: bool, broadcastable to `(B…, H, N, N)` (`(B…, H, N, L)` when
            decoding), True = may attend.
          deterministic: disables dropout.
          return_weights: also return the attention weights `(B…, H, N, N)`.
          **attention_args: keyword arguments of `MultiHeadAttention.__call__`
            (is_causal, bias, local_window_size, q_lengths, kv_lengths, segment_ids,
            positions, head_mask, score_mod, mask_mod, logits_soft_cap, dropout_rng
            (the attention weights' dropout; the residual and feed-forward dropouts
            draw from the "dropout" rng collection), sow_weights), as the NNX block.

        Returns:
          `(B…, N, d_model)`, or `(y, weights)` with `return_weights=True`.

        Raises:
          TypeError: for a keyword `MultiHeadAttention.__call__` does not take.
          ValueError: for dropout (`deterministic=False`) without a "dropout" rng,
            and as `MultiHeadAttention.__call__`.
        """
        _require_dropout_rng(self, self.dropout_rate, deterministic)
        width = None if self.head_dim is None else self.num_heads * self.head_dim  # None: d_model
        mha = MultiHeadAttention(
            num_heads=self.num_heads, d_model=width, out_features=None if width is None else x.shape[-1],
            num_kv_heads=self.num_kv_heads, dropout_rate=self.attention_dropout_rate,
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            implementation=self.implementation, decode=self.decode, normalize_qk=self.normalize_qk,
            rope=self.rope, rope_base=self.rope_base, sow_weights=self.sow_weights, attention_fn=self.attention_fn,
            name="attention",
        )
        norm1 = functools.partial(_attend.layer_norm, nn.LayerNorm(
            dtype=_attend.norm_dtype(self.dtype), param_dtype=self.param_dtype, name="norm1"), dtype=self.dtype)
        norm2 = functools.partial(_attend.layer_norm, nn.LayerNorm(
            dtype=_attend.norm_dtype(self.dtype), param_dtype=self.param_dtype, name="norm2"), dtype=self.dtype)
        ffn = FeedForward(self.d_ff, self.dropout_rate, self.dtype, self.param_dtype, self.precision, name="ffn")
        drop = lambda y: nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)

        def attend(y):
            result = mha(y, mask=mask, deterministic=deterministic, return_weights=return_weights, **attention_args)
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
