"""axcore.platform.sharding and the sharding dump, in-process on abstract meshes (no devices needed).

The 8-device training and layout checks are in test_multi_device.py.
"""

import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

import axcore
from axcore.cli import main
from axcore.cli.shardings import sharding_report
from axcore.errors import ConfigError
from axcore.experiment import load_experiment
from axcore.kernels import op_environment
from axcore.params import ParameterSpec
from axcore.platform.sharding import (
    DEFAULT_AXIS_RULES,
    activation_spec,
    batch_sharding,
    check_batch_size,
    logical_to_spec,
    parameter_shardings,
    resolve_rules,
)
from axcore.testing import TINY_OVERRIDES

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
# Every mesh axis the default rules name, two devices each (abstract: 32 devices need not exist).
FULL = AbstractMesh((2, 2, 2, 2, 2), ("data", "fsdp", "tensor", "expert", "sequence"))
DFT = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
# An 8-device mesh, described on any machine for the instance type it is laid out for.
MESH_2x2x2 = ["mesh.instance_type=cpu-8", "mesh.mesh_shape=[2,2,2]", "mesh.mesh_axis_names=[data,fsdp,tensor]"]


def test_default_rules_map_every_logical_axis():
    assert resolve_rules(None) == resolve_rules(resolve_rules({}))  # Idempotent.
    assert resolve_rules({})["batch"] == ("data", "fsdp") and resolve_rules({})["norm"] is None
    cases = {
        ("embed", "heads", None): P("fsdp", "tensor", None),
        ("heads", None, "embed"): P("tensor", None, "fsdp"),
        ("embed", "kv_heads", None): P("fsdp", "tensor", None),
        ("embed", "mlp"): P("fsdp", "tensor"),
        ("vocab", "embed"): P("tensor", "fsdp"),
        ("layers", "expert", "mlp", "embed"): P(None, "expert", "tensor", "fsdp"),
        ("norm",): P(None),
        (None, "embed"): P(None, "fsdp"),
        ("no_such_axis", "embed"): P(None, "fsdp"),
    }
    for axes, want in cases.items():
        assert logical_to_spec(axes, (8,) * len(axes), {}, FULL) == want, axes
    # Mesh axes absent from the mesh are dropped: a [data] mesh replicates every parameter.
    data_only = AbstractMesh((4,), ("data",))
    assert logical_to_spec(("embed", "heads", None), (8, 8, 8), {}, data_only) == P(None, None, None)
    assert logical_to_spec(None, (8, 8), {}, FULL) == P()


def test_mesh_rule_axis_rules_override_per_logical_axis():
    rules = {"embed": None, "mlp": ["tensor", "fsdp"], "heads": "model"}
    assert logical_to_spec(("embed", "mlp"), (8, 8), rules, FULL) == P(None, ("tensor", "fsdp"))
    assert logical_to_spec(("heads",), (8,), rules, AbstractMesh((2, 2), ("data", "model"))) == P("model")
    assert resolve_rules(rules)["vocab"] == ("tensor",)  # Unnamed ones keep the default.
    assert set(DEFAULT_AXIS_RULES) >= {"batch", "seq", "embed", "heads", "kv_heads", "mlp", "vocab", "expert"}


def test_undivisible_dimension_is_an_error_naming_the_parameter():
    exp = load_experiment(None, ["model.dim=48", "model.decoder.layer.self_attention.num_heads=6", "model.num_layers=1"])
    specs = exp.config.model.instantiate(name="model", registries=exp.registries).parameter_specs()
    mesh = AbstractMesh((1, 4), ("data", "tensor"))
    with pytest.raises(ConfigError) as error:
        parameter_shardings(specs, {}, mesh)
    text = str(error.value)  # The first offender in path order: wk (kv_heads = heads here).
    assert text.startswith("model.decoder.layer0.self_attention.wk dim 1 ('kv_heads') of size 6 is not divisible by "
                           "mesh axis tensor=4 (shape (48, 6, 8)); change mesh.mesh_shape, or map 'kv_heads'")
    assert "mesh.axis_rules" in text
    with pytest.raises(ConfigError, match=r"model\.decoder\.layer0\.self_attention\.wq dim 1 \('heads'\) of size 6"):
        parameter_shardings({"decoder": {"layer0": {"self_attention": {"wq": specs["decoder"]["layer0"][
            "self_attention"]["wq"]}}}}, {}, mesh)
    # Mapping the axis elsewhere (here: replicated) is the way out.
    parameter_shardings(specs, {"heads": None, "kv_heads": None}, mesh)


def test_mesh_axis_used_by_two_dims_is_an_error():
    spec = ParameterSpec((8, 8), np.float32, None, ("embed", "mlp"))
    with pytest.raises(ConfigError, match=r"model\.ffn\.w: mesh axis 'fsdp' shards both dim 0 \('embed'\) and dim 1"):
        parameter_shardings({"ffn": {"w": spec}}, {"mlp": "fsdp"}, DFT)


def test_batch_is_split_over_data_and_fsdp():
    assert batch_sharding(DFT, {}).spec == P(("data", "fsdp"))
    assert batch_sharding(AbstractMesh((4,), ("data",)), {}).spec == P("data")
    assert batch_sharding(AbstractMesh((2, 4), ("fsdp", "sequence")), {}).spec == P("fsdp")
    assert batch_sharding(DFT, {"batch": "data"}).spec == P("data")  # A rule names its own batch axes.
    assert batch_sharding(DFT, {}).shard_shape((8, 32)) == (2, 32)
    check_batch_size(8, DFT, {})
    with pytest.raises(ConfigError, match=r"input.batch_size \(6\) is not divisible by .*data=2 x fsdp=2 = 4"):
        check_batch_size(6, DFT, {})


def test_activation_specs_are_lenient():
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "sequence"))
    residual = ("batch", "seq", "embed")
    # embed -> fsdp, but the batch took fsdp first: one mesh axis shards one dim.
    assert activation_spec(residual, (4, 32, 16), {}, mesh) == P(("data", "fsdp"), "sequence", None)
    # A batch of 2 keeps the axes that divide it (data); fsdp then goes to embed. A batch of 1 is replicated.
    assert activation_spec(residual, (2, 32, 16), {}, mesh) == P("data", "sequence", "fsdp")
    assert activation_spec(residual, (1, 3, 16), {}, mesh) == P(None, None, "fsdp")


def _model_and_batch(overrides):
    exp = load_experiment(None, [*TINY_OVERRIDES, *overrides])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    ids = np.zeros((4, 32), np.int32)
    return model, {"input_ids": ids, "target_labels": ids}


def test_layers_constrain_activations_only_under_a_mesh():
    model, batch = _model_and_batch([])
    params = model.abstract_parameters()

    def lowered():
        loss = lambda p, b: axcore.functional(model, p, (b,), None, False)[0][0]  # noqa: E731
        return jax.jit(loss).lower(params, batch).as_text()

    assert "sharding_constraint" not in lowered() and "mhlo.sharding" not in lowered()
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    with op_environment(mesh, resolve_rules({})):
        text = lowered()
    # Embedded input, each layer's input and output, q/k/v and attention output, FFN hidden, logits,
    # the gathered embedding tables.
    assert text.count("sharding_constraint") >= 2 + 2 * 2 + 4 * 2 + 2 + 1


def test_every_parameter_names_its_sharded_dims():
    """Each dim of each parameter has the logical axis of what it spans (sizes chosen distinct)."""
    overrides = [
        "plugins=[swiglu, moe]", "model.dim=32", "model.decoder.layer.feed_forward.hidden_dim=96",
        "model.position_embedding.max_len=40", "input.seq_len=32", "model.decoder.layer.self_attention.num_heads=2",
        "moe.num_experts=6", "model.num_layers=4",
    ]
    allowed = {32: {"embed", "norm"}, 96: {"mlp"}, 256: {"vocab"}, 2: {"heads", "kv_heads"}, 16: {None}, 40: {None},
               6: {"expert", None}}
    for source in (None, "scan"):  # Scanned: moe makes the unit a block of 2 layers, repeated twice.
        exp = load_experiment(source, overrides)
        specs = exp.config.model.instantiate(name="model", registries=exp.registries).parameter_specs()
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParameterSpec))[0]
        names = set()
        for path, spec in flat:
            key = jax.tree_util.keystr(path)
            assert spec.mesh_axes is not None and len(spec.mesh_axes) == len(spec.shape), key
            dims = list(zip(spec.shape, spec.mesh_axes))
            if source and key.startswith("['decoder']"):  # Scanned: a leading [repeats] "layers" axis.
                assert dims[0] == (2, "layers"), key
                dims = dims[1:]
            for size, axis in dims:
                assert axis in allowed[size], (key, size, axis)
                names.add(axis)
            assert ("norm" in spec.mesh_axes) == ("norm" in key), key
        assert {"embed", "mlp", "vocab", "heads", "kv_heads", "expert", "norm"} <= names


def _dump(*args):
    assert main(["config", "default", *[a for o in TINY_OVERRIDES for a in ("--set", o)], *args, "--shardings"]) == 0


def test_sharding_dump_of_a_data_fsdp_tensor_mesh(capsys, request):
    _dump(*[a for o in MESH_2x2x2 for a in ("--set", o)])
    text = capsys.readouterr().out
    golden = GOLDEN / "shardings_tiny_2x2x2.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert text == golden.read_text(), "sharding dump changed; review and run pytest --update-goldens"
    lines = text.splitlines()
    assert lines[0].startswith("# mesh: data=2, fsdp=2, tensor=2 (8 devices")
    assert "batch.input_ids: [4, 32] int32 -> P(('data', 'fsdp'), None) (per device [1, 32])" in lines
    assert (
        "model.decoder.layer0.self_attention.wq: [32, 2, 16] float32 (embed, heads, -) -> "
        "P('fsdp', 'tensor', None) (per device [16, 1, 16])" in lines
    )
    assert "model.final_norm.scale: [32] float32 (norm) -> P(None,) (per device [32])" in lines
    assert any(line.startswith("opt_state: ") and "sharded like their parameter" in line for line in lines)
    assert lines[-1].startswith("# bytes per device: params ")


def test_sharding_dump_resolves_the_selector_size_abstractly(capsys):
    # 8 devices from the selector, though this process may have one: -1 becomes expert=4.
    _dump("--set", "plugins=[moe]", "--set", "moe.num_experts=4", "--mesh-selector", "cpu-8",
          "--set", "mesh.mesh_shape=[2,-1]", "--set", "mesh.mesh_axis_names=[data,expert]")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# mesh: data=2, expert=4 (8 devices")
    assert (
        "model.decoder.layer1.feed_forward.expert.up_proj.weight: [4, 32, 64] float32 (expert, embed, mlp) -> "
        "P('expert', None, None) (per device [1, 32, 64])" in lines
    )
    assert "batch.input_ids: [4, 32] int32 -> P('data', None) (per device [2, 32])" in lines


def test_sharding_report_raises_like_the_trainer():
    exp = load_experiment(None, [*TINY_OVERRIDES, "mesh.instance_type=cpu-4", "mesh.mesh_shape=[1,4]",
                                 "mesh.mesh_axis_names=[data,tensor]"])
    with pytest.raises(ConfigError, match=r"model\.decoder\.layer0\.self_attention\.w.*size 2 .*tensor=4"):
        sharding_report(exp)
