"""Test plugins extend the core with zero changes to axcore/: an attention capability through
the extras map, a new op with its own problem type, a new registry family, and an int8 `dot`
kernel with scale state that reaches every matmul of the default model."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.config import replace
from axcore.errors import KernelNotSupportedError, PluginLoadError, UnknownComponentError
from axcore.kernels import SUPPORTED, Op, Problem, Support, XlaAttention, unknown_extras
from axcore.layers import BaseLayer, CausalLM, MultiheadAttention
from axcore.params import ParameterSpec, constant
from axcore.registry import Family, instance_validator, registers
from axcore.testing import TINY_OVERRIDES

# -- A new attention capability through the extras map ---------------------------------------


class TemperedAttention:
    """Attention with logits divided by `extras["temperature"]` (a capability the core does not know)."""

    name = "tempered"
    priority = 50

    def __init__(self):
        self.calls = 0

    def is_supported(self, problem):
        if "temperature" not in problem.extras:
            return Support(False, "no temperature extra")
        return unknown_extras(problem, known=["temperature"])

    def __call__(self, problem, q, k, v, **inputs):
        self.calls += 1
        plain = dataclasses.replace(problem, scale=problem.scale / problem.extras["temperature"], extras={})
        return XlaAttention()(plain, q, k, v, **inputs)


class TemperaturePlugin:
    def __init__(self, with_kernel=True):
        self.kernel = TemperedAttention()
        self.with_kernel = with_kernel

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        if self.with_kernel:
            register(self.kernel)

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, MultiheadAttention, lambda _, c: c.set(op_extras={"attention": {"temperature": 2.0}}))


def np_causal_attention(x, p, scale):
    q, k, v = (np.einsum("btd,dnh->btnh", x, np.asarray(p[w], np.float64)) for w in ("wq", "wk", "wv"))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    t = x.shape[1]
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", probs, v), np.asarray(p["wo"], np.float64))


def _attention_layer(pm):
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=4, causal=True)
    cfg = pm.transform_config(cfg)
    layer = cfg.instantiate(name="attn", registries=pm.registries)
    return layer, layer.initialize(jax.random.key(0))


def test_new_attention_capability_through_extras_and_its_kernel():
    plugin = TemperaturePlugin()
    pm = axcore.create_plugin_manager(["temperature"], objects={"temperature": plugin})
    layer, params = _attention_layer(pm)
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
    out, _ = axcore.functional(layer, params, (x,), None, False)
    np.testing.assert_allclose(out, np_causal_attention(x.astype(np.float64), params, 0.5 / 2.0), rtol=1e-5, atol=1e-5)
    assert plugin.kernel.calls == 1


def test_an_extra_no_kernel_understands_is_an_error_not_ignored():
    pm = axcore.create_plugin_manager(["temperature"], objects={"temperature": TemperaturePlugin(with_kernel=False)})
    layer, params = _attention_layer(pm)
    with pytest.raises(KernelNotSupportedError, match="temperature"):
        axcore.functional(layer, params, (np.zeros((1, 3, 16), np.float32),), None, False)


# -- A new op with its own problem type, and a layer that calls it -----------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftclipProblem(Problem):
    """`y = bound * tanh(x / bound)` on `[..., dim]`."""

    dim: int
    bound: float


class ReferenceSoftclip:
    name = "reference"
    priority = 0

    def is_supported(self, problem):
        return unknown_extras(problem)

    def __call__(self, problem, x):
        return problem.bound * jnp.tanh(x / problem.bound)


class ClipFastPath:
    """A faster 'kernel' for small bounds: the same formula, counted."""

    name = "fast"
    priority = 5

    def __init__(self):
        self.calls = 0

    def is_supported(self, problem):
        return SUPPORTED if problem.bound <= 4.0 else Support(False, "bound above 4")

    def __call__(self, problem, x):
        self.calls += 1
        return problem.bound * jnp.tanh(x / problem.bound)


SOFTCLIP = Op("softclip", SoftclipProblem, ReferenceSoftclip(), "bound * tanh(x / bound)")


class Softclip(BaseLayer):
    class Config(BaseLayer.Config):
        """Configures Softclip."""

        # Size of the last dimension.
        input_dim: int = 0
        # Output bound.
        bound: float = 3.0

    def forward(self, x):
        problem = SoftclipProblem(platform=jax.default_backend(), dim=x.shape[-1], bound=self._config.bound)
        return self._run_kernel(self._select(SOFTCLIP, problem), "softclip", problem, x)


class SoftclipPlugin:
    def __init__(self):
        self.fast = ClipFastPath()

    @axcore.hookimpl
    def axcore_register_ops(self, register):
        register(SOFTCLIP)

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register(SOFTCLIP, self.fast)

    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("softclip", Softclip)


@pytest.mark.parametrize("bound", [2.0, 10.0])
def test_new_op_with_its_own_problem_type(bound):
    plugin = SoftclipPlugin()
    pm = axcore.create_plugin_manager(["softclip"], objects={"softclip": plugin})
    assert pm.registries.ops["softclip"] is SOFTCLIP
    cfg = pm.registries.lookup("softclip").default_config().set(bound=bound)
    layer = cfg.instantiate(name="clip", registries=pm.registries)
    x = np.linspace(-20, 20, 12, dtype=np.float32).reshape(3, 4)
    out, _ = axcore.functional(layer, {}, (x,), None, False)
    np.testing.assert_allclose(out, bound * np.tanh(x / bound), rtol=1e-6)
    assert plugin.fast.calls == (1 if bound <= 4.0 else 0)  # The reference runs when the fast path declines.


def test_kernel_for_an_undeclared_op_names_the_plugin():
    class Stray:
        @axcore.hookimpl
        def axcore_register_kernels(self, register):
            register("sofclip", ClipFastPath())

    pm = axcore.create_plugin_manager(["stray"], objects={"stray": Stray()})
    with pytest.raises(UnknownComponentError, match="plugin 'stray'.*'sofclip'"):
        _ = pm.registries
    with pytest.raises(UnknownComponentError, match="No op named 'softclip'"):
        axcore.create_plugin_manager().registries.kernels.select("softclip", None)


# -- A new registry family, declared by a plugin's own hookspec --------------------------------


class WidgetSpecs:
    @registers(Family("widgets", "widget", instance_validator(str)))
    @axcore.hookspec
    def axcore_register_widgets(self, register):
        """Register widgets (strings) by name."""


class WidgetHost:
    @axcore.hookimpl
    def axcore_add_hookspecs(self, add_hookspecs):
        add_hookspecs(WidgetSpecs)

    @axcore.hookimpl
    def axcore_register_widgets(self, register):
        register("knob", "a knob")


class WidgetMaker:
    def __init__(self, value="a lever"):
        self.value = value

    @axcore.hookimpl
    def axcore_register_widgets(self, register):
        register("lever", self.value)


def test_new_registry_family_from_a_plugin_hookspec():
    # The implementing plugin is listed (and registered) before the one declaring the hook.
    pm = axcore.create_plugin_manager(["maker", "host"], objects={"maker": WidgetMaker(), "host": WidgetHost()})
    widgets = pm.registries.widgets
    assert widgets["knob"] == "a knob" and widgets["lever"] == "a lever"
    assert widgets.entry("lever").provenance.plugin == "maker"
    bad = axcore.create_plugin_manager(["host", "maker"], objects={"maker": WidgetMaker(3), "host": WidgetHost()})
    with pytest.raises(PluginLoadError, match="plugin 'maker'.*widget 'lever'.*expected a str"):
        _ = bad.registries


def test_hook_without_its_spec_plugin_is_a_typo_error():
    with pytest.raises(PluginLoadError, match="axcore_register_widgets"):
        axcore.create_plugin_manager(["maker"], objects={"maker": WidgetMaker()})


# -- An int8 dot kernel with scale state reaches every matmul ----------------------------------


class Int8Dot:
    """Symmetric int8 matmul: per-output-channel weight scales kept as state, per-token activation scales.

    State `w_scale` (shape: the weight's output dims) is the weight scale `amax / 127` of the
    last call; it is returned as the new state, so it follows the weights as they train.
    """

    name = "int8"
    priority = 100

    def __init__(self):
        self.sites = []

    def is_supported(self, problem):
        return unknown_extras(problem)

    def state_specs(self, problem):
        return {"w_scale": ParameterSpec(problem.out_dims, np.float32, constant(1.0), None, 0.0, trainable=False)}

    def __call__(self, problem, x, w, *, state):
        assert set(state) == {"w_scale"}
        self.sites.append(problem.site)
        k = len(problem.contract)
        w32 = w.astype(jnp.float32)
        w_scale = jnp.max(jnp.abs(w32), axis=problem.contract) / 127.0
        wq = jnp.round(w32 / jnp.expand_dims(w_scale, problem.contract)).astype(jnp.int8)
        x32 = x.astype(jnp.float32)
        x_axes = tuple(range(x.ndim - k, x.ndim))
        x_scale = jnp.max(jnp.abs(x32), axis=x_axes, keepdims=True) / 127.0
        xq = jnp.round(x32 / x_scale).astype(jnp.int8)
        acc = jax.lax.dot_general(xq, wq, ((x_axes, problem.contract), ((), ())), preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * jnp.reshape(x_scale, x_scale.shape[: x.ndim - k] + (1,) * (acc.ndim - x.ndim + k)) * w_scale
        return y.astype(problem.output_dtype), {"w_scale": w_scale}


class Int8Plugin:
    def __init__(self):
        self.kernel = Int8Dot()

    @axcore.hookimpl
    def axcore_register_kernels(self, register):
        register("dot", self.kernel)


def test_int8_kernel_with_scale_state_reaches_every_matmul_of_the_default_model():
    plugin = Int8Plugin()
    exp = axcore.load_experiment(None, [*TINY_OVERRIDES, "plugins=[int8]"], objects={"int8": plugin})
    assert isinstance(exp.config.model.decoder.layer.feed_forward, axcore.InstantiableConfig)
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    layers = [f"layer{i}" for i in range(exp.config.model.num_layers)]
    for name in layers:
        attention = params["decoder"][name]["self_attention"]
        assert set(attention["kernel_state"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
        assert attention["kernel_state"]["o_proj"]["w_scale"].shape == (exp.config.model.dim,)
    ids = np.arange(2 * 8).reshape(2, 8) % 256
    (loss, _), collection = axcore.functional(model, params, ({"input_ids": ids, "target_labels": ids},), None, False)
    expected_sites = {f"model.decoder.{n}.self_attention.{s}" for n in layers for s in ("q_proj", "k_proj", "v_proj", "o_proj")}
    expected_sites |= {f"model.decoder.{n}.feed_forward.{p}.dot" for n in layers for p in ("up_proj", "down_proj")}
    expected_sites |= {"model.lm_head.dot"}
    assert sorted(plugin.kernel.sites) == sorted(expected_sites)  # Each matmul once, none missed.
    # The new scales come back as state updates at the parameters' paths: amax / 127 per output channel.
    update = collection.state_updates["decoder"]["layer0"]["self_attention"]["kernel_state"]["q_proj"]["w_scale"]
    wq = np.asarray(params["decoder"]["layer0"]["self_attention"]["wq"])
    np.testing.assert_allclose(update, np.abs(wq).max(axis=0) / 127.0, rtol=1e-6)
    # And the loss stays close to the float32 model's (int8 error only).
    exact = axcore.load_experiment(None, TINY_OVERRIDES)
    reference = exact.config.model.instantiate(name="model", registries=exact.registries)
    float_params = {k: v for k, v in params.items()}
    (float_loss, _), _ = axcore.functional(reference, _strip_kernel_state(float_params), ({"input_ids": ids, "target_labels": ids},), None, False)
    assert math.isfinite(float(loss)) and abs(float(loss) - float(float_loss)) < 0.05


def _strip_kernel_state(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _strip_kernel_state(v) for k, v in tree.items() if k != "kernel_state"}


# -- Hook options axcore does not honour are refused ------------------------------------------


@pytest.mark.parametrize("option", ["tryfirst", "trylast", "wrapper", "hookwrapper"])
def test_ordering_options_are_refused_with_a_clear_error(option):
    class Ordered:
        if option in ("wrapper", "hookwrapper"):

            @axcore.hookimpl(**{option: True})
            def axcore_register_layers(self, register):
                yield

        else:

            @axcore.hookimpl(**{option: True})
            def axcore_register_layers(self, register):
                register("ordered", CausalLM)

    with pytest.raises(PluginLoadError, match=rf"'ordered'.*axcore_register_layers.*{option}=True.*Remove the option"):
        axcore.create_plugin_manager(["ordered"], objects={"ordered": Ordered()})


def test_autoloaded_platform_plugin_registers_but_does_not_transform_unless_listed():
    plugin = TemperaturePlugin()
    pm = axcore.create_plugin_manager([], objects={"temperature": plugin})
    assert "tempered" not in [k.name for k in pm.registries.kernels.candidates("attention")]
    # Registered the way a hardware plugin is for its platform: kernels yes, transform no.
    pm.register_plugin(plugin, "temperature", source="platform", listed=False)
    assert "tempered" in [k.name for k in pm.registries.kernels.candidates("attention")]
    cfg = MultiheadAttention.default_config().set(input_dim=16, num_heads=4)
    assert pm.transform_config(cfg).op_extras is None


# -- Kernels receive the mesh and their inputs' partition specs --------------------------------


class Spy:
    """Wraps the reference kernel of an op at a higher priority and records the problems it runs."""

    priority = 99

    def __init__(self, name, reference):
        self.name, self.reference, self.problems = name, reference, []

    def is_supported(self, problem):
        return SUPPORTED

    def __call__(self, problem, *inputs, **optional):
        self.problems.append(problem)
        return self.reference(problem, *inputs, **optional)


def test_kernels_receive_the_mesh_and_partition_specs_of_their_inputs():
    from jax.sharding import Mesh, PartitionSpec as P

    from axcore.kernels import ATTENTION, DOT, op_environment

    attention, dot = Spy("spy_attention", ATTENTION.reference), Spy("spy_dot", DOT.reference)

    class SpyPlugin:
        @axcore.hookimpl
        def axcore_register_kernels(self, register):
            register(ATTENTION, attention)
            register(DOT, dot)

    pm = axcore.create_plugin_manager(["spy"], objects={"spy": SpyPlugin()})
    layer, params = _attention_layer(pm)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with op_environment(mesh, {"heads": "model", "kv_heads": "model"}):
        axcore.functional(layer, params, (np.zeros((2, 3, 16), np.float32),), None, False)
    (problem,) = attention.problems
    assert problem.mesh is mesh
    assert problem.input_specs == (P("data", None, "model", None),) * 3
    q_proj = next(p for p in dot.problems if p.site == "attn.q_proj")
    assert q_proj.mesh is mesh and q_proj.input_specs == (P("data", None, None), P(None, "model", None))
    o_proj = next(p for p in dot.problems if p.site == "attn.o_proj")
    assert o_proj.input_specs == (P("data", None, "model", None), P("model", None, None))
    # Outside a run there is no mesh and no spec.
    attention.problems.clear()
    axcore.functional(layer, params, (np.zeros((2, 3, 16), np.float32),), None, False)
    assert attention.problems[0].mesh is None and attention.problems[0].input_specs == (None, None, None)
