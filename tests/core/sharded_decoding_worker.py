"""KV-cache decoding on a (data=2, fsdp=2, tensor=2) mesh of 8 host devices (run by
tests/core/test_sharded_decoding.py with XLA_FLAGS=--xla_force_host_platform_device_count=8).

Prints one JSON line: the greedy tokens of the same prompts on the mesh and on one
device, and the sharding of every KV-cache leaf the prefill returns on the mesh.
"""

import json

import jax
import numpy as np

from axcore.experiment import load_experiment
from axcore.generation import Generator
from axcore.module import functional
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.trainer import Trainer

MODEL = [*TINY_OVERRIDES, "plugins=[rope]", "model.decoder.layer.self_attention.num_heads=4",
         "model.decoder.layer.self_attention.num_kv_heads=2"]
MESH = ["mesh.mesh_shape=[2,2,2]", "mesh.mesh_axis_names=[data,fsdp,tensor]"]
PROMPTS = [np.array(p, np.int32) for p in ([72, 101, 108], [84], [87, 104, 97, 116, 32], [65, 66])]


def trainer_for(extra, devices):
    return Trainer(load_experiment(None, [*MODEL, *extra]), devices=devices)


def main() -> None:
    single = trainer_for([], jax.devices()[:1])
    params = jax.device_get(jax.jit(single.step.model.initialize)(jax.random.key(3)))
    with single.step.op_environment():
        one_device = Generator(single.step.model, max_new_tokens=8)(params, PROMPTS)
    mesh = trainer_for(MESH, jax.devices())
    placed = jax.device_put(params, mesh.step.state_shardings["params"])
    with mesh.step.op_environment():
        sharded = Generator(mesh.step.model, max_new_tokens=8)(placed, PROMPTS)
        prefill = jax.jit(
            lambda p, x: functional(mesh.step.model, p, (x, mesh.step.model.init_cache(4, 16)), None, False, method="extend")[0]
        )
        _, cache = prefill(placed, np.zeros((4, 8), np.int32))
    specs = {
        jax.tree_util.keystr(path): [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec]
        for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
    }
    print(json.dumps({
        "one_device": [t.tolist() for t in one_device],
        "sharded": [t.tolist() for t in sharded],
        "cache_specs": specs,
        "cache_shape": list(jax.tree.leaves(cache)[0].shape),
    }))


if __name__ == "__main__":
    main()
