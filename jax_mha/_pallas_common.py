"""What the two Pallas translators (`_pallas_tpu`, `_pallas_gpu`) share: refusing the
parts no fused kernel here expresses, flattening the batch, lengths and padding as
segment ids, and the rows that see no key.

Both kernels mask by segment ids: a query attends a key only when their ids are
equal. Lengths, and the padding that brings N and S to a multiple of the kernel's
block, become ids no real token has (below the smallest real id), so a padded key is
never seen and a padded query sees nothing. Both kernels give a row with no visible
key a finite average (their mask value is finite), never NaN; `valid_rows` finds those
rows so the translators return zeros there, as every other path does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

ROW_CHUNK = 512  # query rows per step of `valid_rows` (bounds its (rows, S) booleans)


def refuse(path: str, *, mask, bias, return_weights: bool, dropout_rate: float, deterministic: bool) -> None:
    """ValueError naming the first part of the description `path` cannot express."""
    if bias is not None:
        raise ValueError(f"implementation={path!r} cannot add a bias; use 'xla' or 'blockwise'")
    if mask is not None:
        raise ValueError(f"implementation={path!r} cannot read a dense mask; express it with is_causal, "
                         "local_window_size, q_segment_ids or lengths, or use 'xla'/'blockwise'")
    if return_weights:
        raise ValueError(f"implementation={path!r} never builds the weights: return_weights=True needs 'xla'")
    if dropout_rate > 0.0 and not deterministic:
        raise ValueError(f"implementation={path!r} has no dropout: dropout_rate={dropout_rate} needs 'xla'")


def flat_batch(x, batch: tuple[int, ...], trailing: int) -> jax.Array:
    """`x` with its `trailing` last axes kept, broadcast to `batch` in front and
    flattened to one batch axis: `(prod(batch), *trailing axes)`."""
    x = jnp.asarray(x)
    rest = x.shape[x.ndim - trailing :] if trailing else ()
    return jnp.broadcast_to(x, batch + rest).reshape((math.prod(batch),) + rest)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def segment_ids(ids, lengths, batch: tuple[int, ...], n: int, n_padded: int, pad_offset: int):
    """int32 `(B, n_padded)` ids: the given ones (or 0), and below every real id for
    positions at or past `lengths` and for the padding. `pad_offset` (1 for queries,
    2 for keys) keeps padded queries from seeing padded keys.
    """
    b = math.prod(batch)
    real = jnp.zeros((b, n), jnp.int32) if ids is None else flat_batch(jnp.asarray(ids, jnp.int32), batch, 1)
    pad_id = jnp.min(real, axis=-1, keepdims=True) - pad_offset if ids is not None else jnp.full((b, 1), -pad_offset)
    if lengths is not None:
        lengths = flat_batch(jnp.asarray(lengths, jnp.int32), batch, 0)[:, None]  # (B, 1)
        real = jnp.where(jnp.arange(n)[None, :] < lengths, real, pad_id)
    return jnp.concatenate([real, jnp.broadcast_to(pad_id, (b, n_padded - n))], axis=-1)


def needs_ids(n: int, s: int, n_padded: int, s_padded: int, *parts) -> bool:
    """Whether the kernel needs segment ids: any of `parts` given, or padding."""
    return any(part is not None for part in parts) or n != n_padded or s != s_padded


def valid_rows(n: int, s: int, *, is_causal: bool, window, q_ids, kv_ids) -> jax.Array | None:
    """bool `(B|1, n)`: the real rows that may see at least one real key, or None when
    the pattern statically leaves every row a key. `q_ids (B, Np)` / `kv_ids (B, Sp)`
    are `segment_ids`' padded ids (or None); positions past n and s are padding.

    O(n·s) booleans in query chunks of `ROW_CHUNK` rows: cheap next to attention itself.
    """
    offset = s - n  # bottom-right: query i sits at key position i + offset
    left, right = (None, None) if window is None else window
    if is_causal:
        right = 0 if right is None else min(right, 0)
    static_ok = offset >= 0 or not is_causal  # the diagonal exists for every row
    if q_ids is None and static_ok and (left is None or right is None or left + right >= 0) and offset >= 0:
        return None
    q_ids = jnp.zeros((1, n), jnp.int32) if q_ids is None else q_ids
    kv_ids = jnp.zeros((1, s), jnp.int32) if kv_ids is None else kv_ids
    rows = round_up(n, ROW_CHUNK) if n > ROW_CHUNK else n
    chunk = min(ROW_CHUNK, rows)
    q_ids = jnp.pad(q_ids[:, :n], ((0, 0), (0, rows - n)), constant_values=jnp.iinfo(jnp.int32).min)
    keys = jnp.arange(s)

    def one_chunk(start):
        i = start + jnp.arange(chunk)[:, None] + offset  # (chunk, 1) key position of each query
        ok = jnp.ones((chunk, s), bool)
        if is_causal or right is not None:
            ok &= keys[None] <= i + (0 if right is None else right)
        if left is not None:
            ok &= keys[None] >= i - left
        same = lax.dynamic_slice_in_dim(q_ids, start, chunk, axis=1)[:, :, None] == kv_ids[:, None, :s]
        return (same & ok[None]).any(-1)  # (B, chunk)

    starts = jnp.arange(0, rows, chunk)
    out = lax.map(one_chunk, starts)  # (C, B, chunk)
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], rows)[:, :n]
