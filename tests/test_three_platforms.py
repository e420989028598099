"""One experiment, three platforms, no model change: the same YAML resolved under
`--mesh-selector gpu-h100-8`, `tpu-v5p-64` and `neuron-trn2-16` (mesh, modifiers, kernel per
op, compiler flags and where they go, kept as golden files), compiled on 8 forced CPU
devices, and quantized matmuls (fp8 from axcore-gpu, int8 from axcore-tpu) switched on by
configuration alone.

The hardware packages are given as plugin objects (CI installs only axcore and plugins/*/).
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
for package in ("axcore_gpu", "axcore_tpu", "axcore_neuron"):
    if str(ROOT / package) not in sys.path:
        sys.path.insert(0, str(ROOT / package))

from axcore.cli import main  # noqa: E402
from axcore.experiment import load_experiment  # noqa: E402
from axcore.testing import host_devices_env  # noqa: E402

import axcore_gpu.fp8_plugin  # noqa: E402
import axcore_gpu.plugin  # noqa: E402
import axcore_neuron.plugin  # noqa: E402
import axcore_tpu.int8_plugin  # noqa: E402
import axcore_tpu.plugin  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden"
OBJECTS = {
    "gpu": axcore_gpu.plugin,
    "tpu": axcore_tpu.plugin,
    "neuron": axcore_neuron.plugin,
    "fp8": axcore_gpu.fp8_plugin,
    "int8": axcore_tpu.int8_plugin,
}
# The experiment: small enough to compile in seconds, shaped so every mesh divides it.
EXPERIMENT = """\
name: three_platforms
model:
  dim: 128
  num_layers: 2
  position_embedding: {max_len: 128}
  decoder:
    layer:
      self_attention: {num_heads: 4}
      feed_forward: {hidden_dim: 256}
input: {batch_size: 64, seq_len: 128}
"""
SELECTORS = ["gpu-h100-8", "tpu-v5p-64", "neuron-trn2-16"]


@pytest.fixture
def experiment_file(tmp_path):
    path = tmp_path / "three_platforms.yaml"
    path.write_text(EXPERIMENT)
    return path


@pytest.mark.parametrize("selector", SELECTORS)
def test_one_experiment_resolves_per_platform_as_its_golden_file(selector, experiment_file, capsys, request):
    assert main(["config", str(experiment_file), "--mesh-selector", selector], objects=OBJECTS) == 0
    text = capsys.readouterr().out
    golden = GOLDEN / f"three_platforms_{selector.replace('-', '_')}.txt"
    if request.config.getoption("--update-goldens"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run pytest --update-goldens"
    assert text == golden.read_text(), f"{selector} resolution changed; review and run pytest --update-goldens"


def test_the_three_resolutions_differ_where_the_platforms_do(experiment_file):
    resolved = {s: load_experiment(str(experiment_file), [f"mesh.instance_type={s}"], objects=OBJECTS) for s in SELECTORS}
    meshes = {s: (e.config.mesh.rule, tuple(e.config.mesh.mesh_axis_names)) for s, e in resolved.items()}
    assert len(set(meshes.values())) == 3, meshes
    assert {s: e.flags_variable for s, e in resolved.items()} == {
        "gpu-h100-8": "XLA_FLAGS", "tpu-v5p-64": "LIBTPU_INIT_ARGS", "neuron-trn2-16": "NEURON_CC_FLAGS",
    }
    decisions = {s: [d for d in e.kernel_decisions() if d.op == "attention"] for s, e in resolved.items()}
    attention = {s: {d.kernel for d in ds} for s, ds in decisions.items()}
    # Batches pack documents (segment ids): cuDNN declines them (no segment-id argument in
    # jax.nn.dot_product_attention), so GPUs run the Pallas kernel, the next by priority.
    assert attention == {"gpu-h100-8": {"pallas"}, "tpu-v5p-64": {"splash"}, "neuron-trn2-16": {"xla"}}
    assert all(
        any(kernel == "cudnn" and "segment" in reason for kernel, reason in d.declined) for d in decisions["gpu-h100-8"]
    )
    # The model config is the same everywhere but for what the rules' modifiers set.
    assert all(e.config.model.compute_dtype == "bfloat16" for e in resolved.values())


@pytest.mark.parametrize("plugin, kernel", [("fp8", "fp8"), ("int8", "int8")])
def test_quantized_matmuls_switch_on_by_configuration_alone(plugin, kernel, experiment_file):
    overrides = [f"plugins=[{plugin}]", "model.compute_dtype=bfloat16"]
    decisions = load_experiment(str(experiment_file), overrides, objects=OBJECTS).kernel_decisions()
    chosen = {d.site: d.kernel for d in decisions if d.op == "dot"}
    projections = [site for site in chosen if site.endswith(("_proj", "_proj.dot"))]
    assert len(projections) == 12 and {chosen[site] for site in projections} == {kernel}
    assert chosen["model.lm_head.dot"] != kernel  # The float32 logits head keeps the regular kernel.


COMPILE_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
import axcore_gpu.plugin, axcore_neuron.plugin, axcore_tpu.plugin
from axcore.cli import main
objects = {{"gpu": axcore_gpu.plugin, "tpu": axcore_tpu.plugin, "neuron": axcore_neuron.plugin}}
for selector in {selectors!r}:
    print("SELECTOR", selector, flush=True)
    print("EXIT", main(["compile", {path!r}, "--mesh-selector", selector], objects=objects), flush=True)
"""


@pytest.mark.slow
def test_each_platform_compiles_on_8_cpu_devices_or_says_why(experiment_file):
    paths = [str(ROOT / p) for p in ("axcore_gpu", "axcore_tpu", "axcore_neuron")]
    code = COMPILE_SCRIPT.format(paths=paths, selectors=SELECTORS, path=str(experiment_file))
    env = host_devices_env(8)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = out.stdout.split("SELECTOR ")[1:]
    assert [s.split()[0] for s in sections] == SELECTORS
    for section in sections:
        selector, exit_code = section.split()[0], section.rsplit("EXIT ", 1)[1].strip()
        if exit_code == "0":
            assert "parameters:" in section and "flops" in section.lower(), section
        else:  # A mesh that needs more devices than 8: one line saying so, status 2.
            assert exit_code == "2" and "devices" in out.stderr, (selector, out.stderr[-2000:])
