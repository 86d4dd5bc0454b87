"""The `"blockwise"` path: query and key blocks, memory linear in N and S.

The tuned engine (`jax_mha.paths.engine`) in blocks, so that no `N x S` array exists in the
forward or the backward pass: peak memory is `O(B·H·(N + S)·D + B·H·q_block·k_block)`
plus any `mask`/`bias` the caller holds (and a bias's gradient).
Key blocks that causality, a window, the lengths, the segment ids or an all-False mask
block rule out are skipped, in the forward and in both passes of the backward, so
causal attention does about half the work and a sliding window work proportional to
N·window.

A mask function (FlexAttention's) is evaluated block by block, never as an `(N, S)`
array; when the values it reads are known before the call runs, each query block's
range of key blocks is computed from them first, so the key loop is as short as the
widest range and a window written as a mask function runs like `local_window_size`
(`jax_mha.paths.engine`, "Mask functions"). With no block sizes given, the blocks
follow its span (`jax_mha.paths.engine.mask_span`).

Segment ids (packed sequences): a key block is skipped when the range
`[min, max]` of its keys' ids does not meet the query block's range. For sorted ids
(the packed layout: documents one after another) the ranges are tight and each query
block visits only the key blocks of its own documents, about `N·doc_len` work instead
of `N·S`, forward and backward. Unsorted ids are still exact (every visited block is
masked pair by pair), but their ranges overlap more often, so fewer blocks are skipped.

Default blocks (`default_blocks`): 2048 query rows x 256 keys without a causal or
window pattern, 512 x 512 with one. On one CPU device the engine runs one head at a
time, so a float32 score block is 2 or 1 MiB, cache-sized. Without a pattern nothing
is skipped, and tall query blocks make fewer passes over the keys; a pattern wants
shorter query blocks so that whole key blocks are skipped. The measurements behind
these choices are in docs/performance.md. A platform whose sweep chose other sizes
has them in `DEVICE_BLOCKS` (a GPU: 1024 x 1024 with a pattern).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_mha._masking import Visibility
from jax_mha._path import EVERY_PART, Path
from jax_mha._softmax import close
from jax_mha.paths.engine import check_description, mask_span, run_engine

QUERY_BLOCK_SIZE, KEY_BLOCK_SIZE = 2048, 256  # without a pattern to skip by
PATTERN_BLOCK_SIZE = 512  # square blocks with a causal or window pattern
NARROW_WINDOW = 1024  # a window spanning fewer keys than this gets square blocks by its span
NARROW_MIN_BLOCK = 128  # narrower blocks make matmuls too small to run efficiently on CPU
# `(unpatterned, patterned)` blocks by platform where a sweep on that device
# (`experiments/engine_blocks.py`) chose other sizes than the CPU's above. GPU, from the
# sweep on an H200 (docs/results/gpu_kernels.md): causal 1024 x 1024 ran forward+backward
# in 0.77x the time of 512 x 512; unpatterned keeps the CPU's (the sweep did not reach it).
DEVICE_BLOCKS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "gpu": ((QUERY_BLOCK_SIZE, KEY_BLOCK_SIZE), (1024, 1024)),
}


def _narrow_side(width: int) -> int:
    """The square block of a band `width` keys wide (under `NARROW_WINDOW`): the
    smallest block while the band spans at most two of them, else the patterned
    block; 256-key blocks were the slowest of the sizes timed for both a 256- and a
    512-key window (docs/performance.md, "Sliding windows")."""
    return NARROW_MIN_BLOCK if width <= 2 * NARROW_MIN_BLOCK else PATTERN_BLOCK_SIZE


def default_blocks(is_causal: bool, window, span=None, platform: str = "cpu") -> tuple[int, int]:
    """`(query_block_size, key_block_size)` when the caller gives none.

    2048 x 256 without a pattern, 512 x 512 when causal or windowed; for a narrow band
    (a window whose left + right, right counted as 0 when causal, is under
    `NARROW_WINDOW` keys), square blocks by its width `w` (`_narrow_side`: 128 up to
    w = 256, else 512).
    `span`: `engine.mask_span`'s `(span, sparse)` for a mask function, read the same way
    (a narrow span gets the narrow band's blocks, a sparse one 512 x 512).
    `platform`: where the call runs; `DEVICE_BLOCKS` replaces the unpatterned and
    patterned sizes there.
    """
    full, pattern = DEVICE_BLOCKS.get(platform, ((QUERY_BLOCK_SIZE, KEY_BLOCK_SIZE), (PATTERN_BLOCK_SIZE,) * 2))
    if span is not None and (window is None or window.left is None):
        width, sparse = span
        if width < NARROW_WINDOW:
            return (_narrow_side(width),) * 2
        if sparse:
            return pattern
    right = None if window is None else (0 if is_causal else window.right)  # causal: no key after the query
    if window is not None and window.left is not None and right is not None and window.left + right < NARROW_WINDOW:
        return (_narrow_side(window.left + right),) * 2
    if is_causal or window is not None:
        return pattern
    return full


def run_blockwise(q, k, v, vis: Visibility, *, scale: float, query_block_size=None, key_block_size=None,
                  bad_kv=None, platform: str = "cpu"):
    """`run_engine` with blocks of at most `query_block_size x key_block_size`
    (clamped to N and S; None: `default_blocks`).

    Args:
      q: `(B…, H, N, D)`; k: `(B…, K, S, D)`; v: `(B…, K, S, Dv)`, finite.
      vis: the description (`jax_mha._masking.Visibility`, public layout).
      scale, bad_kv: see `run_engine`.
      platform: where the call runs, for `default_blocks`.

    Returns:
      `(out (B…, H, N, Dv), lse (B…, H, N), touched (B…, H, N))`, as `run_engine`.
    """
    check_description(vis)
    n, s = q.shape[-2], k.shape[-2]
    span = None
    if query_block_size is None or key_block_size is None:
        span = mask_span(vis, n, s, NARROW_MIN_BLOCK)
    q_default, k_default = default_blocks(vis.is_causal, vis.window, span, platform)
    q_block = q_default if query_block_size is None else query_block_size
    k_block = k_default if key_block_size is None else key_block_size
    return run_engine(q, k, v, vis, scale=scale, q_block=min(q_block, n), k_block=min(k_block, s), bad_kv=bad_kv)


def run(q, k, v, bad_kv, vis: Visibility, call, *, scale: float, blocks, **_):
    """The `"blockwise"` path (`Path.run`): `run_blockwise` with `blocks`
    `(query_block_size, key_block_size)`, each None for the default, the rows closed
    (`_softmax.close`)."""
    out, lse, touched = run_blockwise(q, k, v, vis, query_block_size=blocks[0], key_block_size=blocks[1],
                                      scale=scale, bad_kv=bad_kv, platform=call.platform)
    empty = lse == jnp.inf  # the engine's mark of a row with no visible key
    out, lse = close(out, jnp.where(empty, -jnp.inf, lse), vis)
    return out, None, lse, empty, touched


# It never builds the weights, so it neither returns them nor drops them out.
PATH = Path("blockwise", run, takes=EVERY_PART - {"return_weights", "dropout"}, statistics="blocks")
refusal = PATH.refusal
