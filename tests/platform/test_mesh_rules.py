"""Mesh rules: one experiment laid out for cpu-8, gpu-h100-8 and tpu-v5p-64; the precedence among
experiment-local and registered rules; `mesh_rules:` in YAML and its errors."""

import numpy as np
import pytest

import axcore
from axcore.cli import main
from axcore.errors import AxcoreError, ConfigError, MissingRequiredError, UnknownComponentError
from axcore.experiment import load_experiment
from axcore.experiment.config_modifiers import attention_kernel, compute_dtype, microbatches, remat
from axcore.kernels import XlaAttention
from axcore.platform.mesh import AmbiguousMeshRuleError, MeshRule, NoMeshRuleError, select_mesh_rule
from axcore.testing import TINY_OVERRIDES

BF16 = np.dtype("bfloat16")


class FakeGpuAttention(XlaAttention):
    name = "test_gpu_attention"
    priority = -10  # Never chosen unless forced.


class FakeGpu:
    """Stands in for the gpu hardware plugin: one H100 rule, loaded for `gpu-*` instance types."""

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(FakeGpuAttention())

    @axcore.hookimpl
    def axcore_register_mesh_rules(self, register):
        register(MeshRule(
            "test-gpu-h100", r"gpu-h100-\d+", (-1, 2), ("data", "model"), {"batch": "data", "heads": "model"},
            config_modifiers=(compute_dtype("bfloat16"), attention_kernel("test_gpu_attention")), priority=10,
        ))


class FakeTpu:
    """Stands in for a tpu hardware plugin: fsdp over v5p pods, remat and gradient accumulation."""

    @axcore.hookimpl
    def axcore_register_mesh_rules(self, register):
        register(MeshRule(
            "test-tpu-v5p", r"tpu-v5p-\d+", (-1, 4), ("fsdp", "model"), {"batch": "fsdp", "embed": "fsdp", "heads": "model"},
            config_modifiers=(remat("save_matmul_outputs", r"decoder\.layer\d+"), microbatches(2)), priority=10,
        ))


OBJECTS = {"gpu": FakeGpu(), "tpu": FakeTpu()}

EXPERIMENT = """
name: laid_out
mesh_rules:
  - name: cpu-dev
    instance_type: 'cpu-\\d+'
    mesh_shape: [2, -1]
    mesh_axis_names: [data, model]
    axis_rules: {batch: data, vocab: model}
    modifiers:
      - {type: remat, policy: full, paths: 'decoder\\.layer\\d+\\.feed_forward'}
      - {type: microbatches, count: 4}
"""


def _write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_one_experiment_resolves_to_a_layout_per_instance_type(tmp_path, capsys):
    path = _write(tmp_path, EXPERIMENT)
    cpu, gpu, tpu = (load_experiment(path, [*TINY_OVERRIDES, f"mesh.instance_type={t}"], objects=OBJECTS)
                     for t in ("cpu-8", "gpu-h100-8", "tpu-v5p-64"))

    # cpu-8: the experiment's own rule.
    assert cpu.config.mesh.rule == "cpu-dev" and cpu.mesh_rule == "cpu-dev (experiment mesh_rules[0])"
    assert cpu.config.mesh.mesh_shape == (2, -1) and cpu.config.mesh.mesh_axis_names == ("data", "model")
    assert cpu.config.mesh.axis_rules == {"batch": "data", "vocab": "model"}
    assert cpu.config.model.decoder.layer.feed_forward.remat_policy == "nothing_saveable"
    assert cpu.config.model.decoder.layer.remat_policy is None
    assert cpu.config.trainer.microbatches == 4 and cpu.config.model.compute_dtype is None
    assert cpu.mesh_modifiers == [r"remat(policy='full', paths='decoder\.layer\d+\.feed_forward')", "microbatches(count=4)"]

    # gpu-h100-8: the (test) gpu plugin's rule, loaded for the gpu platform.
    assert gpu.config.mesh.rule == "test-gpu-h100" and gpu.mesh_rule == "test-gpu-h100 (plugin gpu)"
    assert gpu.config.mesh.mesh_shape == (-1, 2) and gpu.config.mesh.mesh_axis_names == ("data", "model")
    assert gpu.config.mesh.axis_rules == {"batch": "data", "heads": "model"}
    assert gpu.config.model.compute_dtype == BF16 and gpu.config.model.param_dtype is None
    assert gpu.config.model.decoder.layer.self_attention.kernels == {"attention": "test_gpu_attention"}
    assert gpu.config.model.decoder.layer.feed_forward.remat_policy is None and gpu.config.trainer.microbatches == 1
    assert set(gpu.kernel_choices()["attention"]) == {"test_gpu_attention"}

    # tpu-v5p-64: the (test) tpu plugin's rule.
    assert tpu.config.mesh.rule == "test-tpu-v5p" and tpu.mesh_rule == "test-tpu-v5p (plugin tpu)"
    assert tpu.config.mesh.mesh_shape == (-1, 4) and tpu.config.mesh.mesh_axis_names == ("fsdp", "model")
    assert tpu.config.mesh.axis_rules == {"batch": "fsdp", "embed": "fsdp", "heads": "model"}
    assert tpu.config.model.decoder.layer.remat_policy == "dots_with_no_batch_dims_saveable"
    assert tpu.config.trainer.microbatches == 2 and tpu.config.model.compute_dtype is None
    assert tpu.config.model.decoder.layer.self_attention.kernels is None

    # `axcore config --mesh-selector` shows the rule and the modifiers it applied.
    for selector, line in [
        ("cpu-8", r"# mesh rule: cpu-dev (experiment mesh_rules[0]); modifiers: remat(policy='full', "
                  r"paths='decoder\.layer\d+\.feed_forward'), microbatches(count=4)"),
        ("gpu-h100-8", "# mesh rule: test-gpu-h100 (plugin gpu); modifiers: compute_dtype(compute='bfloat16'), "
                       "attention_kernel(kernel='test_gpu_attention', paths='.*')"),
        ("tpu-v5p-64", r"# mesh rule: test-tpu-v5p (plugin tpu); modifiers: remat(policy='save_matmul_outputs', "
                       r"paths='decoder\.layer\d+'), microbatches(count=2)"),
    ]:
        assert main(["config", path, "--mesh-selector", selector], objects=OBJECTS) == 0
        out = capsys.readouterr().out
        assert f"mesh.instance_type: {selector}\n" in out and f"\n{line}\n" in out


def test_without_the_hardware_plugin_the_default_rule_applies(tmp_path):
    exp = load_experiment(_write(tmp_path, EXPERIMENT), ["mesh.instance_type=gpu-h100-8"])
    assert exp.config.mesh.rule == "default" and exp.mesh_rule == "default (plugin axcore.platform.mesh)"
    assert exp.mesh_modifiers == [] and exp.config.mesh.mesh_shape == (-1,)
    assert exp.flat().endswith("# mesh rule: default (plugin axcore.platform.mesh); modifiers: none\n")


# -- Precedence ---------------------------------------------------------------------------


def _rule(name, pattern=r"x-\d+", priority=0):
    return MeshRule(name, pattern, (-1,), ("data",), priority=priority)


class Rules:
    """A plugin registering the given rules."""

    def __init__(self, *rules):
        self.rules = rules

    @axcore.hookimpl
    def axcore_register_mesh_rules(self, register):
        for rule in self.rules:
            register(rule)


def _registry(**plugins):
    return axcore.create_plugin_manager(list(plugins), objects=plugins).registries.mesh_rules


def test_higher_priority_first_then_name():
    rules = [_rule("b"), _rule("a"), _rule("low", ".*", -5), _rule("high", r"x-8", 3)]
    assert select_mesh_rule(rules, "x-8").name == "high"
    assert select_mesh_rule(rules, "x-1").name == "a"  # Same priority, one origin: by name.
    assert select_mesh_rule(rules, "y-1").name == "low"
    with pytest.raises(NoMeshRuleError, match="No mesh rule matches instance type 'y-1'; rules: b, a"):
        select_mesh_rule(rules[:2], "y-1")


def test_experiment_local_rules_come_before_registered_ones():
    registered = _registry(p=Rules(_rule("plugin-rule", priority=100)))
    local = [_rule("mine", r"x-.*", priority=None), _rule("second", r"x-.*", priority=None)]
    assert select_mesh_rule(registered, "x-8", local=local).name == "mine"  # Before any registered rule, in list order.
    # With a priority, a local rule is sorted among registered ones; on a tie it comes first.
    assert select_mesh_rule(registered, "x-8", local=[_rule("fallback", priority=-1)]).name == "plugin-rule"
    assert select_mesh_rule(registered, "x-8", local=[_rule("tie", priority=100)]).name == "tie"
    assert select_mesh_rule(registered, "x-8", local=[_rule("above", priority=101)]).name == "above"


def test_a_tie_between_two_plugins_is_an_error_naming_both():
    registered = _registry(p=Rules(_rule("from-p")), q=Rules(_rule("from-q")))
    with pytest.raises(AmbiguousMeshRuleError, match=r"'from-p' \(plugin 'p'\) and 'from-q' \(plugin 'q'\) both match "
                                                     r"instance type 'x-8' with priority 0"):
        select_mesh_rule(registered, "x-8")
    # Not a tie: other priorities, or only one of them matches, or both from one plugin (by name).
    assert select_mesh_rule(_registry(p=Rules(_rule("from-p")), q=Rules(_rule("from-q", priority=1))), "x-8").name == "from-q"
    assert select_mesh_rule(_registry(p=Rules(_rule("from-p")), q=Rules(_rule("from-q", "y-8"))), "x-8").name == "from-p"
    assert select_mesh_rule(_registry(p=Rules(_rule("b"), _rule("a"))), "x-8").name == "a"
    # A rule that matches first at a higher priority is not ambiguous.
    three = _registry(p=Rules(_rule("from-p")), q=Rules(_rule("from-q")), r=Rules(_rule("from-r", priority=1)))
    assert select_mesh_rule(three, "x-8").name == "from-r"


def test_the_tie_error_reaches_load_experiment_and_mesh_rule_resolves_it():
    objects = {"p": Rules(_rule("from-p", "cpu-.*")), "q": Rules(_rule("from-q", "cpu-.*"))}
    with pytest.raises(AmbiguousMeshRuleError, match="choose one with mesh.rule"):
        load_experiment(None, ["plugins=[p, q]", "mesh.instance_type=cpu-8"], objects=objects)
    exp = load_experiment(None, ["plugins=[p, q]", "mesh.instance_type=cpu-8", "mesh.rule=from-q"], objects=objects)
    assert exp.config.mesh.rule == "from-q" and exp.mesh_rule == "from-q (plugin q)"


def test_local_rule_in_yaml_wins_and_mesh_rule_can_pick_either(tmp_path):
    text = "mesh_rules:\n  - {name: mine, instance_type: 'gpu-.*', mesh_shape: [-1, 8], mesh_axis_names: [data, model]}\n"
    path = _write(tmp_path, text)
    exp = load_experiment(path, ["mesh.instance_type=gpu-h100-8"], objects=OBJECTS)
    assert exp.config.mesh.rule == "mine" and exp.config.mesh.mesh_shape == (-1, 8)
    assert exp.config.model.compute_dtype is None  # The plugin rule's modifiers did not run.
    plugin = load_experiment(path, ["mesh.instance_type=gpu-h100-8", "mesh.rule=test-gpu-h100"], objects=OBJECTS)
    assert plugin.config.mesh.rule == "test-gpu-h100" and plugin.config.model.compute_dtype == BF16
    below = load_experiment(path, ["mesh.instance_type=gpu-h100-8", "mesh_rules[0].priority=-1"], objects=OBJECTS)
    assert below.config.mesh.rule == "test-gpu-h100"  # An explicit priority below the plugin's 10.
    assert load_experiment(path, ["mesh.instance_type=cpu-16", "mesh.rule=mine"]).config.mesh.mesh_shape == (-1, 8)
    with pytest.raises(UnknownComponentError, match=r"'mesh.rule' names no mesh rule 'mien' \(did you mean 'mine'\?\)"):
        load_experiment(path, ["mesh.instance_type=cpu-2", "mesh.rule=mien"])


def test_mesh_fields_the_experiment_sets_win_over_the_rule_and_its_modifiers(tmp_path):
    text = EXPERIMENT + "      - {type: mesh_shape, shape: [4, -1]}\n"
    path = _write(tmp_path, text)
    assert load_experiment(path, ["mesh.instance_type=cpu-8"]).config.mesh.mesh_shape == (4, -1)  # The modifier's.
    exp = load_experiment(path, ["mesh.instance_type=cpu-8", "mesh.mesh_shape=[1, 8]", "mesh.axis_rules={}"])
    assert exp.config.mesh.mesh_shape == (1, 8) and exp.config.mesh.axis_rules == {}
    assert exp.config.mesh.mesh_axis_names == ("data", "model")  # Unset: the rule's.
    with pytest.raises(ConfigError, match=r"mesh.mesh_shape \[8\] and mesh.mesh_axis_names \['data', 'model'\] differ "
                                          r"in length \(mesh rule 'cpu-dev'"):
        load_experiment(path, ["mesh.instance_type=cpu-8", "mesh.mesh_shape=[8]"])


# -- `mesh_rules:` errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule, error, message",
    [
        ("{name: a, instance_type: 'cpu-.*', modifiers: [{type: microbatches, count: 2}, {type: remaat, policy: full}]}",
         UnknownComponentError, r"'mesh_rules\[0\]\.modifiers\[1\]\.type': no config modifier named 'remaat' "
                                r"\(did you mean 'remat'\?\)"),
        ("{name: a, instance_type: 'cpu-.*', modifiers: [{type: microbatches, count: 2}, {type: remat, policy: full, "
         "paths: 'decoder\\.(layer'}]}",
         ConfigError, r"'mesh_rules\[0\]\.modifiers\[1\]': Config modifier remat.*paths 'decoder\\\.\(layer' is not a "
                      r"regular expression"),
        ("{name: a, instance_type: 'cpu-(', modifiers: []}", ConfigError,
         r"'mesh_rules\[0\]\.instance_type': 'cpu-\(' is not a regular expression"),
        ("{instance_type: 'cpu-.*'}", MissingRequiredError, r"'mesh_rules\[0\]' needs name"),
        ("{name: default, instance_type: 'cpu-.*'}", ConfigError,
         r"'mesh_rules\[0\]\.name': 'default' is a mesh rule of plugin 'axcore.platform.mesh'"),
        ("{name: a, instance_type: 'cpu-.*', mesh_shape: [2, -1]}", ConfigError,
         r"'mesh_rules\[0\]': mesh_shape \[2, -1\] needs positive sizes \(one -1 at most\), one per name of "
         r"mesh_axis_names \['data'\]"),
        ("{name: a, instance_type: 'cpu-.*', mesh_shap: [2]}", axcore.UnknownFieldError,
         r"'mesh_rules\[0\]\.mesh_shap' \(did you mean 'mesh_shape'\?\)"),
    ],
)
def test_yaml_rule_errors_name_the_entry(tmp_path, rule, error, message):
    # Rules are checked whether or not they match (here cpu-1 would match them all, gpu-h100-8 none).
    path = _write(tmp_path, f"mesh_rules:\n  - {rule}\n")
    with pytest.raises(error, match=message):
        load_experiment(path, ["mesh.instance_type=gpu-h100-8"])


def test_two_local_rules_may_not_share_a_name(tmp_path):
    path = _write(tmp_path, "mesh_rules: [{name: a, instance_type: x}, {name: a, instance_type: y}]\n")
    with pytest.raises(ConfigError, match=r"'mesh_rules\[1\]\.name': another entry of mesh_rules is named 'a'"):
        load_experiment(path, ["mesh.instance_type=cpu-1"])


def test_a_modifier_that_matches_nothing_names_the_rule_and_its_target(tmp_path):
    path = _write(tmp_path, "mesh_rules: [{name: a, instance_type: 'cpu-.*', modifiers: [{type: remat, policy: full, "
                            "paths: 'encoder.*'}]}]\n")
    with pytest.raises(axcore.NoMatchError, match=r"Mesh rule 'a' \(experiment mesh_rules\[0\]\): Config modifier "
                                                  r"remat\(policy='full', paths='encoder\.\*'\): paths match no module"):
        load_experiment(path, ["mesh.instance_type=cpu-8"])
    # A Python rule's modifier too, e.g. a kernel the registries do not know.
    bad = Rules(MeshRule("bad", r"cpu-.*", (-1,), ("data",), config_modifiers=(attention_kernel("nope"),), priority=1))
    with pytest.raises(AxcoreError, match=r"Mesh rule 'bad' \(plugin bad\): Config modifier attention_kernel"):
        load_experiment(None, ["plugins=[bad]", "mesh.instance_type=cpu-8"], objects={"bad": bad})


def test_yaml_rules_round_trip_and_take_overrides(tmp_path):
    path = _write(tmp_path, EXPERIMENT)
    # A modifier entry is replaced whole (its keys are the factory's arguments, not config fields).
    exp = load_experiment(path, ["mesh.instance_type=cpu-8", "mesh_rules[0].modifiers[1]={type: microbatches, count: 2}"])
    assert exp.config.trainer.microbatches == 2
    saved = _write(tmp_path, axcore.config.to_yaml(exp.config, exp.registries), "saved.yaml")
    again = load_experiment(saved)
    assert again.flat() == exp.flat() and again.config.mesh.mesh_shape == (2, -1)


@pytest.mark.parametrize("text, parts", [
    ("gpu-h100-8", ("gpu", "h100", 8)), ("cpu-8", ("cpu", None, 8)), ("tpu-v5p-64", ("tpu", "v5p", 64)),
    ("neuron-trn2-16", ("neuron", "trn2", 16)), ("gpu", ("gpu", None, None)), ("gpu-h100", ("gpu", "h100", None)),
])
def test_an_instance_type_parses_into_platform_kind_and_count(text, parts):
    from axcore.platform.mesh import InstanceType, instance_platform

    parsed = InstanceType.parse(text)
    assert (parsed.platform, parsed.kind, parsed.count) == parts and instance_platform(text) == parts[0]
