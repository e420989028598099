"""Which kernel each op gets is visible (`axcore config`, the training log), and a hardware plugin
is loaded for the platform of a selected instance type, registering kernels and mesh rules only."""

import io
import os
import re
import subprocess
import sys

import axcore
from axcore.cli import main
from axcore.config import replace
from axcore.kernels import XlaAttention, describe_kernel_choices
from axcore.layers import MultiheadAttention
from axcore.platform.mesh import MeshRule
from axcore.testing import TINY_OVERRIDES


class FastAttention(XlaAttention):
    name = "fast"
    priority = 50


class FakeHardware:
    """A hardware plugin for the made-up platform `fakehw`."""

    @axcore.hookimpl
    def axcore_register_attention_kernels(self, register):
        register(FastAttention())

    @axcore.hookimpl
    def axcore_register_mesh_rules(self, register):
        register(MeshRule("fakehw-x1", r"fakehw-x1-\d+", (-1,), ("data",), priority=10))

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, MultiheadAttention, lambda _, c: c.set(softcap=30.0))


def test_selected_instance_type_loads_its_platforms_plugin_for_kernels_and_mesh_rules_only():
    objects = {"fakehw": FakeHardware()}
    exp = axcore.load_experiment(None, [*TINY_OVERRIDES, "mesh.instance_type=fakehw-x1-8"], objects=objects)
    assert exp.config.mesh.rule == "fakehw-x1"
    info = next(i for i in exp.plugin_manager.plugins if i.name == "fakehw")
    assert info.source == "platform" and not info.listed
    assert exp.config.model.decoder.layer.self_attention.softcap is None  # Its transform did not run.
    choices = exp.kernel_choices()
    assert set(choices["attention"]) == {"fast"}
    assert sorted(choices["attention"]["fast"]) == [f"model.decoder.layer{i}.self_attention.attention" for i in range(2)]
    # Listed, its transform runs too.
    listed = axcore.load_experiment(None, [*TINY_OVERRIDES, "mesh.instance_type=fakehw-x1-8", "plugins=[fakehw]"], objects=objects)
    assert listed.config.model.decoder.layer.self_attention.softcap == 30.0
    # Without the selector the plugin is not loaded at all.
    plain = axcore.load_experiment(None, TINY_OVERRIDES, objects=objects)
    assert "fakehw" not in [i.name for i in plain.plugin_manager.plugins]
    assert "fast" not in plain.kernel_choices()["attention"]


def test_config_command_shows_the_kernel_of_each_op(capsys):
    assert main(["config", "default", *sum((["--set", o] for o in TINY_OVERRIDES), []), "--mesh-selector", "fakehw-x1-8"],
                objects={"fakehw": FakeHardware()}) == 0
    out = capsys.readouterr().out
    assert "mesh.rule: fakehw-x1\n" in out
    assert "# kernel attention: fast (2 sites)\n" in out
    assert "# kernel dot: " in out


def test_describe_kernel_choices_ranks_by_use():
    choices = {"dot": {"xla": ["a"], "int8": ["b", "c"]}, "attention": {"fast": ["d"]}}
    assert describe_kernel_choices(choices) == {"attention": "fast (1 site)", "dot": "int8 (2 sites), xla (1 site)"}


def test_training_logs_the_kernel_of_each_op(tmp_path):
    from axcore.trainer.trainer import Trainer

    exp = axcore.load_experiment(None, [*TINY_OVERRIDES, "trainer.max_steps=1", f"trainer.run_dir={tmp_path}", "trainer.eval_every=0",
                                         "trainer.sample.num_tokens=0", "mesh.instance_type=fakehw-x1-1"],
                                 objects={"fakehw": FakeHardware()})
    log = io.StringIO()
    Trainer(exp, stream=log).run()
    assert "Kernel for attention: fast (2 sites)" in log.getvalue()


def test_describe_kernel_choices_counts_each_site_once():
    # A site traced twice (a train step's retrace, declaring kernel state) is still one site.
    choices = {"dot": {"xla": ["a", "b", "a", "b"], "int8": ["c"]}}
    assert describe_kernel_choices(choices) == {"dot": "xla (2 sites), int8 (1 site)"}


def test_config_and_train_report_the_same_kernel_sites(tmp_path):
    # Subprocesses, as a user runs them; the count is the model's weight matmuls, counted from its shape:
    # per layer q, k, v, o projections and the FFN's up and down projections, plus the output head.
    sets = [a for o in [*TINY_OVERRIDES, "trainer.max_steps=1", "trainer.eval_every=0", "trainer.sample.num_tokens=0",
                        f"trainer.run_dir={tmp_path / 'run'}"] for a in ("--set", o)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def axcore(*args):
        out = subprocess.run([sys.executable, "-m", "axcore.cli", *args, *sets], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout + out.stderr

    layers = int(dict(o.split("=") for o in TINY_OVERRIDES)["model.num_layers"])
    expected = f"xla ({layers * (4 + 2) + 1} sites)"
    config = re.search(r"^# kernel dot: (.*)$", axcore("config", "default"), re.M).group(1)
    train = re.search(r"^Kernel for dot: (.*)$", axcore("train"), re.M).group(1)
    assert config == train == expected
