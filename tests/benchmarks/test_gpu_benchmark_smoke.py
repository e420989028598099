"""`python -m benchmarks.gpu_step --smoke` end to end, and the pieces it relies on.

The smoke run (a tiny Llama on whatever backend JAX has, 2 rounds) goes through the
same parent/child path as the GPU run. Its timings mean nothing; checked are the
JSON keys, that both contenders ran from the same parameters (equal parameter counts,
first-step losses within bfloat16 tolerance) and that both ask for bfloat16 matmuls.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import gpu_step, llama_jax, step_accounting

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTENDER_KEYS = {
    "num_params", "compile_s", "step_time_s", "tokens_per_s", "mfu", "mfu_full_square", "peak_bytes_in_use",
    "compiled_memory", "first_step_loss", "losses", "dots",
}


def _smoke(tmp: pathlib.Path, *extra: str) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_step", "--smoke", "--results-dir", str(tmp), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    return proc, tmp


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory) -> dict:
    proc, directory = _smoke(tmp_path_factory.mktemp("gpu_step"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "| auto (" in proc.stdout and "Matmul dtypes" in proc.stdout
    return json.loads((directory / "gpu_step_auto.json").read_text())


@pytest.mark.slow
def test_smoke_json_names_the_machine_and_both_contenders(smoke_result):
    data = smoke_result
    assert data["benchmark"] == "gpu_step_auto" and data["smoke"] is True
    assert {"device_kind", "jax_version", "backend"} <= set(data["machine"])
    assert set(data["contenders"]) == {"axcore", "pure_jax"}
    for name, contender in data["contenders"].items():
        assert CONTENDER_KEYS <= set(contender), name
        assert contender["step_time_s"]["n"] == data["rounds"] == 2
        assert contender["tokens_per_s"] > 0
        assert len(contender["losses"]) == data["warmup_steps"] + data["rounds"] * data["steps_per_round"]
    assert data["attention"]["requested"] == "auto"
    assert data["attention"]["pure_jax"] in ("xla", "cudnn")
    assert data["ratio_axcore_over_pure_jax"]["median"] > 0
    flops = data["flops_per_step"]
    assert flops["total"] == flops["dense"] + flops["attention_causal"]
    assert data["dtypes"] == {"param": "float32", "compute": "bfloat16"}
    if data["machine"]["backend"] == "cpu":
        assert data["contenders"]["axcore"]["mfu"] is None and data["peak_tflops"] is None
    assert any(row["metric"].endswith("axcore / pure JAX (median of per-round ratios)") for row in data["headlines"])


@pytest.mark.slow
def test_smoke_contenders_start_from_the_same_parameters(smoke_result):
    data = smoke_result
    counts = {name: c["num_params"] for name, c in data["contenders"].items()}
    assert len(set(counts.values())) == 1 and counts["axcore"] == data["model"]["num_params"], counts
    assert data["first_step_losses_agree"], data["first_step_loss_rel_diff"]
    first = [c["first_step_loss"] for c in data["contenders"].values()]
    assert abs(first[0] - first[1]) <= step_accounting.LOSS_RTOL * abs(first[1])


@pytest.mark.slow
def test_smoke_both_contenders_ask_for_bfloat16_matmuls(smoke_result):
    for name, contender in smoke_result["contenders"].items():
        requested = contender["dots"]["requested"]
        assert requested.get("bf16 x bf16 -> bf16", 0) > 0, (name, requested)
        # Forward and both backward products of q, k, v, o, gate, up, down and the head, and of
        # the attention's two einsums unless cuDNN's fused kernel does those.
        per_layer = 9 if contender["attention"] == "xla" else 7
        assert sum(requested.values()) == 3 * (per_layer * smoke_result["model"]["layers"] + 1), (name, requested)
        # What the backend runs: on CPU, XLA keeps the bfloat16 dots with float32 results in bfloat16.
        assert any(key.split()[1] == "bf16" for key in contender["dots"]["matmuls"]), (name, contender["dots"])


@pytest.mark.slow
def test_cudnn_without_a_usable_kernel_fails_with_a_clear_message(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the cudnn kernel may well run")
    proc, directory = _smoke(tmp_path, "--attention", "cudnn")
    assert proc.returncode == 1
    assert "--attention cudnn:" in proc.stderr
    data = json.loads((directory / "gpu_step_cudnn.json").read_text())
    assert "cudnn" in data["error"] and data["oom"] is False


def test_flop_formula_of_the_full_model():
    shape = llama_jax.LlamaShape()
    assert shape.num_params() == 889_260_032  # vocab 32768, d 2048, 16 layers, GQA 16/8, SwiGLU 5632.
    flops = step_accounting.flops_per_step(shape)
    assert flops["dense"] == 6 * shape.num_params_matmul() * 8 * 2048
    assert flops["attention_causal"] * 2 == flops["attention_full_square"] == 12 * 16 * 8 * 2048**2 * 2048


def test_peak_table_matches_device_kinds():
    assert step_accounting.peak_tflops("NVIDIA H100 80GB HBM3", "gpu", None)[0] == 989.0
    assert step_accounting.peak_tflops("NVIDIA H100 PCIe", "gpu", None)[0] == 756.0
    assert step_accounting.peak_tflops("NVIDIA A100-SXM4-80GB", "gpu", None)[0] == 312.0
    assert step_accounting.peak_tflops("cpu", "cpu", None)[0] is None
    assert step_accounting.peak_tflops("anything", "cpu", 100.0)[0] == 100.0


def test_hlo_matmuls_reads_gpu_style_modules():
    text = "\n".join([
        "%gemm_fusion_dot.1_computation (parameter_0: bf16[64,32], parameter_1: bf16[32,16]) -> bf16[64,16] {",
        "  %parameter_0 = bf16[64,32]{1,0} parameter(0)",
        "  %parameter_1 = bf16[32,16]{1,0} parameter(1)",
        "  ROOT %dot.0 = bf16[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}",
        "}",
        "ENTRY %main (p0: f32[64,32], p1: bf16[32,16]) -> f32[64,16] {",
        "  %p0 = f32[64,32]{1,0} parameter(0)",
        "  %p1 = bf16[32,16]{1,0} parameter(1)",
        '  %custom-call.1 = (f32[64,16]{1,0}, s8[4194304]{0}) custom-call(f32[64,32]{1,0} %p0, %p1), '
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1}}',
        '  %custom-call.2 = (bf16[2,64,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%p1, %p1, %p1), '
        'custom_call_target="__cudnn$fmhaSoftmax"',
        "  ROOT %t = (f32[64,16]{1,0}) tuple(%custom-call.1)",
        "}",
    ])
    found = step_accounting.hlo_matmuls(text)
    assert found["matmuls"] == {"dot bf16 x bf16 -> bf16": 1, "cublas f32 x bf16 -> f32": 1}
    assert found["custom_calls"] == {"__cublas$lt$matmul": 1, "__cudnn$fmhaSoftmax": 1}
    assert "cublas f32[64,32] x bf16[32,16] -> f32[64,16]" in found["matmul_shapes"]


def test_pure_attention_matches_jax_dot_product_attention_with_gqa():
    # The cudnn path calls jax.nn.dot_product_attention with the same arguments; its XLA
    # implementation checks the layout and the query-head -> kv-head grouping on any backend.
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 16, 4, 8), jnp.float32)
    k = jax.random.normal(kk, (2, 16, 2, 8), jnp.float32)
    v = jax.random.normal(kv, (2, 16, 2, 8), jnp.float32)
    ours = llama_jax.xla_attention(q, k, v, 8**-0.5)
    ref = jax.nn.dot_product_attention(q, k, v, scale=8**-0.5, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_a_phase_out_of_device_memory_is_retried_at_half_the_batch(tmp_path, monkeypatch):
    commands = []

    def fake_child(command, **kwargs):
        commands.append(command)
        batch = int(command[command.index("--batch", command.index("--phase")) + 1])
        payload = {"error": "RESOURCE_EXHAUSTED: Out of memory", "oom": True} if batch > 2 else {"model": {"batch": batch}}
        (tmp_path / "gpu_step_auto.json").write_text(json.dumps(payload))
        return subprocess.CompletedProcess(command, gpu_step.OOM_EXIT if batch > 2 else 0)

    monkeypatch.setattr(gpu_step.subprocess, "run", fake_child)
    out = gpu_step.run(argv=["--smoke", "--batch", "8", "--results-dir", str(tmp_path)])
    assert [c[c.index("--phase") + 3] for c in commands] == ["8", "4", "2"]
    assert out["failed"] == [] and out["phases"]["auto"]["batch_reduced_from"] == [8, 4]
    assert json.loads((tmp_path / "gpu_step_auto.json").read_text())["batch_reduced_from"] == [8, 4]


def test_a_failing_phase_writes_its_error_and_says_whether_it_was_memory(tmp_path, monkeypatch):
    def out_of_memory(args, attention):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")

    monkeypatch.setattr(gpu_step, "run_phase", out_of_memory)
    args = gpu_step.parse_args(["--smoke", "--phase", "xla", "--results-dir", str(tmp_path)])
    assert gpu_step.phase_main(args) == gpu_step.OOM_EXIT
    data = json.loads((tmp_path / "gpu_step_xla.json").read_text())
    assert data["oom"] is True and "RESOURCE_EXHAUSTED" in data["error"]
