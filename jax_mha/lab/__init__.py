"""The research harness the studies run on: models, tasks and data, text, the trainer,
checkpoints, analysis and head types.

It builds on the attention library (`jax_mha`) and is never imported by it: imports
point one way, `jax_mha` ← `jax_mha.lab` ← `experiments`. Import its modules
explicitly (`from jax_mha.lab import train`); nothing is re-exported here.
"""
