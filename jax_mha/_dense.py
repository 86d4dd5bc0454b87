"""The `"xla"` path: every key in one block, query rows in blocks sized for the cache.

Query rows are independent given all the keys, so blocking them changes memory, not
the function. On one CPU device the engine runs one head at a time (head dims up to
128; see `jax_mha._flash._head`), and one head's float32 score block is kept to at most
`SCORE_BLOCK_BYTES` (with all heads together, a block holds that many bytes per head): the whole
`(B, H, N, S)` scores (32 MB at B=4, H=8, N=S=512) are too big for the allocator to
recycle (glibc serves blocks of 32 MB and more from mmap and hands them back, so each
call page-faults them in anew) and fall out of cache; per-head blocks of a few MB are
reused and stay in cache. On a 2-core CPU (B=1, H=8, N=S=2048, forward+backward)
blocks of 512 rows x 2048 keys (4 MB) ran 1.5x faster than 256 x 1024.
"""

from __future__ import annotations

from jax_mha._flash import run_engine

# float32 scores of one query block of one head (all keys) at most this big.
SCORE_BLOCK_BYTES = 4 * 2**20


def query_block_rows(n: int, s: int) -> int:
    """Rows per query block: as many as fit `SCORE_BLOCK_BYTES`, spread evenly over N."""
    per_row = max(s * 4, 1)
    rows = max(1, min(n, SCORE_BLOCK_BYTES // per_row))
    num_blocks = -(-n // rows)
    return -(-n // num_blocks)  # same block count, fewest padded rows


def dense_attention(q, k, v, **description):
    """`run_engine` with one key block of all S keys; returns `(out, lse)`."""
    n, s = q.shape[-2], k.shape[-2]
    rows = query_block_rows(n, s)
    return run_engine(q, k, v, q_block=rows, k_block=s, **description)
