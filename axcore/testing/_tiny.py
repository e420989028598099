"""A tiny model shared by tests that train (imported as `tiny`; tests/ is on sys.path
because pytest inserts the directory of tests/conftest.py)."""

import jax
import numpy as np

import axcore
from axcore.data import Split

# Overrides that shrink the default experiment to a model that compiles in seconds.
TINY = [
    "model.dim=32",
    "model.num_layers=2",
    "model.position_embedding.max_len=32",
    "model.decoder.layer.self_attention.num_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=64",
    "input.batch_size=4",
    "input.seq_len=32",
]


def train_steps(exp, steps=3, learning_rate=0.1):
    """`steps` SGD steps of the experiment's model on one batch; -> (params, losses)."""
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    loss_fn = lambda p: axcore.functional(model, p, (batch,), None, True)[0][0]  # noqa: E731

    @jax.jit
    def step(p):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda w, g: w - learning_rate * g, p, grads), loss

    losses = []
    for _ in range(steps):
        params, loss = step(params)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)), losses
    return params, losses


def run_host_device_worker(worker, timeout: float, devices: int = 8) -> dict:
    """The JSON last line of `python worker` run on `devices` host CPU devices (a fresh process,
    since the device count is fixed when JAX starts); fails with the worker's stderr tail."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    env.pop("SKIP_KERNELS", None)  # A worker's debugging switch, never inherited.
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
