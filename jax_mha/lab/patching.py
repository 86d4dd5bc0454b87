"""Head patching: run a model, cache every head's output (and its q, k, v), rerun it with
one head's output — or its query, key or value — taken from another run, zeroed, or
replaced by its mean (activation patching, Meng et al. 2022; Wang et al. 2023,
"Interpretability in the Wild"; mean ablation as in Olsson et al. 2022).

What a model must offer is one function, wrapped in a `HeadModel`:

    apply(params, inputs, gates, *, attention_fn=None) -> logits

with `gates` float `(num_layers, H)` multiplying every head's output (1 keeps, 0
removes; `jax_mha`'s `head_mask`) and `attention_fn` passed to every attention layer
(`jax_mha.MultiHeadAttention(attention_fn=...)`, linen or NNX: flax's hook, called with
`jax_mha.attention`'s signature instead of it). Patching lives in that hook: it sees the
layer's `q (B, H, N, D)`, `k (B, K, S, D)`, `v (B, K, S, Dv)` after the projections (and
RoPE, QK-norm), and returns the per-head outputs `(B, H, N, Dv)` before the gates and the
output projection. Layers are numbered in the order the forward pass calls attention.
`jax_mha.lab.models.Decoder` is turned into a `HeadModel` by `as_head_model`; a user's
own linen or NNX model is wrapped by hand (docs/results/own_model.md has an NNX example).

Grouped-query attention (K < H key/value heads): a key or value patch names either a
key/value head, which every query head of its group reads (`kv_scope="group"`), or a
query head, which alone then reads the patched key/value while the rest of its group
keeps the original (`kv_scope="query"`; query head h reads key/value head
`h // (H // K)`, as `jax_mha.attention` groups them).

Everything is jit-safe: the layer and head of a patch may be traced (so `vmap` over
every head patches them all in one compiled call, `patch_each_head`), and the cache is
returned from the traced function, never kept in Python state across calls.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax_mha.functional import attention

SITES = ("out", "q", "k", "v")  # what a patch replaces: a head's output, or its query / key / value
MODES = ("replace", "zero", "mean")
KV_SCOPES = ("group", "query")


@dataclasses.dataclass(frozen=True, eq=False)
class HeadModel:
    """A model as the analyses and the patching see it.

    Attributes:
      apply: `(params, inputs, gates, *, attention_fn=None) -> logits`: inputs int
        `(B, T)`, gates float `(num_layers, H)`, logits float `(B, T, V)`. The analyses
        of `jax_mha.lab.analysis` that need no weights (importance, the oracle,
        pruning, bpc) call it without `attention_fn`, so a function of three
        arguments serves them; attention maps and patching pass `attention_fn`.
      num_layers: attention layers, each calling `attention_fn` once per forward pass.
      num_heads: H, query heads per layer.
      vocab_size: V, for the probes that draw random tokens (None: not known).

    Compared by identity (`eq=False`): keep one instance per model, and the jitted
    analyses compile once for it.
    """

    apply: Callable[..., jax.Array]
    num_layers: int
    num_heads: int
    vocab_size: int | None = None

    def __post_init__(self):
        if not callable(self.apply):
            raise TypeError(f"apply must be a callable (params, inputs, gates, *, attention_fn=None) -> logits, "
                            f"got {self.apply!r}")
        for field in ("num_layers", "num_heads"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")

    @property
    def gate_shape(self) -> tuple[int, int]:
        """`(num_layers, H)`."""
        return (self.num_layers, self.num_heads)


@functools.lru_cache(maxsize=64)
def _decoder_model(decoder) -> HeadModel:
    """The `HeadModel` of a `Decoder`, one per (hashable) decoder: compiled analyses reuse it."""

    def apply(params, inputs, gates, *, attention_fn=None):
        module = decoder if attention_fn is None else decoder.clone(attention_fn=attention_fn)
        return module.apply({"params": params}, inputs, head_mask=gates)

    cfg = decoder.config
    return HeadModel(apply, cfg.num_layers, cfg.num_heads, cfg.vocab_size)


def as_head_model(model: Any) -> HeadModel:
    """`model` as a `HeadModel`: itself, or the adapter of a `jax_mha.lab.models.Decoder`.

    Raises:
      TypeError: for anything else, saying how to wrap it.
    """
    from jax_mha.lab.models import Decoder  # here: models imports nothing of this module, keep the import cheap

    if isinstance(model, HeadModel):
        return model
    if isinstance(model, Decoder):
        return _decoder_model(model)
    raise TypeError(f"model must be a HeadModel or a jax_mha.lab.models.Decoder, got {type(model).__name__}; wrap "
                    "your own as HeadModel(apply=lambda params, inputs, gates, attention_fn=None: logits, "
                    "num_layers=..., num_heads=...)")


def set_attention_fn(module, attention_fn: Callable | None):
    """Sets `attention_fn` on every `jax_mha.nnx.MultiHeadAttention` inside an NNX module
    (NNX modules are Python objects: call it on the copy `nnx.merge` makes inside
    `apply`, never on the model a caller holds). Returns `module`.

    Raises:
      ValueError: if the module holds no `jax_mha.nnx.MultiHeadAttention`.
    """
    from flax import nnx

    from jax_mha.nnx import MultiHeadAttention

    layers = [m for _, m in nnx.iter_graph(module) if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise ValueError(f"{type(module).__name__} holds no jax_mha.nnx.MultiHeadAttention to hook")
    for layer in layers:
        layer.attention_fn = attention_fn
    return module


def check_gates(model: HeadModel, gates) -> jax.Array:
    """float32 `(num_layers, H)` gates; all ones for None.

    Raises:
      ValueError: for another shape.
    """
    if gates is None:
        return jnp.ones(model.gate_shape, jnp.float32)
    gates = jnp.asarray(gates, jnp.float32)
    if gates.shape != model.gate_shape:
        raise ValueError(f"gates must have shape (num_layers, num_heads) = {model.gate_shape}, got {gates.shape}")
    return gates


class HeadCache(NamedTuple):
    """Every attention layer's per-head tensors from one forward pass, one entry per layer.

    Attributes:
      q: `(B, H, N, D)` per layer: the queries attention received (before any patch).
      k: `(B, K, S, D)` per layer: the keys (K key/value heads), before any patch.
      v: `(B, K, S, Dv)` per layer: the values, before any patch.
      out: `(B, H, N, Dv)` per layer: each head's output as it went on (after a patch),
        before the gates and the output projection.
      weights: `(B, H, N, S)` per layer when asked for (`run_with_cache(weights=True)`), else None.
    """

    q: tuple[jax.Array, ...]
    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    out: tuple[jax.Array, ...]
    weights: tuple[jax.Array, ...] | None = None


@dataclasses.dataclass(frozen=True)
class _Patch:
    """What to patch (static); where (`layer`, `head`, traced) travels beside it."""

    site: str
    mode: str
    kv_scope: str = "group"


def _head_mask(num: int, head, active) -> jax.Array:
    """bool `(num,)`: True at `head` when `active` (both may be traced)."""
    return (jnp.arange(num) == head) & active


def _swap(x: jax.Array, source: jax.Array | None, mode: str, mask: jax.Array) -> jax.Array:
    """`x (B…, heads, N, D)` with the heads in `mask (heads,)` replaced: by `source`'s,
    by zeros, or by `source`'s mean over the batch axes (per position)."""
    if mode == "zero":
        new = jnp.zeros_like(x)
    elif mode == "mean":
        new = jnp.broadcast_to(jnp.mean(source, axis=tuple(range(source.ndim - 3)), keepdims=True), x.shape)
    else:
        new = source
    return jnp.where(mask[:, None, None], new.astype(x.dtype), x)


def _patch_kv(q, k, v, src: HeadCache | None, i: int, patch: _Patch, layer, head):
    """k, v with the patch of layer `i` applied; with `kv_scope="query"` both come back
    expanded to one key/value head per query head."""
    name = patch.site
    x = {"k": k, "v": v}
    source = None if src is None else {"k": src.k[i], "v": src.v[i]}
    if patch.kv_scope == "query":
        groups = q.shape[-3] // k.shape[-3]
        x = {n: jnp.repeat(t, groups, axis=-3) for n, t in x.items()}  # (B…, H, S, ·): query head h reads h // groups
        if source is not None:
            source = {n: jnp.repeat(t, groups, axis=-3) for n, t in source.items()}
    mask = _head_mask(x[name].shape[-3], head, layer == i)
    x[name] = _swap(x[name], None if source is None else source[name], patch.mode, mask)
    return x["k"], x["v"]


def _hook(records: list, patch: _Patch | None, src: HeadCache | None, layer, head, want_weights: bool):
    """An `attention_fn` that records each call's tensors into `records` and applies `patch`."""

    def attention_fn(q, k, v, *, return_weights: bool = False, **kwargs):
        i = len(records)  # the layer: calls come in forward order, one per layer
        q_in, k_in, v_in = q, k, v
        if patch is not None and patch.site == "q":
            q = _swap(q, None if src is None else src.q[i], patch.mode, _head_mask(q.shape[-3], head, layer == i))
        elif patch is not None and patch.site in ("k", "v"):
            k, v = _patch_kv(q, k, v, src, i, patch, layer, head)
        need = return_weights or want_weights
        result = attention(q, k, v, return_weights=need, **kwargs)
        out, weights = result if need else (result, None)
        if patch is not None and patch.site == "out":
            out = _swap(out, None if src is None else src.out[i], patch.mode,
                        _head_mask(out.shape[-3], head, layer == i))
        records.append((q_in, k_in, v_in, out, weights))
        return (out, weights) if return_weights else out

    return attention_fn


def _forward(model: HeadModel, params, inputs, gates, patch, src, layer, head, want_weights):
    """`(logits, HeadCache)` of one forward pass through the hook."""
    records: list = []
    logits = model.apply(params, inputs, gates, attention_fn=_hook(records, patch, src, layer, head, want_weights))
    if len(records) != model.num_layers:
        raise ValueError(f"the model called attention_fn {len(records)} times in one forward pass, its HeadModel says "
                         f"num_layers={model.num_layers}: every attention layer must pass attention_fn on, once")
    q, k, v, out, weights = zip(*records)
    return logits, HeadCache(q, k, v, out, weights if want_weights else None)


@functools.partial(jax.jit, static_argnames=("model", "patch", "want_weights"))
def _run(params, model, inputs, gates, patch, src, layer, head, want_weights):
    return _forward(model, params, inputs, gates, patch, src, layer, head, want_weights)


def run_with_cache(model, params, inputs: jax.Array, *, gates=None, weights: bool = False):
    """Runs the model once and keeps every head's tensors; jitted (compiled once per model and shapes).

    Args:
      model: a `HeadModel` (or a `Decoder`, see `as_head_model`).
      params: its parameters (any pytree `model.apply` takes).
      inputs: int `(B, T)`.
      gates: float `(num_layers, H)` head gates (default all ones).
      weights: also keep the attention weights `(B, H, T, T)` of every layer.

    Returns:
      `(logits (B, T, V), HeadCache)`.

    Raises:
      ValueError: for gates of the wrong shape, or a model that does not call
        `attention_fn` once per layer.
    """
    model = as_head_model(model)
    return _run(params, model, inputs, check_gates(model, gates), None, None, 0, 0, weights)


def _check_patch(model: HeadModel, site: str, mode: str, kv_scope: str, source, layer, head) -> _Patch:
    for name, value, allowed in (("site", site, SITES), ("mode", mode, MODES), ("kv_scope", kv_scope, KV_SCOPES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if mode != "zero" and source is None:
        raise ValueError(f"mode={mode!r} takes its values from a source: pass source=HeadCache of a run "
                         "(run_with_cache), or use mode='zero'")
    if source is not None and not isinstance(source, HeadCache):
        raise TypeError(f"source must be a HeadCache (run_with_cache), got {type(source).__name__}")
    kv_heads = site in ("k", "v") and kv_scope == "group"
    heads = (None if source is None else source.k[0].shape[-3]) if kv_heads else model.num_heads
    for name, value, bound in (("layer", layer, model.num_layers), ("head", head, heads)):
        concrete = isinstance(value, int) and not isinstance(value, bool)  # a traced index is not checked
        if concrete and bound is not None and not 0 <= value < bound:
            raise ValueError(f"{name}={value} is outside [0, {bound})")
    return _Patch(site, mode, kv_scope if site in ("k", "v") else "group")


def run_patched(model, params, inputs: jax.Array, *, layer, head, site: str = "out", mode: str = "replace",
                source: HeadCache | None = None, gates=None, kv_scope: str = "group", return_cache: bool = False):
    """Runs the model with one head patched; jitted, `layer` and `head` may be traced.

    Args:
      model: a `HeadModel` (or a `Decoder`).
      params: its parameters.
      inputs: int `(B, T)`, the run being patched (e.g. the corrupted prompt).
      layer: which attention layer, int or int32 scalar in [0, num_layers).
      head: which head, int or int32 scalar: a query head in [0, H) for `site` "out"
        and "q", and for "k"/"v" with `kv_scope="query"`; a key/value head in [0, K)
        for "k"/"v" with `kv_scope="group"`.
      site: "out" (the head's output), "q", "k" or "v".
      mode: "replace" (the same layer and head of `source`, position by position),
        "zero", or "mean" (`source`'s mean over its batch, per position).
      source: the `HeadCache` of another run (`run_with_cache`), with the same shapes
        for "replace", any batch size for "mean"; unused for "zero".
      gates: float `(num_layers, H)` head gates of the patched run (default all ones).
      kv_scope: for "k"/"v" under grouped-query attention: "group" patches the
        key/value head for its whole group, "query" for one query head only.
      return_cache: also return the patched run's `HeadCache` (its `out` holds the
        patched head as it went on, the later layers' tensors what the patch caused).

    Returns:
      logits `(B, T, V)` of the patched run, or `(logits, HeadCache)`.

    Raises:
      ValueError: for an unknown site, mode or kv_scope, a missing source, a concrete
        layer or head out of range, or gates of the wrong shape.
      TypeError: for a source that is not a HeadCache.
    """
    model = as_head_model(model)
    patch = _check_patch(model, site, mode, kv_scope, source, layer, head)
    logits, cache = _run(params, model, inputs, check_gates(model, gates), patch, source, layer, head, False)
    return (logits, cache) if return_cache else logits


@functools.partial(jax.jit, static_argnames=("model", "patch", "metric"))
def _each_head(params, model, inputs, gates, patch, source, metric):
    num = model.num_heads if patch.site in ("out", "q") or patch.kv_scope == "query" else source.k[0].shape[-3]
    layers, heads = jnp.meshgrid(jnp.arange(model.num_layers), jnp.arange(num), indexing="ij")
    one = lambda l, h: metric(_forward(model, params, inputs, gates, patch, source, l, h, False)[0])
    return jax.vmap(one)(layers.ravel(), heads.ravel()).reshape(layers.shape)


def patch_each_head(model, params, inputs: jax.Array, metric: Callable[[jax.Array], jax.Array], *,
                    site: str = "out", mode: str = "replace", source: HeadCache | None = None, gates=None,
                    kv_scope: str = "group") -> jax.Array:
    """`metric` of the run with each head patched in turn, all in one vmapped, jitted call.

    `model`, `params`, `inputs`, `site`, `mode`, `source`, `gates` and `kv_scope` are
    as in `run_patched`. With "zero" and site "k"/"v" in the group scope, `source` is
    still needed: it tells how many key/value heads there are.

    Args:
      metric: logits `(B, T, V)` -> scalar (e.g. the logit difference of the right
        answer); a static argument: pass one function object, not a fresh lambda per call.

    Returns:
      float `(num_layers, heads)`: entry `(l, h)` is the metric with head h of layer l patched.

    Raises:
      ValueError, TypeError: as `run_patched`.
    """
    model = as_head_model(model)
    if site in ("k", "v") and kv_scope == "group" and source is None:
        raise ValueError("patch_each_head over key/value heads needs source= (it holds K, the key/value heads)")
    patch = _check_patch(model, site, mode, kv_scope, source, 0, 0)
    return _each_head(params, model, inputs, check_gates(model, gates), patch, source, metric)
