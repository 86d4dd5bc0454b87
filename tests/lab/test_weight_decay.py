"""AdamW's weight-decay mask: matrices decay, norms and biases do not (nanoGPT's rule)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_mha.lab.models import Decoder, ModelConfig
from jax_mha.lab.train import TrainConfig, init_state, make_optimizer, weight_decay_mask

CONFIG = ModelConfig(vocab_size=11, max_len=7, d_model=10, num_heads=2, num_layers=2, d_ff=13)


def _paths(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_mask_is_true_exactly_on_kernels_and_embeddings():
    params = jax.eval_shape(Decoder(CONFIG).init, jax.random.PRNGKey(0), jnp.zeros((1, 7), jnp.int32))["params"]
    mask = _paths(weight_decay_mask(params))  # the mask reads the tree's paths only
    decayed = {p for p, m in mask.items() if m}
    expected = {p for p in mask if p.endswith(("kernel", "embedding")) or p == "positions"}
    assert decayed == expected
    assert "embed/embedding" in decayed and "block_0/attention/query/kernel" in decayed
    exempt = set(mask) - decayed
    assert exempt and all(p.endswith(("scale", "bias")) for p in exempt)
    assert "final_norm/scale" in exempt
    assert "block_0/norm1/bias" in exempt and "block_1/ffn/" not in " ".join(p for p in decayed if not p.endswith("kernel"))


def test_adamw_step_with_zero_gradient_shrinks_only_decayed_leaves():
    # A zero gradient leaves only the decay term: kernels shrink, scales and biases stay.
    cfg = TrainConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, num_steps=50)
    model = Decoder(CONFIG)
    optimizer = make_optimizer(cfg)
    state = jax.jit(lambda key: init_state(key, model, optimizer))(jax.random.PRNGKey(1))
    params = jax.tree.map(lambda x: x + 1.0, state.params)  # biases start at 0: move every leaf off it
    # One program for the optimizer's init, update and its application (eagerly, each leaf's ops compile apart).
    step = lambda p: optax.apply_updates(p, optimizer.update(jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p)[0])
    new = _paths(jax.jit(step)(params))
    old, mask = _paths(params), _paths(weight_decay_mask(params))
    for path, value in new.items():
        if mask[path]:
            np.testing.assert_allclose(value, old[path] * (1 - 0.1 * 0.5), rtol=1e-5, err_msg=path)
        else:
            np.testing.assert_array_equal(value, old[path], err_msg=path)
