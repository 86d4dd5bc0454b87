"""Head patching (`jax_mha.lab.patching`) and the analyses on a model of the user's own.

Patched heads are checked against independent computations: the float64 loop reference
`np_attention` of conftest on the cached q, k, v (a patched query or key must give the
attention of the mixed tensors), the model's own head gates (a zeroed head output is a
gated-off head), and the Decoder's own weights. Sizes are prime: B=5, T=7, H=3, D=5.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance, np_attention, randomize
from flax import nnx

import jax_mha
import jax_mha.nnx as jnnx
from jax_mha.lab import analysis, patching
from jax_mha.lab.models import Decoder, ModelConfig

B, T, V, LAYERS, HEADS, D = 5, 7, 11, 2, 3, 5
CAUSAL = np.tril(np.ones((T, T), bool))
# The float32 sums, for the tolerances. One attention: the logits over D (<= 5), the
# softmax sum and weights @ v over T. A model (the largest here: d_model 18, d_ff 60,
# 2 layers): per layer two layer norms (mean and variance), the q/k/v projections,
# attention, the output projection and the feed-forward layer; the final norm, the
# logits; a loss adds the softmax over V and the mean over B*T.
ATTENTION_TERMS = D + 2 * T
MODEL_TERMS = LAYERS * (2 * 2 * 18 + 18 + ATTENTION_TERMS + 18 + 18 + 60) + 2 * 18 + 18
LOSS_TERMS = MODEL_TERMS + V + B * T


def tol(want, terms=MODEL_TERMS):
    """`f32_tolerance` at `want`'s size."""
    return f32_tolerance(terms=terms, magnitude=want)


@pytest.fixture(scope="module")
def decoder():
    cfg = ModelConfig(vocab_size=V, max_len=T, d_model=HEADS * D, num_heads=HEADS, num_layers=LAYERS, d_ff=13)
    model = Decoder(cfg)
    # Shapes only: `randomize` draws every value (no eager initialisation to compile).
    params = randomize(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"], seed=1)
    a, b = (jax.random.randint(jax.random.key(s), (B, T), 0, V) for s in (2, 3))
    return model, params, a, b


def loss_of(batch_inputs):
    """Mean next-token loss of logits on `batch_inputs`: a metric for patch_each_head."""

    def metric(logits):
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, batch_inputs[:, 1:, None], -1).mean()

    return metric


def test_cache_is_the_models_own_computation(decoder):
    model, params, a, _ = decoder
    logits, cache = patching.run_with_cache(model, params, a, weights=True)
    plain, weights = model.apply({"params": params}, a, return_weights=True)
    np.testing.assert_allclose(logits, plain, atol=tol(plain))
    np.testing.assert_allclose(np.stack(cache.weights), weights, atol=tol(1.0))
    assert [x.shape for x in cache.q] == [(B, HEADS, T, D)] * LAYERS and len(cache.out) == LAYERS
    # Layer 0 by hand: embedding + positions, pre-norm LayerNorm, projections, split heads.
    x = np.asarray(params["embed"]["embedding"], np.float64)[np.asarray(a)] + np.asarray(params["positions"])[:T]
    scale, bias = (np.asarray(params["block_0"]["norm1"][n], np.float64) for n in ("scale", "bias"))
    x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * scale + bias
    proj = lambda name: (x @ np.asarray(params["block_0"]["attention"][name]["kernel"])).reshape(B, T, HEADS, D)
    q, k, v = (proj(n).transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
    np.testing.assert_allclose(cache.q[0], q, atol=tol(q, 2 * 2 * 15 + 15))  # the norm, the projection
    out, _ = np_attention(q, k, v, mask=CAUSAL)
    np.testing.assert_allclose(cache.out[0], out, atol=tol(out, 2 * 2 * 15 + 15 + ATTENTION_TERMS))


@pytest.mark.parametrize("layer, head", [(0, 2), (1, 0)])
def test_zeroed_head_output_is_the_gated_off_head(decoder, layer, head):
    model, params, a, _ = decoder
    gates = np.ones((LAYERS, HEADS), np.float32)
    gates[layer, head] = 0.0
    gated = model.apply({"params": params}, a, head_mask=jnp.asarray(gates))
    patched = patching.run_patched(model, params, a, layer=layer, head=head, mode="zero")
    np.testing.assert_allclose(patched, gated, atol=tol(gated))


def test_patch_each_head_equals_the_gate_oracle_in_one_compilation(decoder):
    model, params, a, b = decoder
    _, source = patching.run_with_cache(model, params, b)
    metric = loss_of(a)
    losses = patching.patch_each_head(model, params, a, metric, mode="zero", source=source)
    stack = analysis.single_head_off_gates(jnp.ones((LAYERS, HEADS)))  # (L*H, L, H), entry l*H + h: (l, h) off
    gated = jax.vmap(lambda g: metric(model.apply({"params": params}, a, head_mask=g)))(stack)
    assert losses.shape == (LAYERS, HEADS)
    np.testing.assert_allclose(losses, np.asarray(gated).reshape(LAYERS, HEADS), atol=tol(gated, LOSS_TERMS))
    size = patching._each_head._cache_size()
    patching.patch_each_head(model, params, b, metric, mode="zero", source=source)  # new values, same shapes
    assert patching._each_head._cache_size() == size


def test_replaced_output_is_the_sources_and_nothing_earlier_moves(decoder):
    model, params, a, b = decoder
    clean, cache_a = patching.run_with_cache(model, params, a)
    _, cache_b = patching.run_with_cache(model, params, b)
    same = patching.run_patched(model, params, a, layer=1, head=2, source=cache_a)  # from its own run: no change
    np.testing.assert_allclose(same, clean, atol=tol(clean))
    logits, patched = patching.run_patched(model, params, a, layer=1, head=1, source=cache_b, return_cache=True)
    np.testing.assert_allclose(patched.out[1][:, 1], cache_b.out[1][:, 1], atol=tol(cache_b.out[1][:, 1]))
    np.testing.assert_allclose(patched.out[1][:, [0, 2]], cache_a.out[1][:, [0, 2]], atol=tol(cache_a.out[1]))
    np.testing.assert_allclose(patched.out[0], cache_a.out[0], atol=tol(cache_a.out[0]))
    assert not np.allclose(logits, clean, atol=1e-4)
    _, mean = patching.run_patched(model, params, a, layer=0, head=0, mode="mean", source=cache_b, return_cache=True)
    np.testing.assert_allclose(mean.out[0][:, 0], np.broadcast_to(np.mean(cache_b.out[0][:, 0], 0), (B, T, D)),
                               atol=tol(cache_b.out[0][:, 0], B))  # a mean over the batch


def test_patched_query_attends_with_the_sources_query(decoder):
    model, params, a, b = decoder
    _, cache_a = patching.run_with_cache(model, params, a)
    _, cache_b = patching.run_with_cache(model, params, b)
    # The traced layer and head: one compilation serves every head.
    run = jax.jit(lambda layer, head: patching.run_patched(model, params, a, layer=layer, head=head, site="q",
                                                           source=cache_b, return_cache=True)[1])
    patched = run(0, 1)
    q = np.asarray(cache_a.q[0]).copy()
    q[:, 1] = cache_b.q[0][:, 1]
    expected, _ = np_attention(q, cache_a.k[0], cache_a.v[0], mask=CAUSAL)
    np.testing.assert_allclose(patched.out[0], expected, atol=tol(expected, ATTENTION_TERMS))


# ----------------------------------------------------------------- grouped-query attention, a linen model of one's own

GQA_HEADS, GQA_KV, GQA_D = 6, 2, 3  # groups of 3 query heads per key/value head


class GQALM(nn.Module):
    """A one-block linen LM with grouped-query attention, not the lab's Decoder."""

    attention_fn: object = None

    @nn.compact
    def __call__(self, tokens, head_mask=None):
        x = nn.Embed(V, GQA_HEADS * GQA_D)(tokens)
        x = jax_mha.TransformerBlock(num_heads=GQA_HEADS, num_kv_heads=GQA_KV, d_ff=17, pre_norm=True,
                                     attention_fn=self.attention_fn)(x, is_causal=True,
                                                                     head_mask=None if head_mask is None else head_mask[0])
        return nn.Dense(V)(x)


@pytest.fixture(scope="module")
def gqa():
    params = randomize(jax.eval_shape(GQALM().init, jax.random.key(4), jnp.zeros((1, T), jnp.int32))["params"], seed=5)
    apply = lambda p, x, gates, *, attention_fn=None: GQALM(attention_fn).apply({"params": p}, x, head_mask=gates)
    model = patching.HeadModel(apply, num_layers=1, num_heads=GQA_HEADS, vocab_size=V)
    a, b = (jax.random.randint(jax.random.key(s), (B, T), 0, V) for s in (6, 7))
    return model, params, patching.run_with_cache(model, params, a)[1], patching.run_with_cache(model, params, b)[1], a


def test_gqa_key_patch_for_the_group_or_one_query_head(gqa):
    model, params, cache_a, cache_b, a = gqa
    assert cache_a.k[0].shape == (B, GQA_KV, T, GQA_D)
    q, k_a, v_a, k_b = (np.asarray(x[0]) for x in (cache_a.q, cache_a.k, cache_a.v, cache_b.k))
    mixed = k_a.copy()
    mixed[:, 1] = k_b[:, 1]  # key/value head 1 from the other run: query heads 3, 4, 5 read it
    expected, _ = np_attention(q, mixed, v_a, mask=CAUSAL)
    _, group = patching.run_patched(model, params, a, layer=0, head=1, site="k", source=cache_b, return_cache=True)
    np.testing.assert_allclose(group.out[0], expected, atol=tol(expected, ATTENTION_TERMS))
    assert not np.allclose(expected[:, 3:], cache_a.out[0][:, 3:], atol=1e-4)  # the patch did something
    _, one = patching.run_patched(model, params, a, layer=0, head=4, site="k", source=cache_b, kv_scope="query",
                                  return_cache=True)
    np.testing.assert_allclose(one.out[0][:, 4], expected[:, 4],
                               atol=tol(expected, ATTENTION_TERMS))  # head 4 reads the source keys
    keep = [0, 1, 2, 3, 5]  # its group mates 3 and 5 (and the other group) read the run's own
    np.testing.assert_allclose(one.out[0][:, keep], cache_a.out[0][:, keep], atol=tol(cache_a.out[0]))


def test_gqa_zeroed_value_silences_its_group_or_one_head(gqa):
    model, params, cache_a, _, a = gqa
    _, group = patching.run_patched(model, params, a, layer=0, head=0, site="v", mode="zero", source=cache_a,
                                    return_cache=True)
    np.testing.assert_allclose(group.out[0][:, :3], 0.0, atol=1e-7)  # weights times zero values
    np.testing.assert_allclose(group.out[0][:, 3:], cache_a.out[0][:, 3:], atol=tol(cache_a.out[0]))
    _, one = patching.run_patched(model, params, a, layer=0, head=2, site="v", mode="zero", kv_scope="query",
                                  return_cache=True)
    np.testing.assert_allclose(one.out[0][:, 2], 0.0, atol=1e-7)
    np.testing.assert_allclose(one.out[0][:, :2], cache_a.out[0][:, :2], atol=tol(cache_a.out[0]))
    each = patching.patch_each_head(model, params, a, lambda logits: logits.sum(), site="v", mode="zero",
                                    source=cache_a)
    assert each.shape == (1, GQA_KV)  # one entry per key/value head in the group scope


def test_analyses_take_a_linen_model_of_ones_own(gqa):
    model, params, cache_a, _, a = gqa
    weights = analysis.attention_weights(params, model, a)
    assert weights.shape == (1, B, GQA_HEADS, T, T)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=tol(1.0, 2 * T))  # the softmax sum, then this one
    batch = {"inputs": a, "targets": jnp.roll(a, -1, 1), "scored": jnp.ones((B, T), bool)}
    drops = analysis.ablate_each_head_loss(params, model, batch)
    gates = np.ones((1, GQA_HEADS), np.float32)
    gates[0, 5] = 0.0
    from jax_mha.lab.train import scored_loss

    loss = jax.jit(lambda g: scored_loss(model.apply(params, a, g), batch)[0])  # one program for both gates
    base, off = loss(jnp.ones((1, GQA_HEADS))), loss(jnp.asarray(gates))
    assert float(drops[0, 5]) == pytest.approx(float(off - base), rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------- an NNX model of one's own (docs/usage.md)


class TinyLM(nnx.Module):
    """The docs' example: embedding, learned positions, pre-norm jax_mha.nnx blocks, logits."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, max_len: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, d_model)))
        self.blocks = nnx.List([jnnx.TransformerBlock(d_model, heads, 4 * d_model, pre_norm=True, rngs=rngs)
                                for _ in range(layers)])
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens, head_mask=None):
        x = self.embed(tokens) + self.positions[None, : tokens.shape[-1]]  # (B, T, d)
        for i, block in enumerate(self.blocks):
            x = block(x, is_causal=True, head_mask=None if head_mask is None else head_mask[i])
        return self.out(self.norm(x))


def test_nnx_model_through_the_analyses_and_patching(decoder):
    _, _, a, _ = decoder
    user = TinyLM(V, HEADS * D, HEADS, LAYERS, T, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(user)

    def apply(params, inputs, gates, *, attention_fn=None):
        model = nnx.merge(graphdef, params)  # a fresh copy: hooking it leaves `user` as it is
        if attention_fn is not None:
            patching.set_attention_fn(model, attention_fn)
        return model(inputs, head_mask=gates)

    model = patching.HeadModel(apply, num_layers=LAYERS, num_heads=HEADS, vocab_size=V)
    logits, cache = patching.run_with_cache(model, state, a)
    want = user(a)
    np.testing.assert_allclose(logits, want, atol=tol(want))
    gates = jnp.ones((LAYERS, HEADS)).at[1, 2].set(0.0)
    want = user(a, head_mask=gates)
    np.testing.assert_allclose(patching.run_patched(model, state, a, layer=1, head=2, mode="zero"), want,
                               atol=tol(want))
    batch = {"inputs": a, "targets": jnp.roll(a, -1, 1), "scored": jnp.ones((B, T), bool)}
    result = analysis.prune_heads_iteratively(state, model, batch, order="importance", criterion="loss",
                                              max_drop=0.0, run_to_end=True)
    assert result.steps[-1].num_pruned == LAYERS * HEADS
    assert analysis.attention_weights(state, model, a).shape == (LAYERS, B, HEADS, T, T)
    assert user.blocks[0].attention.attention_fn is None  # the caller's model was never hooked


# ----------------------------------------------------------------- errors


def test_bad_patches_and_models_name_the_value(decoder, gqa):
    model, params, a, _ = decoder
    _, cache = patching.run_with_cache(model, params, a)
    for kwargs, error, match in [
        ({"site": "x"}, ValueError, "site must be one of"),
        ({"mode": "noise"}, ValueError, "mode must be one of"),
        ({"site": "k", "kv_scope": "pair", "source": cache}, ValueError, "kv_scope must be one of"),
        ({"mode": "replace"}, ValueError, "takes its values from a source"),
        ({"source": {"out": 1}}, TypeError, "source must be a HeadCache"),
        ({"layer": 2, "source": cache}, ValueError, r"layer=2 is outside \[0, 2\)"),
        ({"head": 3, "source": cache}, ValueError, r"head=3 is outside \[0, 3\)"),
        ({"gates": np.ones((3, 2)), "mode": "zero"}, ValueError, r"gates must have shape .* \(2, 3\)"),
    ]:
        args = {"layer": 0, "head": 0, **kwargs}
        with pytest.raises(error, match=match):
            patching.run_patched(model, params, a, **args)
    gqa_model, gqa_params, gqa_cache, _, _ = gqa
    with pytest.raises(ValueError, match=r"head=2 is outside \[0, 2\)"):  # 2 key/value heads in the group scope
        patching.run_patched(gqa_model, gqa_params, a, layer=0, head=2, site="k", source=gqa_cache)
    deaf = patching.HeadModel(lambda p, x, g, *, attention_fn=None: model.apply({"params": p}, x), LAYERS, HEADS)
    with pytest.raises(ValueError, match="called attention_fn 0 times"):
        patching.run_with_cache(deaf, params, a)
    with pytest.raises(TypeError, match="model must be a HeadModel or .* got object; wrap"):
        analysis.gate_shape(object())
    with pytest.raises(ValueError, match="num_heads must be an int >= 1, got 0"):
        patching.HeadModel(lambda *a, **k: None, 1, 0)
    with pytest.raises(ValueError, match="give the HeadModel its vocab_size"):
        analysis.model_head_scores(params, deaf, a, key=jax.random.key(0))
