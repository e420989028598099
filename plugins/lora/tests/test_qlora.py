"""QLoRA (`lora.base_format: int8 | nf4`) on the tiny model, against an independent NumPy quantizer.

Tiny model (axcore.testing.TINY_OVERRIDES): dim 32, 2 layers, 2 heads of 16, feed-forward hidden 64; the
targeted weights are q, k, v `[32, 2, 16]`, o `[2, 16, 32]`, up `[32, 64]`, down `[64, 32]`
per layer. The quantized model is initialised with the same key as the plain float model,
so its stored base must be the float model's weights quantized.
"""

import math

import jax
import numpy as np
import pytest
from scipy.stats import norm

import axcore
from axcore.data import Split
from axcore.experiment import load_experiment
from axcore.testing import TINY_OVERRIDES
from axcore.trainer.step import TrainStep

from axcore_lora import LoraConfigError
from axcore_lora.memory import train_state_memory

RANK = 4
# (in, out) of every targeted projection of one tiny layer.
SITES = {"q": (32, 32), "k": (32, 32), "v": (32, 32), "o": (32, 32), "up": (32, 64), "down": (64, 32)}


def _experiment(fmt, *extra):
    return load_experiment(None, [*TINY_OVERRIDES, "plugins=[lora]", f"lora.rank={RANK}", f"lora.base_format={fmt}",
                                  *extra])


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _init(exp):
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    return model, jax.device_get(jax.jit(model.initialize)(jax.random.key(0)))


# -- An independent NumPy quantizer and decoder ------------------------------------------------


def nf4_code_from_the_paper():
    """QLoRA's NF4 values: 8 positive and 7 negative normal quantiles at offset 0.9677 plus 0, scaled to [-1, 1]."""
    offset = 0.9677083
    positive = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    negative = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    return (values / values.max()).astype(np.float32)


def rows(w, name):
    """`[out, in]`: the weight's free dims first (o contracts its first two dims, the others their first)."""
    k = 2 if name.endswith("/wo") else 1
    return w.reshape(math.prod(w.shape[:k]), -1).T


def np_quantize(fmt, r):
    """`(codes, scales)`: int8 codes `[out, in]` and per-row scales, or NF4 indices `[blocks, 64]` and absmaxes."""
    r = r.astype(np.float32)
    if fmt == "int8":
        amax = np.abs(r).max(axis=1)
        scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        return np.clip(np.rint(r / scale[:, None]), -127, 127).astype(np.int8), scale
    blocks = np.pad(r.reshape(-1), (0, -r.size % 64)).reshape(-1, 64)
    absmax = np.abs(blocks).max(axis=1)
    absmax = np.where(absmax > 0, absmax, np.float32(1)).astype(np.float32)
    code = nf4_code_from_the_paper()
    return np.abs(blocks[..., None] / absmax[:, None, None] - code).argmin(axis=-1), absmax


def np_decode(fmt, stored, shape):
    """`(codes, scales, values [out, in])` of a stored uint8 weight (int8: `[out, in + 4]`; nf4: `[blocks, 36]`)."""
    out, in_dim = shape
    scales = np.ascontiguousarray(stored[:, -4:]).view("<f4")[:, 0]
    if fmt == "int8":
        codes = np.ascontiguousarray(stored[:, :in_dim]).view(np.int8)
        return codes, scales, codes.astype(np.float32) * scales[:, None]
    packed = stored[:, :32]
    codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(len(stored), 64)
    values = nf4_code_from_the_paper()[codes] * scales[:, None]
    return codes, scales, values.reshape(-1)[: out * in_dim].reshape(out, in_dim)


def bound(fmt, scales, shape):
    """Largest allowed |w - w'| per element of `[out, in]`: scale / 2 (int8), absmax * largest gap / 2 (nf4)."""
    out, in_dim = shape
    if fmt == "int8":
        return np.repeat(scales[:, None] / 2, in_dim, axis=1)
    gap = np.diff(nf4_code_from_the_paper()).max()
    return np.repeat(scales * gap / 2, 64)[: out * in_dim].reshape(out, in_dim)


# -- Tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_model():
    model, params = _init(load_experiment(None, TINY_OVERRIDES))
    return model, jax.device_get(params)


def test_the_nf4_table_is_the_papers():
    from axcore_lora.quant import NF4_CODE

    np.testing.assert_allclose(NF4_CODE, nf4_code_from_the_paper(), atol=2e-7)


@pytest.mark.parametrize("fmt,quantize", [("int8", "all"), ("nf4", "targets")])
def test_the_quantized_base_is_within_its_rounding_bound_and_the_adapters_train(fmt, quantize, float_model):
    """Stored base = the float twin's weights quantized (NumPy); logits = the twin's with those weights
    dequantized; 15 steps: the loss falls, only the adapters change. `quantize: all` stores the
    untargeted output head quantized too."""
    exp = _experiment(fmt, "trainer.learner.learning_rate=0.01", "trainer.learner.schedule.warmup_steps=0",
                      "trainer.max_steps=15", "trainer.seed=0", f"lora.quantize={quantize}")
    step = TrainStep(exp)
    state = step.init_state()
    base_model, base = float_model
    stored, expected = _flat(jax.device_get(state["params"])), _flat(base)
    quantized = [k for k, v in stored.items() if v.dtype == np.uint8]
    heads = ["lm_head/weight"] if quantize == "all" else []
    assert sorted(quantized) == sorted([k for k in expected if k.startswith("decoder/") and (
        k.endswith(("/wq", "/wk", "/wv", "/wo")) or "_proj/weight" in k)] + heads)  # Targets (+ the head), no more.
    dequantized = dict(expected)
    for name in quantized:
        r = rows(expected[name], name)
        codes, scales, values = np_decode(fmt, stored[name], r.shape)
        want_codes, want_scales = np_quantize(fmt, r)
        np.testing.assert_array_equal(codes, want_codes, err_msg=name)
        np.testing.assert_allclose(scales, want_scales, rtol=1e-6, err_msg=name)
        assert np.all(np.abs(r - values) <= bound(fmt, scales, r.shape) * (1 + 1e-6)), name
        assert np.abs(r - values).max() > 0  # Rounding happened (the comparison is not trivially empty).
        dequantized[name] = values.T.reshape(expected[name].shape)  # [out, in] -> [*in_dims, *out_dims].
    for name, value in stored.items():  # Everything else is the float model's, adapters aside.
        if name not in quantized and "/lora_" not in name:
            np.testing.assert_array_equal(value, expected[name], err_msg=name)

    # Fresh adapters (B = 0): the logits are the float model's with the NumPy-dequantized weights.
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    twin = jax.tree_util.tree_unflatten(jax.tree.structure(base), [dequantized[k] for k in _flat(base)])

    def logits(m, p):
        ids = batch["input_ids"]
        return np.asarray(jax.jit(lambda p: axcore.functional(m, p, (ids,), None, False, method="logits")[0])(p))

    np.testing.assert_allclose(logits(step.model, state["params"]), logits(base_model, twin), rtol=1e-5, atol=1e-5)

    adapters = 2 * sum(RANK * (i + o) for i, o in SITES.values())
    assert sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0) == 2 * adapters
    train = step.compiled_train_step()
    losses = []
    for _ in range(15):
        state, metrics = train(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
    final = _flat(jax.device_get(state["params"]))
    for name, value in stored.items():
        if "/lora_" not in name:  # The quantized base (and everything else frozen) is bit-identical.
            np.testing.assert_array_equal(final[name], value, err_msg=name)


@pytest.mark.parametrize("fmt", ["float", "int8", "nf4"])
def test_memory_report_counts_bytes_per_base_parameter(fmt):
    report = train_state_memory(_experiment(fmt))
    sites = [s for _ in range(2) for s in SITES.values()]
    elements = sum(i * o for i, o in sites)
    stored = {"float": 4 * elements, "int8": sum(o * (i + 4) for i, o in sites),
              "nf4": sum(math.ceil(i * o / 64) * 36 for i, o in sites)}[fmt]
    adapters = 2 * sum(RANK * (i + o) for i, o in SITES.values())
    assert report["quantized_base_bytes"] == (0 if fmt == "float" else stored)
    assert report["base_bytes_per_parameter"] == (None if fmt == "float" else round(stored / elements, 4))
    if fmt == "nf4":
        assert report["base_bytes_per_parameter"] == 0.5625  # 0.5 + a float32 absmax per 64.
    assert report["adapter_bytes"] == 4 * adapters and report["gradient_bytes"] == 4 * adapters
    assert report["trainable_parameters"] == adapters
    assert 8 * adapters <= report["optimizer_bytes"] <= 8 * adapters + 64  # Adam's two moments (+ counters).
    assert report["train_state_bytes"] == report["params_bytes"] + report["optimizer_bytes"] + 4 * adapters


def test_a_bad_base_format_or_a_quantized_tied_head_is_refused_and_the_cli_reports_memory(capsys):
    with pytest.raises(LoraConfigError, match=r"'lora\.base_format' \('int4'\) is not a base format; use one of "
                                              r"float, int8, nf4"):
        _experiment("int4")
    with pytest.raises(LoraConfigError, match=r"selects the tied output head embedding\.attend, whose weight is the "
                                              r"embedding table the input lookup reads too"):
        _experiment("nf4", "model.lm_head=null", "lora.target=q|attend")
    from axcore.cli import main

    assert main(["lora", "memory", "default", "--set", "plugins=[lora]", "--set", "lora.base_format=nf4",
                 *[f"--set={o}" for o in TINY_OVERRIDES]]) == 0
    assert "base_bytes_per_parameter: 0.5625" in capsys.readouterr().out


def _step_bytes(fmt, overrides):
    """Argument + temporary bytes of the compiled train step (XLA's memory_analysis; deterministic, not timed)."""
    step = TrainStep(_experiment(fmt, *overrides))
    compiled = step.compiled_train_step().lower(step.abstract_state(), step.abstract_batch()).compile()
    analysis = compiled.memory_analysis()
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes


def test_the_compiled_qlora_step_keeps_no_float_copy_of_the_quantized_base():
    """What QLoRA saves in the step is what storing the targeted projections quantized saves: their float32 bytes
    minus the stored bytes (int8: [out, in + 4]; nf4: ceil(in * out / 64) blocks of 36), at least 90% of it. A dequantized
    float weight kept for the backward pass (or computed for every layer up front) would eat that saving."""
    dim, hidden = 128, 512
    overrides = [f"model.dim={dim}", f"model.decoder.layer.feed_forward.hidden_dim={hidden}", "input.batch_size=1",
                 "input.seq_len=16"]
    sites = [(dim, dim)] * 4 + [(dim, hidden), (hidden, dim)]  # q, k, v, o, up, down per layer; 2 layers.
    lora = _step_bytes("float", overrides)
    for fmt in ("int8", "nf4"):
        stored = sum(o * (i + 4) if fmt == "int8" else math.ceil(i * o / 64) * 36 for i, o in sites)
        saving = 2 * (sum(4 * i * o for i, o in sites) - stored)
        got = lora - _step_bytes(fmt, overrides)
        assert got >= 0.9 * saving, (fmt, got, saving)
