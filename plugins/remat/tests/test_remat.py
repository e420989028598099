"""The remat plugin: remat_policy on every scanned stack, same gradients, fewer saved residuals."""

import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import find
from axcore.errors import ConfigError, NoMatchError
from axcore.experiment import load_experiment
from axcore.experiment.config_modifiers import remat
from axcore.layers import RepeatedTransformer


def test_scan_experiment_gets_the_policy():
    exp = load_experiment("scan", ["plugins=[remat]"])
    flat = exp.flat()
    assert "model.decoder.remat_policy: nothing_saveable" in flat
    assert "remat.policy: nothing_saveable" in flat
    assert [c.remat_policy for _, c in find(exp.config, RepeatedTransformer)] == ["nothing_saveable"]
    exp = load_experiment("scan", ["plugins=[remat]", "remat.policy=dots_saveable"])
    assert "model.decoder.remat_policy: dots_saveable" in exp.flat()


def test_a_model_without_a_scanned_stack_is_an_error_naming_the_plugin():
    with pytest.raises(NoMatchError, match=r"Plugin 'remat' found nothing to transform.*RepeatedTransformer"):
        load_experiment(None, ["plugins=[remat]"])


def test_an_unknown_policy_is_an_error():
    with pytest.raises(ConfigError, match=r"remat.policy 'save_everything' is not in jax.checkpoint_policies"):
        load_experiment("scan", ["plugins=[remat]", "remat.policy=save_everything"])


def _stack(policy):
    pm = axcore.create_plugin_manager()
    cfg = RepeatedTransformer.default_config().set(input_dim=32, num_layers=2, remat_policy=policy)
    cfg.layer.self_attention.set(num_heads=2, causal=True)
    cfg.layer.feed_forward.hidden_dim = 64
    return cfg.instantiate(name="decoder", registries=pm.registries)


def _loss_fn(stack):
    def loss(params, x):
        out, _ = axcore.functional(stack, params, (x,), None, True)
        return jnp.sum(jnp.sin(out))

    return loss


def test_gradients_equal_without_remat_and_fewer_residuals_are_saved(capsys):
    plain, remat = _stack(None), _stack("nothing_saveable")
    rng = np.random.default_rng(0)
    # Random parameters of the right tree (initialize() would compile a sampler per shape).
    draw = lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype)  # noqa: E731
    params = jax.tree.map(draw, plain.abstract_parameters())
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    both = jax.jit(lambda p, x: (jax.grad(_loss_fn(remat))(p, x), jax.grad(_loss_fn(plain))(p, x)))
    actual, expected = both(params, x)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        # Recomputed forwards fuse differently: float32 rounding apart (3e-6 seen at 0.2 on an AVX-512 Xeon).
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def scan_residuals(stack):
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(_loss_fn(stack), params, x)
        return [line for line in capsys.readouterr().out.splitlines() if "output of scan" in line]

    # With remat only each layer's input (the scan carry, stacked over layers) is kept.
    kept = scan_residuals(remat)
    assert len(kept) == 1 and kept[0].startswith("f32[2,2,8,32] ")  # [layers, batch, seq, dim].
    assert len(scan_residuals(plain)) > 10


OFFLOAD = "offload_dot_with_no_batch_dims(device,pinned_host)"


def test_an_offload_policy_is_a_setting_and_a_mesh_rule_modifier():
    exp = load_experiment("scan", ["plugins=[remat]", f"remat.policy={OFFLOAD}"])
    assert exp.config.model.decoder.remat_policy == OFFLOAD
    with pytest.raises(ConfigError, match=r"remat.policy 'offload_dot_with_no_batch_dims\(device\)' is not in"):
        load_experiment("scan", ["plugins=[remat]", "remat.policy=offload_dot_with_no_batch_dims(device)"])
    config = remat("offload_matmul_outputs", "decoder")(load_experiment("scan").config)
    assert config.model.decoder.remat_policy == OFFLOAD


def test_offloaded_matmul_outputs_go_to_pinned_host_with_the_same_gradients(capsys):
    plain, offload = _stack(None), _stack(OFFLOAD)
    rng = np.random.default_rng(1)
    draw = lambda s: jnp.asarray(0.3 * rng.normal(size=s.shape), s.dtype)  # noqa: E731
    params = jax.tree.map(draw, plain.abstract_parameters())
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    # The CPU backend runs it (its pinned_host memory is ordinary memory): the gradients are unchanged.
    both = jax.jit(lambda p, x: (jax.grad(_loss_fn(offload))(p, x), jax.grad(_loss_fn(plain))(p, x)))
    actual, expected = both(params, x)
    # Gradients up to ~13 in float32, summed in another order: a few 1e-6 apart.
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # Saved across the scan: the five weight-matmul outputs of each layer (q, k, v, output projection,
    # FFN up), on the host; the attention matmuls (batched) are recomputed. The FFN down projection's
    # output is the carry, saved on the device.
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(_loss_fn(offload), params, x)
    kept = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "output of scan" in line]
    assert sorted(kept) == sorted(["f32<host>[2,2,8,2,16]"] * 3 + ["f32<host>[2,2,8,32]", "f32<host>[2,2,8,64]",
                                   "f32[2,2,8,32]"])
    # Lowered for GPU and TPU (no device needed), each offloaded residual is placed on pinned_host and
    # brought back to the device for the backward pass.
    for platform in ("cuda", "tpu"):
        text = jax.jit(jax.grad(_loss_fn(offload))).trace(params, x).lower(lowering_platforms=(platform,)).as_text()
        placements = re.findall(r'_xla_buffer_placement = "(\w+)"', text)
        assert placements.count("pinned_host") == 5 and placements.count("device") == 5, (platform, placements)
    plain_text = jax.jit(jax.grad(_loss_fn(plain))).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "pinned_host" not in plain_text
