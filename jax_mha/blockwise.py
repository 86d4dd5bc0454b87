"""The `"blockwise"` path: query and key blocks, memory linear in N and S.

The tuned engine (`jax_mha._flash`) in blocks, so that no `N x S` array exists in the
forward or the backward pass: peak memory is `O(B·H·(N + S)·D + B·H·q_block·k_block)`
plus any `mask`/`bias` the caller holds.
Key blocks that causality, a window, the lengths, the segment ids or an all-False mask
block rule out are skipped, so causal attention does about half the work and a sliding
window work proportional to N·window.

A `mask_mod` (FlexAttention's mask function) is evaluated block by block, never as an
`(N, S)` array. When it is a function of its indices alone, each query block's range
of key blocks holding a visible key is computed once per (function, shapes) (cached;
FlexAttention's block mask, reduced to one range per query block), so the key loop is
as short as the widest range and a `mask_mod` window runs like `local_window_size`;
inside the range each block is tested on its own index grid and skipped when empty.
With no block sizes given, the blocks follow its span (`mask_mod_span`). Measured
once (2-core shared CPU, B=1, H=8, D=64, N=16,384, forward+backward, a 256-key causal
window): `mask_mod` 1.27 s, `local_window_size` 1.71 s (`experiments/mod_benchmark.py`).

Segment ids (packed sequences): a key block is skipped when the range
`[min, max]` of its keys' ids does not meet the query block's range. For sorted ids
(the packed layout: documents one after another) the ranges are tight and each query
block visits only the key blocks of its own documents, about `N·doc_len` work instead
of `N·S`. Unsorted ids are still exact (every visited block is masked pair by pair),
but their ranges overlap more often, so fewer blocks are skipped.

Default blocks (`default_blocks`): 2048 query rows x 256 keys without a causal or
window pattern, 512 x 512 with one. On one CPU device the engine runs one head at a
time, so a float32 score block is 2 or 1 MiB, cache-sized. Without a pattern nothing
is skipped, and tall query blocks make fewer passes over the keys (each pass re-reads
them and, in the backward, accumulates their gradients); a pattern wants shorter query
blocks so that whole key blocks are skipped. Forward+backward of the core on a 2-core
CPU, (B, H, D) = (1, 8, 64), seconds: N=2048, 2048 x 256 0.29, 1024 x 256 0.30, 512 x
512 0.35, 512 x 1024 0.43-0.45; N=8192, 2048 x 256 5.1, 512 x 1024 7.1. Causal: N=4096,
512 x 512 0.93, 512 x 256 0.98, 512 x 1024 1.21; N=16384, 512 x 512 21.8, 512 x 256
35.5, 512 x 1024 20.3.
"""

from __future__ import annotations

from jax_mha._flash import check_description, run_engine
from jax_mha._masking import Visibility

QUERY_BLOCK_SIZE, KEY_BLOCK_SIZE = 2048, 256  # without a pattern to skip by
PATTERN_BLOCK_SIZE = 512  # square blocks with a causal or window pattern
NARROW_WINDOW = 1024  # a window spanning fewer keys than this gets square blocks of its span
NARROW_MIN_BLOCK = 128  # narrower blocks make matmuls too small to run efficiently on CPU


def _pow2_at_least(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def mask_mod_span(vis: Visibility, n: int, s: int):
    """`(span, sparse)` of a concrete `mask_mod` (None when it closes over traced
    values): the widest run of keys (in 128-key blocks, minus one block) a 128-row
    query block sees, and whether under 3/4 of the blocks hold a visible key. The
    mask function is evaluated once per (function, shapes), 128 rows at a time."""
    import jax
    import jax.numpy as jnp

    from jax_mha._flash import _mask_mod_ranges

    idx = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((1, 1, 1, 1),) * 2 + ((1, 1, 2, 1), (1, 1, 1, 2))]
    if jax.closure_convert(vis.mask_mod, *idx)[1]:
        return None
    bq, bk = min(NARROW_MIN_BLOCK, n), min(NARROW_MIN_BLOCK, s)
    n_pad, s_pad = -(-n // bq) * bq, -(-s // bk) * bk
    batch = 1
    for d in vis.batch_shape:
        batch *= d
    ranges = _mask_mod_ranges(vis.mask_mod, batch, vis.num_heads, n, s, n_pad, s_pad, bq, bk)
    widths = [hi - lo for lo, hi in ranges]
    return max(0, max(widths) - 1) * bk, sum(widths) < 0.75 * len(ranges) * (s_pad // bk)


def default_blocks(is_causal: bool, window, span=None) -> tuple[int, int]:
    """`(query_block_size, key_block_size)` when the caller gives none.

    2048 x 256 without a pattern, 512 x 512 when causal or windowed; for a narrow band,
    square blocks of about its span `w` (a window whose left + right, right counted as
    0 when causal, is under `NARROW_WINDOW` keys; between 128 and 512): a query block
    then visits about `2w` keys where it needs `w + q_block`. On a 2-core CPU (N=4,096,
    a (256, 0) window, forward+backward) 256 x 256 ran 1.4x faster than 512 x 1024.
    `span`: `mask_mod_span`'s `(span, sparse)` for a mask function, read the same way
    (a narrow span gets square blocks of about its width, a sparse one 512 x 512).
    """
    if span is not None and (window is None or window.left is None):
        width, sparse = span
        if width < NARROW_WINDOW:
            side = min(PATTERN_BLOCK_SIZE, max(NARROW_MIN_BLOCK, _pow2_at_least(width)))
            return side, side
        if sparse:
            return PATTERN_BLOCK_SIZE, PATTERN_BLOCK_SIZE
    right = None if window is None else (0 if is_causal else window.right)  # causal: no key after the query
    if window is not None and window.left is not None and right is not None and window.left + right < NARROW_WINDOW:
        side = min(PATTERN_BLOCK_SIZE, max(NARROW_MIN_BLOCK, _pow2_at_least(window.left + right)))
        return side, side
    if is_causal or window is not None:
        return PATTERN_BLOCK_SIZE, PATTERN_BLOCK_SIZE
    return QUERY_BLOCK_SIZE, KEY_BLOCK_SIZE


def run_blockwise(q, k, v, vis: Visibility, *, scale: float, query_block_size=None, key_block_size=None,
                        bad_kv=None):
    """`run_engine` with blocks of at most `query_block_size x key_block_size`
    (clamped to N and S; None: `default_blocks`).

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`, finite.
      vis: the description (`jax_mha._masking.Visibility`, public layout).
      scale, bad_kv: see `run_engine`.

    Returns:
      `(out (B…, H, N, Dv), lse (B…, H, N), touched (B…, H, N))`, as `run_engine`.
    """
    check_description(vis)
    n, s = q.shape[-2], k.shape[-2]
    span = None
    if vis.mask_mod is not None and (query_block_size is None or key_block_size is None):
        span = mask_mod_span(vis, n, s)
    q_default, k_default = default_blocks(vis.is_causal, vis.window, span)
    q_block = q_default if query_block_size is None else query_block_size
    k_block = k_default if key_block_size is None else key_block_size
    return run_engine(q, k, v, vis, scale=scale, q_block=min(q_block, n), k_block=min(k_block, s), bad_kv=bad_kv)


def blockwise_attention(q, k, v, mask=None, bias=None, *, query_block_size=None, key_block_size=None, **kwargs):
    """`jax_mha.attention(..., implementation="blockwise")`: the memory-efficient path.

    Args:
      q, k, v, mask, bias: as in `jax_mha.attention` (`q (B…, H, N, D)`,
        `k, v (B…, K, S, D)`).
      query_block_size: the largest query block; None: `default_blocks`.
      key_block_size: the largest key block; None: `default_blocks`.
      **kwargs: every other keyword of `jax_mha.attention`.

    Returns:
      `out (B…, H, N, D)`, as `attention` does.

    Raises:
      ValueError: as `attention`, naming the bad argument.
      TypeError: as `attention`; also for an `implementation` argument.
    """
    from jax_mha.functional import attention  # functional imports this module

    if "implementation" in kwargs:
        raise TypeError("blockwise_attention always runs implementation='blockwise'; drop the implementation argument")
    return attention(q, k, v, mask, bias, implementation="blockwise", query_block_size=query_block_size,
                     key_block_size=key_block_size, **kwargs)
