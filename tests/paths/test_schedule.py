"""`jax_mha.paths.schedules.build_schedule` against a NumPy pattern built here from
`np.arange` and the visibility rule (not from `_masking`): full blocks are exactly
the blocks whose real pairs are all visible, every block holding a visible pair is
visited, the lists are sorted and padded for prefetch, the transposed schedule is the
transpose of the same classes, and the batch/head axes are 1 when nothing depends on
them. Every case runs under `jax.jit` with its arrays (lengths, ids, offset, the
values a mask_mod reads) traced; sizes are primes that cross block edges."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_mha import _masking
from jax_mha.paths.schedules import BlockSchedule, build_schedule

_ARRAYS = ("q_len", "kv_len", "q_ids", "kv_ids", "offset", "start", "values")


def np_pattern(p) -> np.ndarray:
    """bool `(B, H, N, S)` (B the flattened batch): key j visible to query i by the rule."""
    n, s, batch, heads = p["n"], p["s"], math.prod(p["batch"]), p["heads"]
    b = np.arange(batch).reshape(-1, 1, 1, 1)
    h = np.arange(heads).reshape(1, -1, 1, 1)
    i = np.arange(n).reshape(1, 1, -1, 1)
    j = np.arange(s).reshape(1, 1, 1, -1)
    at = i + p.get("offset", s - n)  # the key position of each query
    ok = np.ones((batch, heads, n, s), bool)
    if p.get("causal"):
        ok &= j <= at
    left, right = p.get("window") or (None, None)
    if left is not None:
        ok &= j >= at - left
    if right is not None:
        ok &= j <= at + right
    per_batch = lambda x: np.broadcast_to(x, p["batch"]).reshape(-1, 1, 1, 1)
    if "q_len" in p:
        ok &= i < per_batch(p["q_len"])
    if "kv_len" in p:
        ok &= j < per_batch(p["kv_len"])
    if "q_ids" in p:
        q_ids = p["q_ids"].reshape(batch, 1, n, 1)
        ok &= q_ids == p["kv_ids"].reshape(batch, 1, 1, s)
    if "np_mod" in p:
        ok &= p["np_mod"](p.get("values"), b, h, i + p.get("start", 0), j)
    return ok


def np_classes(ok: np.ndarray, q_block: int, k_block: int) -> tuple[np.ndarray, np.ndarray]:
    """`(any, full)` bool `(B, H, nq, nk)`: a block holds a visible pair; every pair of
    its real rows (< N) is visible, keys past S counting as invisible."""
    batch, heads, n, s = ok.shape
    nq, nk = -(-n // q_block), -(-s // k_block)
    keys = np.zeros((batch, heads, n, nk * k_block), bool)
    keys[..., :s] = ok
    blocks = [keys[:, :, r * q_block:(r + 1) * q_block].reshape(batch, heads, -1, nk, k_block) for r in range(nq)]
    return (np.stack([x.any(axis=(2, 4)) for x in blocks], axis=2),
            np.stack([x.all(axis=(2, 4)) for x in blocks], axis=2))


def decoded(count, index, full, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A count/index/full triple back to `(visited, full)` bool grids `(…, m, size)`,
    checking on the way that each list is ascending and padded for prefetch."""
    count, index, full = (np.asarray(x) for x in (count, index, full))
    visited, fully = np.zeros(index.shape[:-1] + (size,), bool), np.zeros(index.shape[:-1] + (size,), bool)
    for pos in np.ndindex(count.shape):
        c, idx, f = count[pos], index[pos], full[pos]
        assert np.all(np.diff(idx[:c]) > 0) and np.all((idx >= 0) & (idx < size)), (pos, idx)
        np.testing.assert_array_equal(idx[c:], idx[c - 1] if c else 0, err_msg=f"prefetch padding at {pos}")
        np.testing.assert_array_equal(f[c:], 0, err_msg=f"full past the count at {pos}")
        assert set(np.unique(f)) <= {0, 1}
        visited[pos + (idx[:c],)] = True
        fully[pos + (idx[:c],)] = f[:c] == 1
    return visited, fully


def schedule_fn(p):
    """`build_schedule` for case `p` under jit, a function of its arrays (`_ARRAYS`), all traced."""
    rank = len(p["batch"])

    def run(a):
        q_ids, kv_ids = _masking.segments_at_rank(a.get("q_ids"), a.get("kv_ids"), rank)
        vis = _masking.Visibility(
            p["n"], p["s"], p.get("causal", False), _masking.canonical_window(p.get("window")),
            q_lengths=_masking.lengths_at_rank(a.get("q_len"), rank),
            kv_lengths=_masking.lengths_at_rank(a.get("kv_len"), rank), q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            q_offset=a.get("offset"), q_start=a.get("start"),
            mask_mod=p["mod"](a.get("values")) if "mod" in p else None, batch_shape=p["batch"],
            num_heads=p["heads"])
        return build_schedule(vis, p["qb"], p["kb"])

    return jax.jit(run)


def arrays(p) -> dict:
    """The case's arrays, as `schedule_fn`'s function takes them."""
    return {k: jnp.asarray(p[k]) for k in _ARRAYS if k in p}


def check(sched: BlockSchedule, p, extent: tuple, exact: bool) -> None:
    """Asserts (1) full blocks are exactly those whose real pairs are all visible, (2)
    every block holding a visible pair is visited (exactly those when `exact`), (3) the
    lists are ascending and prefetch-padded, the transpose is the same classes, (4)
    the `(Bs, Hs)` axes are `extent`."""
    n, s, qb, kb = p["n"], p["s"], p["qb"], p["kb"]
    nq, nk = -(-n // qb), -(-s // kb)
    assert (sched.n, sched.s, sched.q_block, sched.k_block) == (n, s, qb, kb)
    chex.assert_shape([sched.kv_count, sched.kv_index, sched.kv_full], [extent + (nq,), extent + (nq, nk), extent + (nq, nk)])
    chex.assert_shape([sched.q_count, sched.q_index, sched.q_full], [extent + (nk,), extent + (nk, nq), extent + (nk, nq)])
    chex.assert_type(jax.tree_util.tree_leaves(sched), jnp.int32)
    visited, full = decoded(sched.kv_count, sched.kv_index, sched.kv_full, nk)
    visited_t, full_t = decoded(sched.q_count, sched.q_index, sched.q_full, nq)
    np.testing.assert_array_equal(visited_t, np.swapaxes(visited, -1, -2), err_msg="transposed visits")
    np.testing.assert_array_equal(full_t, np.swapaxes(full, -1, -2), err_msg="transposed full blocks")
    seen, every = np_classes(np_pattern(p), qb, kb)
    shape = seen.shape
    np.testing.assert_array_equal(np.broadcast_to(full, shape), every, err_msg="full blocks")
    assert not np.any(seen & ~np.broadcast_to(visited, shape)), "a block holding a visible pair is skipped"
    if exact:
        np.testing.assert_array_equal(np.broadcast_to(visited, shape), seen, err_msg="visited blocks")


def documents(rng, batch: tuple, length: int) -> np.ndarray:
    """int32 `(batch…, length)`: sorted segment ids 0, 1, 2… of random lengths."""
    ids = [np.repeat(np.arange(length), rng.integers(1, 40, length))[:length] for _ in range(math.prod(batch))]
    return np.stack(ids).reshape(batch + (length,)).astype(np.int32)


def _prefix_lm(values):
    return lambda b, h, q, k: (k < values[b]) | (k <= q)


def _same_document(values):
    return lambda b, h, q, k: values[q] == values[k]


def _head_window(values):
    return lambda b, h, q, k: (k <= q) & (q - k < 8 * (h + 1))


def cases():
    """`(name, case, (Bs, Hs) expected, visited exact)`: visited is exact for one
    source, or for positions with lengths (one analytic source)."""
    rng = np.random.default_rng(0)
    base = dict(n=97, s=131, qb=16, kb=32, batch=(2, 3), heads=5)
    docs = documents(rng, (2,), 131)
    yield "causal", dict(base, causal=True), (1, 1), True
    yield "causal_square", dict(base, s=97, qb=32, kb=16, causal=True), (1, 1), True
    yield "lengths", dict(base, causal=True, q_len=rng.integers(0, 98, (2, 3)), kv_len=rng.integers(0, 132, (2, 3))), \
        (6, 1), True
    yield "lengths_broadcast", dict(base, q_len=np.int32(50), kv_len=rng.integers(1, 132, (3,))), (6, 1), True
    yield "lengths_unbatched", dict(base, q_len=np.int32(50), kv_len=np.int32(77)), (1, 1), True
    yield "documents", dict(base, n=131, batch=(2,), q_ids=docs, kv_ids=docs), (2, 1), True
    yield "documents_causal", dict(base, batch=(2,), causal=True, q_ids=docs[:, 34:], kv_ids=docs), (2, 1), False
    yield "prefix_lm", dict(base, qb=32, kb=16, batch=(2,), heads=3, mod=lambda v: lambda b, h, q, k: (k < 20) | (k <= q),
                            np_mod=lambda v, b, h, i, j: (j < 20) | (j <= i)), (1, 1), True
    yield "prefix_lm_per_batch", dict(base, s=97, batch=(3,), heads=3, values=np.array([0, 33, 70]), start=5,
                                      mod=_prefix_lm, np_mod=lambda v, b, h, i, j: (j < v[b]) | (j <= i)), (3, 1), True
    yield "documents_mod", dict(base, n=131, qb=32, kb=16, batch=(2,), values=docs[0], mod=_same_document,
                                np_mod=lambda v, b, h, i, j: v[i] == v[j]), (1, 1), True
    yield "future_mod", dict(base, kb=16, mod=lambda v: lambda b, h, q, k: k >= q,
                             np_mod=lambda v, b, h, i, j: j >= i), (1, 1), True
    yield "tail_mod", dict(base, heads=1, mod=lambda v: lambda b, h, q, k: k % 32 >= 3,  # skips the last key block
                           np_mod=lambda v, b, h, i, j: j % 32 >= 3), (1, 1), True
    yield "head_mod", dict(base, s=97, batch=(2,), heads=3, mod=_head_window,
                           np_mod=lambda v, b, h, i, j: (j <= i) & (i - j < 8 * (h + 1))), (1, 3), True
    yield "everything", dict(base, batch=(2,), causal=True, window=(50, None), offset=36, q_len=np.array([90, 61]),
                             kv_len=np.array([131, 100]), q_ids=docs[:, 34:], kv_ids=docs, values=np.array([10, 0]),
                             mod=_prefix_lm, np_mod=lambda v, b, h, i, j: (j < v[b]) | (j <= i)), (2, 1), False


CASES = list(cases())


@pytest.mark.parametrize("case,extent,exact", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_schedule_matches_the_pattern(case, extent, exact):
    check(schedule_fn(case)(arrays(case)), case, extent, exact)


@pytest.mark.parametrize("causal,window,qb,kb", [(True, None, 16, 32), (False, (7, 11), 32, 16),
                                                 (False, (None, 5), 16, 16), (True, (20, None), 32, 32)])
def test_every_offset(causal, window, qb, kb):
    """Causality and windows (both sides, one side unbounded) at every alignment of
    the diagonal with the block edges: one compile, the offset traced."""
    case = dict(n=97, s=131, qb=qb, kb=kb, batch=(), heads=1, causal=causal, window=window)
    fn = schedule_fn(case)
    for offset in range(-40, 150):
        check(fn(dict(offset=jnp.int32(offset))), dict(case, offset=offset), (1, 1), True)


def test_every_length():
    """Every kv length 0…S and every q length 0…N at once, one per batch entry."""
    s = 131
    case = dict(n=97, s=s, qb=16, kb=32, batch=(s + 1,), heads=1, causal=True, window=(40, None),
                q_len=np.arange(s + 1) % 98, kv_len=np.arange(s + 1))
    check(schedule_fn(case)(arrays(case)), case, (s + 1, 1), True)


def test_some_cases_skip_and_some_are_full():
    """The cases exercise all three classes (skipped, partial, full), not one."""
    classes = set()
    for _, case, _, _ in CASES:
        seen, every = np_classes(np_pattern(case), case["qb"], case["kb"])
        classes |= {"skipped"} if np.any(~seen) else set()
        classes |= {"partial"} if np.any(seen & ~every) else set()
        classes |= {"full"} if np.any(every) else set()
    assert classes == {"skipped", "partial", "full"}


def test_packed_32k_never_builds_an_n_by_s_array():
    """8 documents of 4096 over traced ids, N = S = 32768: lowered, not run."""
    n = 32768
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), n // 8)

    def schedule(ids):
        vis = _masking.Visibility(n, n, mask_mod=_same_document(ids))
        return build_schedule(vis, 128, 128)

    def dense(ids):
        return _masking.dense_allowed(_masking.Visibility(n, n, mask_mod=_same_document(ids)), 4)

    for text in (jax.jit(dense).lower(ids).as_text(), jax.jit(dense).lower(ids).as_text(dialect="hlo")):
        assert "32768x32768" in text or "32768,32768" in text  # the search would see a dense pattern
    lowered = jax.jit(schedule).lower(ids)
    for text in (lowered.as_text(), lowered.as_text(dialect="hlo")):
        assert "32768x32768" not in text and "32768,32768" not in text
    chex.assert_shape(jax.eval_shape(schedule, ids).kv_index, (1, 1, 256, 256))


def test_schedule_is_a_pytree_with_static_sizes():
    sched = jax.jit(build_schedule, static_argnums=(1, 2))(_masking.Visibility(7, 11, is_causal=True), 2, 3)
    leaves, treedef = jax.tree_util.tree_flatten(sched)
    assert len(leaves) == 6
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (again.n, again.s, again.q_block, again.k_block) == (7, 11, 2, 3)
    chex.assert_trees_all_equal(jax.jit(lambda x: x)(sched), sched)


def test_dense_mask_and_bad_blocks_raise():
    mask = _masking.Visibility(5, 7, mask=jnp.ones((5, 7), bool))
    with pytest.raises(ValueError, match="mask"):
        build_schedule(mask, 2, 2)
    for q_block, k_block in ((0, 2), (2, 2.0), (True, 2)):
        with pytest.raises(ValueError, match="q_block|k_block"):
            build_schedule(_masking.Visibility(5, 7), q_block, k_block)
