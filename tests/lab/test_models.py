"""Tests for `jax_mha.lab.models`: the decoder's parameter layout, token checks, and greedy
generation against a step-by-step reference."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from jax_mha.lab.models import Decoder, ModelConfig, empty_cache, greedy_generate

CONFIG = ModelConfig(vocab_size=11, max_len=13, d_model=15, num_heads=3, num_layers=2, d_ff=22)


def model_terms(d_model, width, d_ff, layers=2, length=13):
    """The float32 sums of a Decoder up to its logits, for the tolerances: per layer
    two layer norms (mean and variance over d_model), the q/k/v projections, the logits
    over a head's size (<= width), the softmax sum and weights @ v over the tokens, the
    output projection (over width) and the feed-forward layer; the final norm and the
    logits."""
    return layers * (2 * 2 * d_model + d_model + width + 2 * length + width + d_model + d_ff) + 2 * d_model + d_model


@pytest.fixture(scope="module")
def params():
    return jax.jit(Decoder(CONFIG).init)(jax.random.PRNGKey(2), jnp.zeros((1, CONFIG.max_len), jnp.int32))["params"]


def test_parameter_layout_is_the_copy_models(params):
    """Checkpoints of the copy model keep loading: the same names and shapes."""
    assert set(params) == {"embed", "positions", "block_0", "block_1", "final_norm", "logits"}
    assert params["embed"]["embedding"].shape == (11, 15)
    assert params["positions"].shape == (13, 15)
    assert params["logits"]["kernel"].shape == (15, 11)
    assert params["block_0"]["attention"]["query"]["kernel"].shape == (15, 15)


@pytest.mark.parametrize("tokens, error, match", [
    ([[1, 2, 11]], ValueError, r"token id 11 is outside \[0, vocab_size=11\)"),
    ([[1, -1, 3]], ValueError, r"token id -1 is outside"),
    ([[0.5, 1.0]], TypeError, "tokens must be integers"),
    ([list(range(7)) * 2], ValueError, "sequence length 14 exceeds max_len=13"),
])
def test_bad_tokens_are_refused_not_nan(params, tokens, error, match):
    with pytest.raises(error, match=match):
        Decoder(CONFIG).apply({"params": params}, jnp.asarray(tokens))


def test_greedy_generate_matches_step_by_step_argmax(params):
    model = Decoder(CONFIG)
    prompt = jax.random.randint(jax.random.PRNGKey(5), (3, 4), 0, CONFIG.vocab_size)
    out = greedy_generate(params, model, prompt, 6)
    assert out.shape == (3, 10) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :4], prompt)
    # The reference: a Python loop appending one argmax at a time. The model is causal,
    # so running it on the zero-padded length-10 buffer gives the prefix's logits at t-1
    # (and compiles once).
    apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    seq = np.zeros((3, 10), np.int32)
    seq[:, :4] = prompt
    for t in range(4, 10):
        seq[:, t] = np.asarray(jnp.argmax(apply(jnp.asarray(seq))[:, t - 1], -1))
    np.testing.assert_array_equal(np.asarray(out), seq)


def test_greedy_generate_checks_its_inputs(params):
    model = Decoder(CONFIG)
    with pytest.raises(ValueError, match=r"prompt length 4 \+ num_tokens=10 must be in \[4, max_len=13\]"):
        greedy_generate(params, model, jnp.ones((2, 4), jnp.int32), 10)
    with pytest.raises(ValueError, match="token id 12"):
        greedy_generate(params, model, jnp.full((2, 4), 12), 1)
    with pytest.raises(ValueError, match=r"prompt must be int \(B, P\)"):
        greedy_generate(params, model, jnp.ones((4,), jnp.int32), 1)


def test_generate_through_the_cache_equals_greedy_without_it(params):
    from jax_mha.lab.models import generate

    model = Decoder(CONFIG)
    prompt = jnp.array([[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(generate(params, model, prompt, 9), greedy_generate(params, model, prompt, 9))


def test_generate_samples_with_temperature(params):
    from jax_mha.lab.models import generate

    model, prompt = Decoder(CONFIG), jnp.array([[1, 2, 3], [4, 5, 6]])  # the shapes above: one compilation
    a = generate(params, model, prompt, 9, temperature=1.5, key=jax.random.key(0))
    b = generate(params, model, prompt, 9, temperature=1.5, key=jax.random.key(0))
    c = generate(params, model, prompt, 9, temperature=1.5, key=jax.random.key(1))
    np.testing.assert_array_equal(a, b)  # reproducible from the key
    assert not np.array_equal(a, c) and a.shape == (2, 12) and int(a.max()) < CONFIG.vocab_size
    np.testing.assert_array_equal(a[:, :3], prompt)
    with pytest.raises(ValueError, match="pass key"):
        generate(params, model, prompt, 3, temperature=0.5)
    with pytest.raises(ValueError, match="temperature must be"):
        generate(params, model, prompt, 3, temperature=-1.0)
    with pytest.raises(ValueError, match="max_len=13"):
        generate(params, model, prompt, 12)


# ----------------------------------------------------------------- --head-dim


def test_head_dim_sets_the_projection_widths():
    # d_model 15, 3 heads of size 7: attention is 21 wide, not 15 (5 per head).
    cfg = ModelConfig(vocab_size=11, max_len=13, d_model=15, num_heads=3, head_dim=7, num_layers=2, d_ff=22)
    assert (cfg.size_per_head, cfg.attention_width) == (7, 21)
    p = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 13), jnp.int32))["params"]  # shapes
    for layer in ("block_0", "block_1"):
        att = p[layer]["attention"]
        for name in ("query", "key", "value"):
            assert att[name]["kernel"].shape == (15, 21)
        assert att["out"]["kernel"].shape == (21, 15)
        assert set(p[layer]) == {"attention", "norm1", "norm2", "ffn"}  # the library block's names
    assert ModelConfig(d_model=15, num_heads=3).attention_width == 15  # default: heads share d_model


def test_head_dim_model_runs_and_returns_per_head_weights():
    cfg = ModelConfig(vocab_size=11, max_len=13, d_model=10, num_heads=4, head_dim=5, num_layers=2, d_ff=14)
    model = Decoder(cfg)
    tokens = jnp.arange(26).reshape(2, 13) % 11
    p = jax.jit(model.init)(jax.random.PRNGKey(1), tokens)["params"]
    run = jax.jit(lambda p, t: model.apply({"params": p}, t, return_weights=True))  # one program for both inputs
    logits, weights = run(p, tokens)
    assert logits.shape == (2, 13, 11) and weights.shape == (2, 2, 4, 13, 13)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=f32_tolerance(terms=2 * 13, magnitude=1.0))  # 2 sums over T
    # Causal: changing the last token leaves every earlier position's logits alone.
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 11)
    np.testing.assert_allclose(run(p, changed)[0][:, :-1], logits[:, :-1],
                               atol=f32_tolerance(terms=model_terms(10, 20, 14), magnitude=logits))


def test_head_dim_equal_to_the_shared_size_is_the_same_model(params):
    # The head-size study's check: h heads of d_model // h are the default model, with
    # the same parameter tree (a different tree would be refused by name).
    tokens = jnp.arange(26).reshape(2, 13) % 11
    same = Decoder(dataclasses.replace(CONFIG, head_dim=CONFIG.d_model // CONFIG.num_heads))
    np.testing.assert_array_equal(jax.jit(lambda p, t: same.apply({"params": p}, t))(params, tokens),
                                  jax.jit(lambda p, t: Decoder(CONFIG).apply({"params": p}, t))(params, tokens))


def test_decoder_errors_say_what_to_pass(params):
    tokens = jnp.arange(8).reshape(2, 4) % 11
    with pytest.raises(ValueError, match=re.escape('needs a "dropout" rng: pass apply(..., rngs={"dropout": key})')):
        Decoder(dataclasses.replace(CONFIG, dropout_rate=0.1)).apply({"params": params}, tokens, deterministic=False)
    cache = empty_cache(CONFIG, 2, 4)
    with pytest.raises(ValueError, match=re.escape('call apply(variables, x, mutable=["cache"])')):
        Decoder(CONFIG, decode=True).apply({"params": params, "cache": cache}, tokens[:, :1])


def test_head_dim_frees_num_heads_from_dividing_d_model():
    ModelConfig(d_model=10, num_heads=3, head_dim=4)  # 3 does not divide 10: fine with a head size
    with pytest.raises(ValueError, match="not divisible"):
        ModelConfig(d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="head_dim must be"):
        ModelConfig(d_model=10, num_heads=2, head_dim=0)


def test_head_dim_flag_reaches_the_ablation_config():
    from experiments import head_ablation

    args, cfg, _ = head_ablation.parse(["--task", "lm", "--preset", "tiny", "--head-dim", "3", "--heads", "1", "3"])
    assert cfg.model.head_dim == 3 and cfg.model_for(3).attention_width == 9 and cfg.model_for(1).attention_width == 3
    assert args.out.name.endswith("-head-dim3")


def test_logits_and_attention_weights_equals_return_weights(params):
    from jax_mha.lab.models import logits_and_attention_weights

    model = Decoder(CONFIG)
    tokens = (jnp.arange(3 * 13).reshape(3, 13) * 7) % 11
    logits, weights = logits_and_attention_weights(lambda t: model.apply({"params": params}, t), tokens)
    ref_logits, ref_weights = jax.jit(lambda p, t: model.apply({"params": p}, t, return_weights=True))(params, tokens)
    terms = model_terms(15, 15, 22)
    np.testing.assert_allclose(logits, ref_logits, atol=f32_tolerance(terms=terms, magnitude=ref_logits))
    np.testing.assert_allclose(weights, ref_weights, atol=f32_tolerance(terms=terms, magnitude=1.0))
    assert weights.shape == (2, 3, 3, 13, 13)
