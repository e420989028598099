"""Decoding on a (data=2, fsdp=2, tensor=2) mesh of 8 host devices (run by
tests/core/test_sharded_decoding.py with XLA_FLAGS=--xla_force_host_platform_device_count=8).

Prints one JSON line: the greedy tokens of the same prompts from the inference engine
(`axcore.engine.offline`, as `axcore generate` runs it) on the mesh and on one device, and
the sharding of every leaf of the layers' dense KV cache (`init_cache` / `extend`, the
decode-versus-forward contract of the layers) that a prefill returns on the mesh.
"""

import json

import jax
import numpy as np

from axcore.engine.engine import Engine
from axcore.engine.offline import offline_config, run_requests
from axcore.engine.requests import GenerationRequest, SamplingParams
from axcore.experiment import load_experiment
from axcore.module import functional
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

MODEL = [*TINY_OVERRIDES, "plugins=[rope]", "model.decoder.layer.self_attention.num_heads=4",
         "model.decoder.layer.self_attention.num_kv_heads=2"]
MESH = ["mesh.mesh_shape=[2,2,2]", "mesh.mesh_axis_names=[data,fsdp,tensor]"]
PROMPTS = [np.array(p, np.int32) for p in ([72, 101, 108], [84], [87, 104, 97, 116, 32], [65, 66])]


def trainer_for(extra, devices):
    return Trainer(load_experiment(None, [*MODEL, *extra]), devices=devices)


def greedy(model, params) -> list[list[int]]:
    """8 greedy tokens of each prompt from an offline engine (run under the caller's op environment)."""
    engine = Engine(model, params, config=offline_config(model, [len(p) for p in PROMPTS], 8))
    requests = [GenerationRequest(f"p{i}", p.tolist(), SamplingParams(max_tokens=8, temperature=0.0))
                for i, p in enumerate(PROMPTS)]
    return [out.choices[0].token_ids for out in run_requests(engine, requests)]


def main() -> None:
    single = trainer_for([], jax.devices()[:1])
    params = jax.device_get(jax.jit(single.step.model.initialize)(jax.random.key(3)))
    with single.step.op_environment():
        one_device = greedy(single.step.model, params)
    mesh = trainer_for(MESH, jax.devices())
    placed = jax.device_put(params, mesh.step.state_shardings["params"])
    with mesh.step.op_environment():
        sharded = greedy(mesh.step.model, placed)
        prefill = jax.jit(
            lambda p, x: functional(mesh.step.model, p, (x, mesh.step.model.init_cache(4, 16)), None, False, method="extend")[0]
        )
        _, cache = prefill(placed, np.zeros((4, 8), np.int32))
    specs = {
        jax.tree_util.keystr(path): [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec]
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
    }
    print(json.dumps({
        "one_device": one_device,
        "sharded": sharded,
        "cache_specs": specs,
        "cache_shape": list(jax.tree.leaves(cache)[0].shape),
    }))


if __name__ == "__main__":
    main()
