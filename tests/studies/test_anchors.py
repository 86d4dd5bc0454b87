"""The published anchors (`experiments.anchor_*`) and what they added to the harness:
attention-only decoders (`ModelConfig(d_ff=0)`), the gated-convolution mixer
(`ModelConfig(mixer="gated_conv")`), evaluations from step 0 (`train_seeds(eval_steps=)`),
in-context Markov chains (`MarkovTaskConfig` and its strategies), single-token MQAR keys
(`RecallTaskConfig(key_tokens=1)`) and the repeat task's induction probe; and their
registration (experiments/preregistration/*.toml: read, recorded with its commit, a
dirty file refused). Each anchor runs once at its tiny size; the pieces are checked
against NumPy float64 references and brute-force counts."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import f32_tolerance

from experiments import anchor_induction, anchor_markov, anchor_mqar, common, common_anchors, report
from jax_mha.lab import head_types, stats
from jax_mha.lab.data import (
    FIRST_SYMBOL,
    MarkovTaskConfig,
    RecallTaskConfig,
    RepeatTaskConfig,
    in_context_strategies,
    sample_markov_chains,
    stationary_distribution,
    task_from_dict,
    task_to_dict,
)
from jax_mha.lab.models import Decoder, GatedConvMixer, ModelConfig, causal_conv, generate, model_to_dict
from jax_mha.lab.train import TrainConfig, scored_loss, train_seeds

# ----------------------------------------------------------------- attention-only decoder


def _layer_norm(x, p, eps=1e-6):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(p["scale"], np.float64) + np.asarray(p["bias"], np.float64)


def _attention_only_reference(params, tokens, num_heads: int, head_dim: int) -> np.ndarray:
    """Float64 NumPy forward of a pre-norm attention-only decoder: `(B, T) -> (B, T, V)`."""
    f64 = lambda a: np.asarray(a, np.float64)
    t = tokens.shape[1]
    x = f64(params["embed"]["embedding"])[tokens] + f64(params["positions"])[:t]
    causal = np.tril(np.ones((t, t), bool))
    layer = 0
    while f"block_{layer}" in params:
        blk = params[f"block_{layer}"]
        y = _layer_norm(x, blk["norm1"])
        split = lambda w: (y @ f64(w)).reshape(*y.shape[:2], num_heads, head_dim).transpose(0, 2, 1, 3)  # (B, H, T, D)
        q, k, v = (split(blk["attention"][n]["kernel"]) for n in ("query", "key", "value"))
        s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim), -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = (w @ v).transpose(0, 2, 1, 3).reshape(*y.shape[:2], num_heads * head_dim)
        x = x + o @ f64(blk["attention"]["out"]["kernel"]) + f64(blk["attention"]["out"]["bias"])
        layer += 1
    x = _layer_norm(x, params["final_norm"])
    return x @ f64(params["logits"]["kernel"]) + f64(params["logits"]["bias"])


# Jitted: init and apply called eagerly would compile each of their operations on its own.
def _init(module, x, seed=0):
    """`module.init(key(seed), x)["params"]` as one program."""
    return jax.jit(lambda key, x: module.init(key, x)["params"])(jax.random.key(seed), x)


def _apply(module, params, x, **kwargs):
    """`module.apply({"params": params}, x, **kwargs)` as one program."""
    return jax.jit(lambda p, x: module.apply({"params": p}, x, **kwargs))(params, x)


@jax.jit
def _off_init(params):
    """Every parameter moved off its initial value (zero biases, unit scales) by N(0, 0.3²)."""
    return jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape), params)


def _tokens(seed, shape, vocab):
    """Uniform token ids, drawn in NumPy (no program per shape)."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def test_attention_only_decoder_matches_a_float64_reference():
    # Every size different (V 7, T 11, d 5, H 3, D 2: attention width 6 != d) so a swapped axis cannot pass.
    cfg = ModelConfig(vocab_size=7, max_len=13, d_model=5, num_heads=3, head_dim=2, num_layers=2, d_ff=0)
    model = Decoder(cfg)
    tokens = _tokens(1, (2, 11), 7)
    params = _init(model, tokens)
    for name in ("block_0", "block_1"):
        assert sorted(params[name]) == ["attention", "norm1"]  # no ffn, no norm2
    params = _off_init(params)
    logits, weights = _apply(model, params, tokens, return_weights=True)
    want = _attention_only_reference(params, np.asarray(tokens), 3, 2)
    # Per layer: the norm (mean and variance over d), the projections over d, the logits
    # over D, the softmax sum and weights @ v over T, the output projection over H*D;
    # the final norm, the logits.
    terms = 2 * (2 * 2 * 5 + 5 + 2 + 2 * 11 + 6) + 2 * 5 + 5
    np.testing.assert_allclose(logits, want, atol=f32_tolerance(terms=terms, magnitude=want))
    assert weights.shape == (2, 2, 3, 11, 11)


def test_attention_only_decoder_decodes_through_its_cache_and_refuses_a_negative_width():
    cfg = ModelConfig(vocab_size=7, max_len=13, d_model=6, num_heads=2, num_layers=2, d_ff=0)
    model = Decoder(cfg)
    prompt = _tokens(3, (3, 4), 7)
    params = _init(model, prompt)
    out = generate(params, model, prompt, 7)  # through the KV cache, token by token
    full = _apply(model, params, out)  # the whole sequence at once
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(full[:, 3:-1], -1))  # each token the full pass's argmax
    with pytest.raises(ValueError, match="d_ff must be >= 0, got -1"):
        ModelConfig(d_ff=-1)


# ----------------------------------------------------------------- the gated-convolution mixer


def test_causal_conv_equals_a_loop_for_short_and_long_filters():
    x = np.random.default_rng(0).normal(size=(2, 13, 3)).astype(np.float32)
    for taps in (1, 3, 13, 20):  # shifted copies (<= 8 taps), the Toeplitz product, a filter longer than T
        kernel = np.random.default_rng(taps).normal(size=(taps, 3)).astype(np.float32)
        want = np.zeros_like(x, np.float64)
        for t in range(13):
            for j in range(min(taps, t + 1)):
                want[:, t] += kernel[j] * x[:, t - j]
        np.testing.assert_allclose(causal_conv(jnp.asarray(x), jnp.asarray(kernel)), want, atol=1e-5, err_msg=taps)


def test_gated_conv_mixer_shapes_and_causality():
    mixer = GatedConvMixer(max_len=16, kernel_size=3)
    x = np.random.default_rng(0).standard_normal((2, 5, 11, 6)).astype(np.float32)  # extra batch axes (B…, T, d)
    params = _init(mixer, x, seed=1)
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes == {"in_proj": {"kernel": (6, 18), "bias": (18,)}, "short_filter": (3, 18), "long_filter": (16, 6),
                      "out_proj": {"kernel": (6, 6), "bias": (6,)}}
    apply = jax.jit(lambda p, x: mixer.apply({"params": p}, x))
    y = apply(params, x)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    for t in (0, 4, 9):  # the output up to t is the same, exactly, whatever comes after t
        later = x.copy()
        later[..., t + 1:, :] = np.random.default_rng(t + 2).standard_normal(x[..., t + 1:, :].shape)
        z = apply(params, later)
        np.testing.assert_array_equal(z[..., : t + 1, :], y[..., : t + 1, :])
        assert not np.allclose(z[..., t + 1:, :], y[..., t + 1:, :])  # and what follows does change
    with pytest.raises(ValueError, match="exceeds the long filter's max_len=16"):
        mixer.apply({"params": params}, jnp.zeros((1, 17, 6)))


def test_gated_conv_decoder_is_causal_and_refuses_what_needs_heads():
    cfg = ModelConfig(vocab_size=9, max_len=12, d_model=8, num_heads=1, num_layers=2, d_ff=0, mixer="gated_conv",
                      conv_kernel=4)
    model = Decoder(cfg)
    tokens = _tokens(0, (3, 12), 9)
    params = _init(model, tokens, seed=1)
    assert sorted(params["block_0"]) == ["mixer", "norm1"] and params["block_1"]["mixer"]["short_filter"].shape == (4, 24)
    apply = jax.jit(lambda p, t: model.apply({"params": p}, t))
    logits = apply(params, tokens)
    assert logits.shape == (3, 12, 9)
    changed = np.asarray(tokens).copy()
    changed[:, 7:] = (changed[:, 7:] + 1) % 9
    np.testing.assert_array_equal(apply(params, changed)[:, :7], logits[:, :7])
    for kwargs in ({"return_weights": True}, {"head_mask": jnp.ones((2, 1))}):
        with pytest.raises(ValueError, match="has no heads"):
            model.apply({"params": params}, tokens, **kwargs)
    for bad, match in (({"mixer": "ssm"}, "mixer must be one of"), ({"mixer": "gated_conv", "d_ff": 16}, "set d_ff=0"),
                       ({"conv_kernel": 0}, "conv_kernel must be >= 1")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**bad)
    # Attention models' dicts (and so the fingerprints of runs saved before the mixer existed) are unchanged.
    assert "mixer" not in model_to_dict(ModelConfig()) and "conv_kernel" not in model_to_dict(ModelConfig())
    assert ModelConfig(**model_to_dict(cfg)) == cfg and ModelConfig(**model_to_dict(ModelConfig())) == ModelConfig()


def test_gated_conv_trains_and_evaluations_start_at_step_0():
    task = RecallTaskConfig(num_pairs=2, num_queries=2, num_key_symbols=4, num_values=4, key_tokens=1)
    cfg = ModelConfig(vocab_size=task.vocab_size, max_len=task.seq_len, d_model=8, num_heads=1, num_layers=1, d_ff=0,
                      mixer="gated_conv")
    train = TrainConfig(batch_size=4, num_steps=6, steps_per_call=2, eval_every=6, eval_size=8, early_stop=False)
    seen = []
    result = train_seeds(cfg, task, train, [0, 1], eval_steps=(0, 2), callback=lambda r: seen.append(r["step"]))
    assert result.evals["step"].tolist() == [0, 2, 6] and result.evals["recall_accuracy"].shape == (2, 3)
    assert seen == [0, 2, 4, 6]  # step 0's evaluation reported before the first chunk
    with pytest.raises(ValueError, match=r"eval_steps \[3\] are not multiples of steps_per_call=2"):
        train_seeds(cfg, task, train, [0], eval_steps=(3,))


# ----------------------------------------------------------------- in-context Markov chains


def _brute_force_strategies(tokens: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Position by position, by counting in Python: the definitions of the docstring."""
    b, t = tokens.shape
    uni, bi = np.zeros((b, t, k)), np.zeros((b, t, k))
    for r in range(b):
        for i in range(t):
            seen = tokens[r, : i + 1].tolist()
            uni[r, i] = [(seen.count(j) + 1) / (i + 1 + k) for j in range(k)]
            after = [seen[s + 1] for s in range(i) if seen[s] == seen[i]]
            bi[r, i] = [(after.count(j) + 1) / (len(after) + k) for j in range(k)]
    return {"uniform": np.full((b, t, k), 1 / k), "unigram": uni, "bigram": bi}


def test_in_context_strategies_equal_brute_force_counts():
    tokens = np.random.default_rng(0).integers(0, 5, (3, 17))
    got = in_context_strategies(jnp.asarray(tokens), 5)
    for name, want in _brute_force_strategies(tokens, 5).items():
        np.testing.assert_allclose(got[name], want, atol=1e-6, err_msg=name)


def test_markov_eval_metrics_are_the_strategies_losses_and_divergences():
    task = MarkovTaskConfig(seq_len=13, num_states=5)

    @jax.jit  # one program, not one per operation
    def metrics(key):
        batch = task.batch(key, 7)
        bigram = in_context_strategies(batch["inputs"], 5)["bigram"]
        logits = jnp.log(bigram) + 3.0  # softmax-invariant shift: the model *is* the bigram strategy
        return batch, logits, task.eval_metrics(None, logits, batch), scored_loss(logits, batch)[0]

    batch, logits, out, loss = metrics(jax.random.key(4))
    assert batch["inputs"].shape == (7, 13)
    # The float32 sums: a softmax over the 5 states, the means over the 7 x 13 tokens, of
    # log-probabilities of the logits' size.
    tol = f32_tolerance(terms=5 + 7 * 13, magnitude=logits)
    assert abs(float(out["kl_bigram"])) < tol and float(out["kl_unigram"]) > 1e-3
    np.testing.assert_allclose(out["bigram_loss"], loss, atol=tol)
    np.testing.assert_allclose(out["uniform_loss"], math.log(5), atol=f32_tolerance(terms=5 + 7 * 13,
                                                                                    magnitude=math.log(5)))


def test_markov_chains_follow_their_transition_matrices():
    task = MarkovTaskConfig(seq_len=3001, num_states=3)
    transitions, tokens = (np.asarray(x) for x in sample_markov_chains(jax.random.key(5), task, 2))
    pi = np.asarray(stationary_distribution(jnp.asarray(transitions)))
    np.testing.assert_allclose(np.einsum("bi,bij->bj", pi, transitions), pi, atol=1e-5)
    for r in range(2):
        counts = np.zeros((3, 3))
        np.add.at(counts, (tokens[r, :-1], tokens[r, 1:]), 1)
        seen = counts.sum(1) > 300  # rows visited often enough to estimate
        np.testing.assert_allclose((counts / counts.sum(1, keepdims=True))[seen], transitions[r][seen], atol=0.08)
    for bad, match in (({"num_states": 1}, "num_states"), ({"concentration": float("nan")}, "concentration"),
                       ({"concentration": 0}, "concentration")):
        with pytest.raises(ValueError, match=match):
            MarkovTaskConfig(**bad)
    assert task_from_dict(task_to_dict(task)) == task


# ----------------------------------------------------------------- single-token MQAR keys, the induction probe


def test_single_token_keys_score_the_value_of_the_queried_key():
    task = RecallTaskConfig(num_pairs=5, num_queries=7, num_key_symbols=11, num_values=3, key_tokens=1)
    batch = jax.tree.map(np.asarray, task.batch(jax.random.key(6), 13))
    assert task.seq_len == 2 * (5 + 7) + 1 == batch["inputs"].shape[1]
    for row, target, scored in zip(batch["inputs"], batch["targets"], batch["scored"]):
        pairs = dict(zip(row[1:11:2].tolist(), row[2:11:2].tolist()))
        assert len(pairs) == 5  # distinct keys
        assert [pairs[row[i]] for i in np.flatnonzero(scored)] == target[scored].tolist()
    with pytest.raises(ValueError, match="key_tokens must be 1 or 2, got 3"):
        RecallTaskConfig(key_tokens=3)
    assert "key_tokens" not in task_to_dict(RecallTaskConfig())  # saved runs' fingerprints unchanged
    assert task_from_dict(task_to_dict(task)) == task


def test_repeat_probe_and_its_prefix_matching_at_evaluation():
    task = RepeatTaskConfig(seq_len=12, min_repeat=2, max_repeat=6, num_symbols=8, track_induction=True)
    probe, r = task.induction_probe(), task.probe_repeat
    assert probe.shape == (32, 2 * r) and (probe[:, :r] == probe[:, r:]).all()
    assert all(len(set(row[:r])) == r for row in probe) and probe.min() >= FIRST_SYMBOL
    model = Decoder(ModelConfig(vocab_size=task.vocab_size, max_len=12, d_model=6, num_heads=2, num_layers=2, d_ff=0))
    params = _init(model, jnp.asarray(probe))
    logits_fn = lambda t: model.apply({"params": params}, t)
    out = jax.jit(lambda p: task.eval_metrics(lambda t: model.apply({"params": p}, t), None, None))(params)
    _, weights = _apply(model, params, jnp.asarray(probe), return_weights=True)  # the model's own weights
    want = jax.jit(head_types.prefix_matching_score, static_argnums=1)(weights, r)
    # The weights' sums (two attention-only layers of d 6, T 12), then the score's mean over the probes' rows.
    terms = 2 * (2 * 2 * 6 + 6 + 3 + 2 * 12 + 6) + 32 * 2 * r
    np.testing.assert_allclose(out["prefix_matching"], want, atol=f32_tolerance(terms=terms, magnitude=want))
    assert RepeatTaskConfig().eval_metrics(logits_fn, None, None) == {}


# ----------------------------------------------------------------- the anchors at their tiny size


def _git_commit_of(path) -> str:
    return subprocess.run(["git", "-C", str(path.parent), "log", "-1", "--format=%H", "--", path.name],
                          capture_output=True, text=True, check=True).stdout.strip()


def _run(module, tmp_path, *extra):
    out = tmp_path / module.NAME
    module.main(["--preset", "tiny", "--out", str(out), "--no-progress", *extra])
    results = json.loads((out / "results.json").read_text())
    data = json.loads((out / "artifact.json").read_text())
    assert (out / f"anchor_{module.NAME}.png").stat().st_size > 0 and (out / "summary.md").exists()
    for block in common_anchors.RENDERERS[data["kind"]]:
        assert report.render(data, block).strip()  # the page's blocks render from the artifact
    reg = data["preregistration"]  # the registration file read, and the commit that last touched it
    assert reg["file"] == f"experiments/preregistration/anchor_{module.NAME}.toml"
    assert reg["commit"] == _git_commit_of(module.REGISTRATION) and len(reg["commit"]) == 40
    assert reg["preset"] == "tiny" and reg["registered"] is False and results["config"]["preregistration"] == reg
    verdict = report.render(data, "verdict")
    assert "Not the registered run: preset tiny" in verdict
    assert "**No verdict**" in verdict or verdict.startswith("Not decided")
    return out, results, data


def test_induction_anchor_tiny(tmp_path):
    # One layer and the preset's 10 steps: the very run of the registration test below, which
    # then finds its programs compiled. One layer of two heads also tells the axes apart.
    _, results, data = _run(anchor_induction, tmp_path, "--layers", "1", "--steps", "10")
    arm = data["arms"]["1"]
    assert arm["seeds"] == [0, 1] and len(arm["max_prefix_matching"]) == 2
    assert data["preregistration"]["overrides"] == {"layers": [1], "steps": 10}
    r = results["probe_repeat"]
    assert data["chance"] == pytest.approx(head_types.prefix_matching_chance(r))
    run = results["arms"]["1"]["runs"][0]
    pm = np.asarray(run["prefix_matching"])  # (evaluations, layers, heads)
    assert pm.shape[1:] == (1, 2) and (0 <= pm).all() and (pm <= 1).all()
    assert run["max_prefix_matching"] == pytest.approx(pm[-1].max())


def test_induction_curves_block_reads_the_crossings_from_the_mean_curves():
    curves = {"1": {"step": [25, 50, 75, 100], "loss": [3.5, 2.5, 2.0, 1.8], "best_prefix_matching": [0.07, 0.1, 0.12, 0.13],
                    "best_prefix_matching_max": [0.08, 0.11, 0.19, 0.14]},
              "2": {"step": [25, 50, 75, 100], "loss": [3.4, 1.7, 1.9, 0.1], "best_prefix_matching": [0.07, 0.2, 0.6, 0.9],
                    "best_prefix_matching_max": [0.07, 0.3, 0.7, 0.95]}}
    data = {"kind": "anchor_induction", "threshold": 0.5, "train": {"eval_every": 25}, "curves": curves}
    text = report.render(data, "curves")
    # 1.7 at step 50 dips below 1.8 but 1.9 at 75 does not: "stays below" starts at 100.
    assert "below the one-layer model's final 1.80 from step 100 and below ten times its own final (1.00) from step 100" in text
    assert "starts at 0.070, passes twice that at step 50 (0.200), passes 0.5 at step 75 and ends at 0.900" in text
    assert "one-layer model's best head peaks at 0.190" in text
    assert report.render({**data, "curves": {"1": curves["1"]}}, "curves") == "No curves of both depths in this run's data."


def test_mqar_anchor_tiny_trains_both_arms_at_every_length_and_resumes(tmp_path, monkeypatch):
    out, results, data = _run(anchor_mqar, tmp_path)
    lengths = [9, 13]  # 2 and 3 pairs: T = 4N + 1
    assert [x["seq_len"] for x in data["lengths"]] == lengths and data["widths"] == [8]
    assert {arm: sorted(data["cells"][arm]) for arm in data["cells"]} == {a: ["13", "9"] for a in ("attention", "gated_conv")}
    for t in lengths:
        assert data["reference"][str(t)]["chance"] == pytest.approx(1 / 4)
    accs = data["cells"]["gated_conv"]["13"]["8"]["final_accuracy"]
    assert accs == [run["recall_accuracy"][-1] for run in results["arms"]["gated_conv T=13 d=8"]["runs"]]
    assert common_anchors.mqar_rule(data) is not None  # a whole grid: the rule decides
    assert "not registered" not in report.render(data, "verdict").lower()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished cell was trained again")

    monkeypatch.setattr(common_anchors, "train_seeds", no_training)
    again = anchor_mqar.main(["--preset", "tiny", "--out", str(out), "--no-progress"])
    assert again["arms"]["gated_conv T=13 d=8"]["runs"][0]["final_accuracy"] == accs[0]


def test_markov_anchor_tiny_lines_are_the_trainers_held_out_rows(tmp_path):
    _, results, data = _run(anchor_markov, tmp_path, "--layers", "2")
    arm = results["arms"]["2"]
    assert arm["eval_step"] == [0, 2, 4, 10] and data["train"]["eval_steps"] == [0, 2, 4, 10]  # from step 0
    for name in ("uniform", "unigram", "bigram"):  # computed apart, from the trainer's eval key: the same rows
        assert arm["strategy_losses"][name] == pytest.approx(data["reference"][name], abs=1e-5)
    assert data["reference"]["oracle"] < data["reference"]["bigram"] < data["reference"]["uniform"]
    for stages in data["arms"]["2"]["stages"]:
        assert stages[0] == ["uniform", 0]  # the initial parameters predict nearly uniformly
        assert [s for s, _ in stages][0] in anchor_markov.STRATEGIES
        assert [step for _, step in stages] == sorted(step for _, step in stages)
    assert "seeds closest to uniform at the first evaluation (step 0)" in report.render(data, "table")


# ----------------------------------------------------------------- registration


def _registration(name: str) -> dict:
    return common_anchors.read_registration(common_anchors.registration_path(name))


def test_registrations_state_rule_config_and_source():
    for name in ("induction", "mqar", "markov"):
        reg = _registration(name)
        assert reg["registered_preset"] == "standard" and {"cite", "where", "result"} <= set(reg["published"])
        assert reg["rule"]["text"].strip() and "tiny" in reg["presets"]
        module = {"induction": anchor_induction, "mqar": anchor_mqar, "markov": anchor_markov}[name]
        for preset in reg["presets"].values():  # every preset builds (the configs check themselves)
            module.from_preset(preset, reg["rule"])
    reg = _registration("mqar")
    cfg = anchor_mqar.from_preset(reg["presets"]["standard"], reg["rule"])
    assert cfg.arms == ("attention", "gated_conv") and len(cfg.widths) >= 3 and len(cfg.lengths) >= 2
    assert set(cfg.cells()) == {(a, n, w) for a in cfg.arms for n in cfg.lengths for w in cfg.widths}
    assert {cfg.model_for(a, cfg.lengths[0], cfg.widths[0]).mixer for a in cfg.arms} == {"attention", "gated_conv"}
    lengths = [cfg.task_for(x).seq_len for x in cfg.lengths]
    assert lengths == sorted(lengths) and lengths[0] > 33 and cfg.task.vocab_size > 68  # not the old settings
    assert all(cfg.model_for(a, x, w).max_len == cfg.task_for(x).seq_len for a, x, w in cfg.cells())
    assert (cfg.solved_accuracy, cfg.min_drop) == (reg["rule"]["solved_accuracy"], reg["rule"]["min_drop"])
    assert "quick" in reg["presets"] and "not the registered run" in reg["presets"]["quick"]["description"]
    markov = anchor_markov.from_preset(_registration("markov")["presets"]["standard"], {})
    early = [s for s in markov.eval_steps if s <= 20]
    assert early[0] == 0 and max(np.diff(early)) <= 5 and markov.eval_steps[-1] == markov.train.num_steps


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
                   check=True, capture_output=True)


def test_registration_is_recorded_with_its_commit_and_a_dirty_one_is_refused(tmp_path, monkeypatch, capsys):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    reg = repo / "prereg" / "anchor_induction.toml"
    reg.parent.mkdir()
    monkeypatch.setattr(anchor_induction, "REGISTRATION", reg)
    argv = ["--preset", "tiny", "--layers", "1", "--steps", "10", "--out", str(tmp_path / "out"), "--no-progress"]

    def refused(match: str):
        with pytest.raises(SystemExit) as e:
            anchor_induction.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert match in err[-1] and err[-1].startswith("python -m experiments.anchor_induction: error:"), err

    shutil.copy(common_anchors.registration_path("induction"), reg)
    refused("prereg/anchor_induction.toml has uncommitted changes")  # untracked: never committed
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "register")
    first = _git_commit_of(reg)
    _git(repo, "commit", "-q", "--allow-empty", "-m", "a later commit that does not touch the file")
    results = anchor_induction.main(argv)
    assert results["config"]["preregistration"] == {
        "file": "prereg/anchor_induction.toml", "commit": first, "preset": "tiny", "registered_preset": "standard",
        "registered": False, "overrides": {"layers": [1], "steps": 10}}
    data = json.loads((tmp_path / "out" / "artifact.json").read_text())
    assert data["preregistration"]["commit"] == first != common.git_state(repo)["commit"]
    reg.write_text(reg.read_text().replace("num_steps = 10", "num_steps = 20"))  # changed after the commit
    refused("prereg/anchor_induction.toml has uncommitted changes")
    _git(repo, "add", ".")
    refused("has uncommitted changes")  # staged is not committed either
    outside = tmp_path / "elsewhere" / "anchor_induction.toml"
    outside.parent.mkdir()
    shutil.copy(common_anchors.registration_path("induction"), outside)
    monkeypatch.setattr(anchor_induction, "REGISTRATION", outside)
    refused("is not in a git checkout")


def test_pages_data_say_whether_registered_and_registrations_precede_their_runs():
    for name in ("induction", "mqar", "markov"):
        data = json.loads((report.DATA / f"anchor_{name}.json").read_text())
        verdict = report.render(data, "verdict")
        if "preregistration" not in data:
            assert "Not registered: these data record no registration" in verdict
            continue
        reg, meta = data["preregistration"], data["metadata"]
        assert reg["registered"] and not reg["overrides"] and meta["dirty"] is False, (name, reg, meta)
        assert f"at commit `{reg['commit'][:10]}`" in verdict and "committed before the run" in verdict
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", reg["commit"], meta["commit"]],
                                  cwd=report.ROOT, capture_output=True)
        if ancestor.returncode not in (0, 1):  # not a git checkout, or a shallow one without these commits
            continue
        assert ancestor.returncode == 0, f"{name}: registration {reg['commit']} does not precede the run {meta['commit']}"
        assert reg["commit"] != meta["commit"]  # registered in a commit of its own, before the run's


def _mqar_data(conv: dict, attention_ok: bool = True) -> dict:
    """Artifact-shaped data with two lengths and two widths; conv: {(T, d): [accuracies]}."""
    cells = {"attention": {str(t): {str(d): {"final_accuracy": [1.0, 0.95 if attention_ok else 0.5]}
                                    for d in (64, 128)} for t in (65, 129)},
             "gated_conv": {str(t): {} for t in (65, 129)}}
    for (t, d), accs in conv.items():
        cells["gated_conv"][str(t)][str(d)] = {"final_accuracy": accs}
    return {"solved_accuracy": 0.9, "min_drop": 0.1, "widths": [64, 128], "cells": cells,
            "reference": {"65": {"value_mode": 0.27}, "129": {"value_mode": 0.14}},
            "lengths": [{"seq_len": 65, "num_pairs": 4}, {"seq_len": 129, "num_pairs": 8}]}


def test_mqar_rule_as_registered():
    falls = {(65, 64): [0.6, 0.7], (129, 64): [0.3, 0.3], (65, 128): [1.0, 0.99], (129, 128): [0.95, 0.97]}
    assert common_anchors.mqar_rule(_mqar_data(falls))["ok"]  # d=128 solves both: exempt; d=64 falls by 0.35
    assert not common_anchors.mqar_rule(_mqar_data(falls, attention_ok=False))["ok"]  # (A) fails
    small = {**falls, (129, 64): [0.6, 0.65]}  # falls at every width, by 0.025 only: no fall >= 0.1
    assert common_anchors.mqar_rule(_mqar_data(small))["b"] is False
    floor = {**falls, (65, 64): [0.28, 0.3], (129, 64): [0.14, 0.15]}  # falls by 0.145, but with the no-lookup
    assert common_anchors.mqar_rule(_mqar_data(floor))["big_drop"] is False  # line (0.27 -> 0.14): no lookup lost
    rises = {**falls, (65, 128): [0.5, 0.5], (129, 128): [0.6, 0.6]}  # higher at the longer length at d=128
    rule = common_anchors.mqar_rule(_mqar_data(rises))
    assert not rule["b"] and [d["passes"] for d in rule["drops"]] == [True, False]
    assert common_anchors.mqar_rule(_mqar_data({(65, 64): [0.5]})) is None  # cells missing: not decided


def test_common_anchors_count_and_order():
    stages = [[["uniform", 20], ["unigram", 60], ["bigram", 400]], [["uniform", 20], ["bigram", 80], ["unigram", 90]],
              [["unigram", 20], ["bigram", 80]]]
    assert common_anchors.markov_staged({"stages": stages}) == [True, False, False]  # ends at unigram; no uniform
    assert common_anchors.steps_cell([300, None, 100, 200]) == "200 (100–300; 3/4)"
    low, high = stats.wilson_interval(3, 5)
    assert common_anchors.share([True, True, False, True, False]) == f"3/5 [{low:.2f}, {high:.2f}]"
