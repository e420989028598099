"""Config modifiers (axcore.experiment.config_modifiers): each one's effect, purity and failure naming its target;
the per-layer remat_policy (same gradients, a checkpoint in the jaxpr); the registered family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import dump_flat
from axcore.errors import AxcoreError, ConfigError, NoMatchError, UnknownComponentError
from axcore.experiment import ExperimentConfig, load_experiment
from axcore.experiment.builtins import create_plugin_manager
from axcore.experiment.config_modifiers import (
    REMAT_POLICIES,
    attention_kernel,
    build_modifier,
    chunked_loss,
    compute_dtype,
    mesh_shape,
    microbatches,
    remat,
)
from axcore.kernels import XlaAttention
from axcore.layers import BaseLayer, CausalLM
from axcore.layers.base import checkpoint_policy
from axcore.testing import TINY_OVERRIDES

BF16 = np.dtype("bfloat16")
FIXED = [*TINY_OVERRIDES, "mesh.instance_type=cpu-1"]


@pytest.fixture(scope="module")
def exp():
    return load_experiment(None, FIXED)


def _unchanged(before, config, exp):
    """The modifier's input still dumps as it did (it was not edited in place)."""
    assert dump_flat(config, exp.registries) == before


def _apply(modifier, exp):
    config = exp.config
    before = dump_flat(config, exp.registries)
    new = modifier(config, exp.registries)
    assert new is not config and isinstance(new, ExperimentConfig)
    _unchanged(before, config, exp)
    return new


# -- mesh_shape -------------------------------------------------------------------------


def test_mesh_shape_sets_the_shape_and_axis_names(exp):
    new = _apply(mesh_shape([2, -1], axis_names=["data", "model"]), exp)
    assert new.mesh.mesh_shape == (2, -1) and new.mesh.mesh_axis_names == ("data", "model")
    only_shape = _apply(mesh_shape([4]), exp)
    assert only_shape.mesh.mesh_shape == (4,) and only_shape.mesh.mesh_axis_names == ("data",)


def test_mesh_shape_fails_naming_the_mesh():
    with pytest.raises(ConfigError, match=r"mesh_shape\(shape=\[2, -1\]\): the mesh has axes \['data'\]"):
        mesh_shape([2, -1])(load_experiment(None, FIXED).config)
    for shape in ([-1, -1], [0, 2], []):
        with pytest.raises(ConfigError, match="positive sizes with at most one -1"):
            mesh_shape(shape)
    with pytest.raises(ConfigError, match="differ in length"):
        mesh_shape([2, 2], axis_names=["data"])


# -- remat ------------------------------------------------------------------------------


def test_remat_policies_map_to_jax_checkpoint_policies():
    assert REMAT_POLICIES == {"none": None, "full": "nothing_saveable",
                              "save_matmul_outputs": "dots_with_no_batch_dims_saveable",
                              "offload_matmul_outputs": "offload_dot_with_no_batch_dims(device,pinned_host)"}
    assert all(p is None or callable(checkpoint_policy(p)) for p in REMAT_POLICIES.values())


def test_remat_sets_the_policy_on_the_matching_layers_only(exp):
    new = _apply(remat("save_matmul_outputs", r"decoder\.layer.*"), exp)
    # Outermost matches only: the layers (one config builds layer0 and layer1), not their sublayers.
    assert new.model.decoder.layer.remat_policy == "dots_with_no_batch_dims_saveable"
    assert new.model.decoder.layer.feed_forward.remat_policy is None
    assert new.model.decoder.remat_policy is None and new.model.remat_policy is None
    # A full path (with `model.`) matches too; feed-forward sublayers of every layer.
    ffn = _apply(remat("full", r"model\.decoder\.layer\d+\.feed_forward"), exp)
    assert ffn.model.decoder.layer.feed_forward.remat_policy == "nothing_saveable"
    assert ffn.model.decoder.layer.remat_policy is None


def test_remat_everything_means_the_roots_children(exp):
    new = _apply(remat("full", ".*"), exp)
    assert new.model.remat_policy is None  # The root is never rematerialized as a whole.
    assert new.model.decoder.remat_policy == "nothing_saveable" and new.model.decoder.layer.remat_policy is None
    assert new.model.embedding.remat_policy == "nothing_saveable"


def test_remat_none_clears_every_match(exp):
    on = _apply(remat("full", r"decoder\.layer\d+(\.feed_forward)?"), exp)
    assert on.model.decoder.layer.remat_policy == "nothing_saveable"
    off = remat("none", r"decoder\.layer.*")(on, exp.registries)
    assert off.model.decoder.layer.remat_policy is None and off.model.decoder.layer.feed_forward.remat_policy is None


def test_remat_of_a_scanned_stack_targets_its_unit():
    scan = load_experiment("scan", FIXED)
    new = remat("full", r"decoder\.layer")(scan.config, scan.registries)
    assert new.model.decoder.layer.remat_policy == "nothing_saveable"
    assert new.model.decoder.remat_policy is None  # RepeatedTransformer's own (per scan step) stays unset.


def test_remat_of_one_layer_needs_a_config_per_layer(exp):
    with pytest.raises(ConfigError, match=r"match model\.decoder\.layer0 but not model\.decoder\.layer1, built from "
                                          r"the same config 'model\.decoder\.layer'"):
        remat("full", r"decoder\.layer0")(exp.config, exp.registries)
    per_layer = exp.config.clone()
    per_layer.model.decoder.layer = [per_layer.model.decoder.layer.clone() for _ in range(2)]
    new = remat("full", r"decoder\.layer0")(per_layer, exp.registries)
    assert [layer.remat_policy for layer in new.model.decoder.layer] == ["nothing_saveable", None]


def test_remat_fails_naming_its_paths_when_nothing_matches(exp):
    with pytest.raises(NoMatchError, match=r"remat\(policy='full', paths='encoder\.\*'\): paths match no module"):
        remat("full", r"encoder.*")(exp.config, exp.registries)
    with pytest.raises(NoMatchError, match=r"paths match model, but no layer"):
        remat("full", "model")(exp.config, exp.registries)
    with pytest.raises(ConfigError, match=r"paths '\(' is not a regular expression"):
        remat("full", "(")
    with pytest.raises(ConfigError, match="policy must be one of.*did you mean 'full'"):
        remat("ful", ".*")


def _tiny_lm(exp):
    cfg = exp.config.model.clone()
    cfg.set(vocab_size=64, dim=16)
    cfg.decoder.layer.feed_forward.hidden_dim = 32
    return cfg


def _loss_and_batch(exp, model_cfg):
    model = model_cfg.instantiate(name="model", registries=exp.registries)
    rng = np.random.default_rng(0)
    batch = {k: jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32) for k in ("input_ids", "target_labels")}
    return (lambda p: axcore.functional(model, p, (batch,), None, True)[0][0]), model


def _remat_policies(jaxpr) -> list:
    """Policies of every checkpoint (remat) equation, nested ones included, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("checkpoint", "remat", "remat2"):
            found.append(eqn.params["policy"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _remat_policies(inner)
    return found


def test_remat_keeps_gradients_and_puts_a_checkpoint_around_each_chosen_layer(exp):
    plain_cfg = _tiny_lm(exp)
    config = exp.config.clone(model=plain_cfg)
    plain, model = _loss_and_batch(exp, plain_cfg)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), model.abstract_parameters())
    expected = jax.jit(jax.grad(plain))(params)
    assert _remat_policies(jax.make_jaxpr(plain)(params).jaxpr) == []
    for policy in ("full", "save_matmul_outputs"):
        rematerialized, _ = _loss_and_batch(exp, remat(policy, r"decoder\.layer\d+")(config, exp.registries).model)
        actual = jax.jit(jax.grad(rematerialized))(params)
        for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        # One checkpoint per decoder layer (two), with the chosen policy.
        policy_fn = getattr(jax.checkpoint_policies, REMAT_POLICIES[policy])
        assert _remat_policies(jax.make_jaxpr(rematerialized)(params).jaxpr) == [policy_fn, policy_fn]


def test_a_rematerialized_layer_still_records_its_outputs(registries):
    """Module outputs (e.g. an auxiliary loss) come back through jax.checkpoint; non-array arguments stay static."""

    class Recording(BaseLayer):
        class Config(BaseLayer.Config):
            """Configures Recording."""

        def forward(self, x, scale=2.0):
            self.add_module_output("aux_loss", jnp.sum(x))
            return jnp.sin(x) * scale

    class Parent(BaseLayer):
        class Config(BaseLayer.Config):
            """Configures Parent."""

            child: axcore.InstantiableConfig = Recording.default_config()

        def __init__(self, cfg, **kwargs):
            super().__init__(cfg, **kwargs)
            self._add_child("child", self._config.child)

        def forward(self, x):
            return self.child(x, scale=3.0)

    x = jnp.linspace(0.0, 1.0, 6)
    outputs = {}
    for policy in (None, "nothing_saveable"):
        cfg = Parent.default_config()
        cfg.child.remat_policy = policy
        parent = cfg.instantiate(name="p", registries=registries)
        (y, collection) = axcore.functional(parent, {}, (x,), None, True)
        grad = jax.grad(lambda v: jnp.sum(axcore.functional(parent, {}, (v,), None, True)[0]))(x)  # noqa: B023 (called here)
        outputs[policy] = (y, collection.module_outputs, grad)
    (y0, out0, g0), (y1, out1, g1) = outputs[None], outputs["nothing_saveable"]
    np.testing.assert_allclose(y1, 3.0 * np.sin(np.asarray(x)), rtol=1e-6)
    np.testing.assert_allclose(y1, y0)
    np.testing.assert_allclose(g1, g0)
    assert jax.tree.map(float, out1) == jax.tree.map(float, out0) == {"child": {"aux_loss": pytest.approx(3.0)}}


def test_a_bad_remat_policy_on_a_layer_is_a_config_error(registries):
    cfg = CausalLM.default_config().set(vocab_size=8, dim=8, num_layers=1)
    cfg.decoder.layer.self_attention.num_heads = 2
    cfg.decoder.layer.remat_policy = "nothing"
    with pytest.raises(ConfigError, match=r"model\.decoder\.layer0: remat_policy 'nothing' is not in jax\.checkpoint"):
        cfg.instantiate(name="model", registries=registries)


# -- microbatches -----------------------------------------------------------------------


def test_microbatches_sets_the_trainer_field(exp):
    assert exp.config.trainer.microbatches == 1
    assert _apply(microbatches(2), exp).trainer.microbatches == 2


def test_chunked_loss_sets_the_models_loss_chunk_len(exp, tmp_path):
    assert exp.config.model.loss_chunk_len is None
    assert _apply(chunked_loss(8), exp).model.loss_chunk_len == 8
    with pytest.raises(ConfigError, match=r"chunked_loss\(chunk_len=0\): chunk_len must be a positive integer"):
        chunked_loss(0)
    # From a mesh rule in YAML, as a long-context rule would turn it on.
    path = tmp_path / "exp.yaml"
    path.write_text(
        "mesh_rules:\n  - {name: long, instance_type: '.*', modifiers: [{type: chunked_loss, chunk_len: 16}]}\n"
    )
    loaded = load_experiment(str(path), FIXED)
    assert loaded.config.model.loss_chunk_len == 16 and "chunked_loss(chunk_len=16)" in loaded.flat()


def test_microbatches_must_divide_the_batch(exp):
    with pytest.raises(ConfigError, match=r"microbatches\(count=3\): input\.batch_size 4 is not divisible"):
        microbatches(3)(exp.config)
    with pytest.raises(ConfigError, match="count must be a positive integer"):
        microbatches(0)
    with pytest.raises(ConfigError, match=r"'input\.batch_size' \(4\) must be divisible by 'trainer\.microbatches' \(3\)"):
        load_experiment(None, [*FIXED, "trainer.microbatches=3"])
    with pytest.raises(ConfigError, match=r"'trainer\.microbatches' must be > 0"):
        load_experiment(None, [*FIXED, "trainer.microbatches=0"])


# -- attention_kernel -------------------------------------------------------------------


class GpuLikeAttention(XlaAttention):
    name = "gpu_like"
    priority = -5


class Kernels:
    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(GpuLikeAttention())


def test_attention_kernel_forces_a_registered_kernel_on_attention_layers(exp):
    new = _apply(attention_kernel("xla"), exp)
    assert new.model.decoder.layer.self_attention.kernels == {"attention": "xla"}
    assert new.model.decoder.layer.kernels is None and new.model.kernels is None
    # A plugin's kernel, known to the registries of a manager with that plugin.
    registries = create_plugin_manager(["k"], objects={"k": Kernels()}).registries
    config = exp.config.clone()
    config.model.decoder.layer.self_attention.set(kernel="xla", kernels={"dot": "xla"})
    forced = attention_kernel("gpu_like", paths=r".*self_attention")(config, registries)
    assert forced.model.decoder.layer.self_attention.kernels == {"dot": "xla", "attention": "gpu_like"}
    assert forced.model.decoder.layer.self_attention.kernel == "gpu_like"  # The layer's own choice would win.


def test_attention_kernel_choice_takes_effect():
    exp2 = load_experiment(None, [*FIXED, "plugins=[k]"], objects={"k": Kernels()})
    assert set(exp2.kernel_choices()["attention"]) == {"xla"}
    exp2.config = attention_kernel("gpu_like")(exp2.config, exp2.registries)
    assert set(exp2.kernel_choices()["attention"]) == {"gpu_like"}  # Priority -5 would never win unforced.


def test_attention_kernel_fails_naming_the_kernel_or_the_paths(exp):
    with pytest.raises(UnknownComponentError, match=r"attention_kernel\(kernel='xlaa', paths='\.\*'\): no attention "
                                                    r"kernel named 'xlaa' \(did you mean 'xla'\?\); registered: context_all_gather, context_ring, xla"):
        attention_kernel("xlaa")(exp.config, exp.registries)
    with pytest.raises(NoMatchError, match=r"paths match model\.decoder\.layer0\.feed_forward.*, but no attention layer"):
        attention_kernel("xla", paths=r".*feed_forward")(exp.config, exp.registries)
    with pytest.raises(NoMatchError, match="paths match no module"):
        attention_kernel("xla", paths=r"nothing")(exp.config, exp.registries)


# -- compute_dtype ----------------------------------------------------------------------


def test_compute_dtype_gives_bfloat16_compute_with_float32_master_weights(exp):
    new = _apply(compute_dtype(), exp)
    assert new.model.compute_dtype == BF16 and new.model.param_dtype is None
    model = new.model.instantiate(name="model", registries=exp.registries)
    assert model.decoder.layer0.feed_forward.compute_dtype == BF16
    assert model.decoder.layer0.feed_forward.param_dtype == np.float32  # The root default: float32.
    both = _apply(compute_dtype("bfloat16", params="bfloat16"), exp)
    assert both.model.param_dtype == BF16


def test_compute_dtype_override_false_keeps_the_experiments_choice():
    set_by_experiment = load_experiment(None, [*FIXED, "model.compute_dtype=float32"]).config
    assert compute_dtype(override=False)(set_by_experiment).model.compute_dtype == np.float32
    assert compute_dtype()(set_by_experiment).model.compute_dtype == BF16


def test_compute_dtype_fails_naming_its_target(exp):
    with pytest.raises(ConfigError, match=r"compute_dtype\(compute='bfloat61'\): .*bfloat61"):
        compute_dtype("bfloat61")
    config = ExperimentConfig()
    config.model = ExperimentConfig().tokenizer  # A model config without dtype fields.
    with pytest.raises(ConfigError, match=r"compute_dtype\(compute='bfloat16'\): model config .* has no compute_dtype"):
        compute_dtype()(config)


# -- the registered family and YAML entries ---------------------------------------------


def test_builtin_modifiers_are_registered(registries):
    assert registries.config_modifiers.names() == sorted(
        ["attention_kernel", "chunked_loss", "compute_dtype", "context_parallel", "mesh_shape", "microbatches", "pipeline", "remat"]
    )
    assert registries.config_modifiers.entry("remat").provenance.plugin == "axcore.experiment.config_modifiers"


def scale_heads(num_heads: int):
    """A plugin's modifier factory: every attention layer gets `num_heads` heads."""

    def modify(config):
        new = config.clone()
        new.model.decoder.layer.self_attention.num_heads = num_heads
        return new

    return modify


class Modifiers:
    @axcore.hookimpl
    def axcore_register_config_modifiers(self, register):
        register("num_heads", scale_heads)


def test_a_plugin_adds_a_modifier_that_yaml_names(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        "plugins: [mods]\n"
        "mesh_rules:\n"
        "  - {name: local, instance_type: 'cpu-.*', modifiers: [{type: num_heads, num_heads: 1}]}\n"
    )
    exp = load_experiment(str(path), FIXED, objects={"mods": Modifiers()})
    assert exp.config.model.decoder.layer.self_attention.num_heads == 1
    assert exp.mesh_modifiers == ["modify"]
    assert exp.registries.config_modifiers.entry("num_heads").provenance.plugin == "mods"


def test_yaml_entries_are_checked_against_the_factory(registries):
    built = build_modifier({"type": "remat", "policy": "full", "paths": ".*"}, registries, "mesh_rules[0].modifiers[0]")
    assert str(built) == "remat(policy='full', paths='.*')"
    where = r"mesh_rules\[0\]\.modifiers\[1\]"
    cases = [
        ({"type": "remaat", "policy": "full"}, rf"'{where}\.type': no config modifier named 'remaat' \(did you mean 'remat'\?\)"),
        ({"type": "remat", "policy": "full", "pths": ".*"}, rf"'{where}\.pths'.*did you mean 'paths'"),
        ({"type": "remat", "policy": "most", "paths": ".*"}, rf"'{where}\.policy' must be one of"),
        ({"type": "remat", "policy": "full"}, rf"'{where}' has required field\(s\) \['paths'\] unset"),
        ({"type": "remat", "policy": "full", "paths": "["}, rf"'{where}': Config modifier remat.*not a regular expression"),
        ({"policy": "full"}, rf"'{where}' must be a mapping whose 'type:' names a config modifier"),
        ({"type": "microbatches", "count": "four"}, rf"'{where}\.count' expects int"),
    ]
    for spec, message in cases:
        with pytest.raises(AxcoreError, match=message):
            build_modifier(spec, registries, "mesh_rules[0].modifiers[1]")
