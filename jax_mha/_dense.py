"""The `"xla"` path: every key in one block, query rows in blocks sized for the cache.

Query rows are independent given all the keys, so blocking them changes memory, not
the function. On CPU the whole `(B, H, N, S)` float32 scores (32 MB at B=4, H=8,
N=S=512) are too big for the allocator to recycle: glibc serves blocks of 32 MB and
more from mmap and hands them back, so each call page-faults them in anew, which costs
more than the arithmetic. Score blocks of at most `SCORE_BLOCK_BYTES` come from the
heap, are reused and stay in cache. Blocking queries, not heads, keeps the (B, H) axes
whole, so a batch sharded over "data" and heads over "model" (`jax_mha.parallel`) stay
sharded inside the loop with no all-gather.
"""

from __future__ import annotations

from jax_mha._flash import run_engine

# float32 scores of one query block (every batch entry and head, all keys) at most this big.
SCORE_BLOCK_BYTES = 8 * 2**20


def query_block_rows(batch: int, kv_heads: int, n: int, s: int) -> int:
    """Rows per query block: as many as fit `SCORE_BLOCK_BYTES`, spread evenly over N."""
    per_row = max(batch * kv_heads * s * 4, 1)
    rows = max(1, min(n, SCORE_BLOCK_BYTES // per_row))
    num_blocks = -(-n // rows)
    return -(-n // num_blocks)  # same block count, fewest padded rows


def dense_attention(q, k, v, **description):
    """`run_engine` with one key block of all S keys; returns `(out, lse)`."""
    batch = 1
    for d in q.shape[:-3]:
        batch *= d
    n, s = q.shape[-2], k.shape[-2]
    rows = query_block_rows(batch, k.shape[-3], n, s)
    return run_engine(q, k, v, q_block=rows, k_block=s, **description)
