"""The induction probe's positive control: a model that must do
induction, and what the probe says about it.

A 2-layer, 2-head decoder (d_model = 32) trains 800 steps on repeated random sequences
of varying length (`jax_mha.lab.data.RepeatTaskConfig`: no fixed offset finds the
answer, only looking up the previous occurrence does), then is probed as the language
models are: per-head prefix-matching score on 64 rows of 12 distinct symbols repeated,
against uniform attention's score, and the copying effect. If this model did not score
above the threshold, the probe, not the language models, would be at fault.
`tests/studies/test_induction_control.py` runs the same function and asserts the threshold.

    python -m experiments.induction_control            # about 30 s on 2 cores
    python -m experiments.induction_control --seed 1
    python -m experiments.induction_control --artifact docs/results/data/induction_control.json

`--artifact` writes what docs/results/induction.md is rendered from (`experiments.report`,
kind "induction_control").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from experiments import common
from jax_mha.lab import head_types
from jax_mha.lab.data import FIRST_SYMBOL, RepeatTaskConfig
from jax_mha.lab.models import Decoder, ModelConfig, logits_and_attention_weights
from jax_mha.lab.train import TrainConfig, train_seeds

TASK = RepeatTaskConfig(seq_len=32, min_repeat=4, max_repeat=16, num_symbols=24)
MODEL = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=32, num_heads=2, num_layers=2, d_ff=64)
TRAIN = TrainConfig(batch_size=32, num_steps=800, learning_rate=3e-3, warmup_steps=30, steps_per_call=100,
                    eval_every=800, eval_size=64, early_stop=False)
PROBE_REPEAT = 12  # R of the probe: inside the trained range [4, 16], a length the model never saw fixed


def run(seed: int = 0) -> dict:
    """Trains the control at `seed` and probes it; returns scores and timings."""
    start = time.perf_counter()
    result = train_seeds(MODEL, TASK, TRAIN, [seed])
    params = jax.tree.map(lambda x: x[0], result.state.params)
    model = Decoder(MODEL)
    probe = head_types.repeated_symbols(jax.random.PRNGKey(7), 64, PROBE_REPEAT,
                                        np.arange(FIRST_SYMBOL, TASK.vocab_size))
    logits, weights = logits_and_attention_weights(lambda t: model.apply({"params": params}, t), probe)
    copying = head_types.copying_effect(logits, probe, PROBE_REPEAT)
    return {"seed": seed, "prefix_matching": np.asarray(head_types.prefix_matching_score(weights, PROBE_REPEAT)),
            "chance": head_types.prefix_matching_chance(PROBE_REPEAT),
            "threshold": head_types.INDUCTION_THRESHOLD,
            "heldout_token_accuracy": float(result.evals["token_accuracy"][0, -1]),
            **{k: float(v) for k, v in copying.items()}, "seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m experiments.induction_control", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=common.nonnegative_int, default=0)
    p.add_argument("--artifact", type=Path, help="also write the results as a data file a results page reads")
    args = p.parse_args(argv)
    out = run(args.seed)
    print(f"positive control, seed {out['seed']}: 2 layers x 2 heads, d_model=32, {TRAIN.num_steps} steps on "
          f"repeated random sequences (R in [{TASK.min_repeat}, {TASK.max_repeat}]); held-out second-copy token "
          f"accuracy {out['heldout_token_accuracy']:.3f}")
    for layer, row in enumerate(out["prefix_matching"]):
        print(f"  layer {layer}: prefix matching " + ", ".join(f"head {h} {v:.3f}" for h, v in enumerate(row)))
    print(f"  uniform attention scores {out['chance']:.3f}; threshold {out['threshold']}; best head "
          f"{out['prefix_matching'].max():.3f} ({out['prefix_matching'].max() / out['chance']:.1f}x chance)")
    print(f"  copying: first-copy loss {out['first_copy_loss']:.3f}, second-copy loss {out['second_copy_loss']:.3f} "
          f"nats (effect {out['copying']:.3f}); {out['seconds']:.0f} s")
    if args.artifact:
        common.write_json(args.artifact, artifact(out))
        print(f"wrote {args.artifact}")
    return out


def artifact(out: dict) -> dict:
    """The control's results as a results page reads them (`experiments.report`)."""
    return {"kind": "induction_control", "task": {"seq_len": TASK.seq_len, "min_repeat": TASK.min_repeat,
                                                  "max_repeat": TASK.max_repeat, "num_symbols": TASK.num_symbols,
                                                  "vocab_size": TASK.vocab_size},
            "model": {"d_model": MODEL.d_model, "num_heads": MODEL.num_heads, "num_layers": MODEL.num_layers},
            "train": {"num_steps": TRAIN.num_steps, "learning_rate": TRAIN.learning_rate},
            "probe_repeat": PROBE_REPEAT, "metadata": common.run_metadata(),
            **{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in out.items()}}


if __name__ == "__main__":
    main()
