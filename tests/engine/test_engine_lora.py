"""Several LoRA adapters resident in `axcore.engine.Engine`, one per request, rows of different adapters in one call.

A tiny base run (axcore.testing.TINY_OVERRIDES: dim 32, 2 layers, byte vocabulary 256) and two LoRA runs of it
with random adapters of different ranks, scales and targets: `a1` (rank 4, alpha 8, q and v) and `a2` (rank 2,
alpha 4, q, k, v, o, up, down). References never go through the engine: each adapter is merged into the base
weights in NumPy (`W + alpha / rank * A @ B` in the weight's `[in, out]` layout) and the base model's full forward
(no cache) runs on the merged weights, greedy one token at a time. A QLoRA (int8 base) adapter is checked against
the plugin's own `merge` (which dequantizes the base).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from live_server import LiveServer

import axcore
from axcore.engine import EngineConfig
from axcore.engine.adapters import AdapterLoadError
from axcore.engine.requests import GenerationRequest, SamplingParams, SamplingParamsError
from axcore.experiment import load_experiment
from axcore.inference import load_engine
from axcore.inference.run_loading import load_model, save_model
from axcore.serving import TextFrontend
from axcore.testing import TINY_OVERRIDES

lora = pytest.importorskip("axcore_lora")
from axcore_lora import peft  # noqa: E402
from axcore_lora.checkpoint import merge_params, split_params  # noqa: E402

CONFIG = EngineConfig(block_size=4, num_blocks=40, max_seqs=4, max_tokens_per_step=16, batch_buckets=(4,),
                      token_buckets=(16,))
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)
ADAPTERS = {"a1": (4, 8.0, "q|v", 1), "a2": (2, 4.0, "q|k|v|o|up|down", 2)}  # rank, alpha, target, seed
WIDTH = 16  # The full forward's padded length (causal: padding after a token never changes its logits).
# A site's weight among its layer's parameters (`kernel_state/<site>` sits beside it).
WEIGHT = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "dot": "weight"}


def _numpy(tree):
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


def _randomized(adapters, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(0.0, 0.3, tuple(x.shape)).astype(np.float32), adapters)


def _lora_run(root, base_params, name, rank, alpha, target, seed):
    exp = load_experiment(None, [*TINY_OVERRIDES, "plugins=[lora]", f"lora.rank={rank}", f"lora.alpha={alpha}",
                                 f"lora.target={target}", f"trainer.run_dir={root / name}"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    adapters = _randomized(split_params(model.parameter_specs())[0], seed)
    save_model(exp, merge_params(adapters, base_params), root / name)
    return adapters


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, base params, {name: (adapter tree, alpha / rank)}): the base run and the LoRA runs under root."""
    root = tmp_path_factory.mktemp("engine_lora")
    exp = load_experiment(None, [*TINY_OVERRIDES, f"trainer.run_dir={root / 'base'}"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = _numpy(jax.jit(model.initialize)(jax.random.key(7)))
    save_model(exp, params, root / "base")
    adapters = {name: (_lora_run(root, params, name, rank, alpha, target, seed), alpha / rank)
                for name, (rank, alpha, target, seed) in ADAPTERS.items()}
    return root, params, adapters


@pytest.fixture(scope="module")
def engine(runs):
    root = runs[0]
    engine = load_engine(str(root / "base"), config=CONFIG, adapters={n: str(root / n) for n in ADAPTERS})
    yield engine
    engine.close()


def merged(params, adapters, scale):
    """NumPy: every adapted site's weight plus `scale * A @ B`, in the weight's `[in, out]` layout."""
    params = _numpy(params)

    def walk(node, tree):
        for key, value in tree.items():
            if key == "kernel_state":
                for site, pair in value.items():
                    w = node[WEIGHT[site]]
                    a, b = pair["lora_a"], pair["lora_b"]
                    delta = np.float32(scale) * (a @ b.reshape(a.shape[1], -1))
                    node[WEIGHT[site]] = (w.reshape(a.shape[0], -1) + delta).reshape(w.shape)
            else:
                walk(node[key], value)

    walk(params, adapters)
    return params


@pytest.fixture(scope="module")
def forward(engine):
    """`forward(model, params, ids)`: float32 logits `[len(ids), vocab]` of the full forward (no cache)."""
    programs = {}

    def run(model, params, ids):
        if id(model) not in programs:
            programs[id(model)] = jax.jit(lambda p, x: axcore.functional(model, p, (x,), None, False,
                                                                         method="logits")[0].astype(jnp.float32))
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(ids)] = ids
        return np.asarray(programs[id(model)](params, padded))[0, : len(ids)]

    return run


def log_softmax(logits):
    x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(forward, model, params, ids, count):
    """`(tokens, their log-probabilities)`: greedy by the full forward, one token at a time."""
    ids, lps = list(ids), []
    for _ in range(count):
        row = log_softmax(forward(model, params, ids)[-1])
        ids.append(int(np.argmax(row)))
        lps.append(row[ids[-1]])
    return ids[len(ids) - count:], lps


def prompt(seed, length):
    return np.random.default_rng(seed).integers(1, 256, size=length).tolist()


@pytest.mark.slow  # Builds three runs and compiles the engine's programs.
def test_rows_of_two_adapters_and_the_base_in_one_call_each_equal_their_merged_model(runs, engine, forward):
    """Base, a1, a2, a1 in one batch: every row's greedy tokens are its merged model's, log-probabilities within
    1e-4, the base row the base model's; at least one model call held all three slots."""
    _, params, adapters = runs
    base_model = load_model(runs[0] / "base").model
    slots_seen = []
    step = engine.runner.step

    def recording(*args, adapters=None, **kwargs):
        slots_seen.append(set(adapters.tolist()))
        return step(*args, adapters=adapters, **kwargs)

    engine.runner.step = recording
    try:
        chosen = [None, "a1", "a2", "a1"]
        prompts = [prompt(k, 5 + k) for k in range(4)]
        requests = [GenerationRequest(f"mix{k}", p, SamplingParams(max_tokens=6, **GREEDY), a)
                    for k, (p, a) in enumerate(zip(prompts, chosen))]
        outputs = engine.generate(requests)
    finally:
        engine.runner.step = step
    assert any(seen >= {0, 1, 2} for seen in slots_seen)
    for p, name, out in zip(prompts, chosen, outputs):
        weights = params if name is None else merged(params, *adapters[name])
        tokens, lps = reference(forward, base_model, weights, p, 6)
        assert out.choices[0].token_ids == tokens, name
        np.testing.assert_allclose(out.choices[0].logprobs, lps, atol=1e-4, err_msg=str(name))
    base_tokens = reference(forward, base_model, params, prompts[1], 6)[0]
    assert outputs[1].choices[0].token_ids != base_tokens  # The adapter changes the answer: the test can fail.
    assert engine.stats().kv_blocks_used == 0


def test_an_unknown_adapter_is_refused_naming_model(engine):
    assert engine.model_names() == ["base", "a1", "a2"]
    with pytest.raises(SamplingParamsError, match="no adapter 'a3': this engine serves 'base', 'a1', 'a2'") as e:
        engine.add_request(GenerationRequest("x", [1, 2], SamplingParams(max_tokens=1), "a3"))
    assert e.value.field == "model" and not engine.has_unfinished()


@pytest.mark.slow  # A live server over the engine.
def test_the_openai_client_selects_an_adapter_by_model_name(runs, engine, forward):
    _, params, adapters = runs
    base_model = load_model(runs[0] / "base").model
    ids = prompt(11, 6)
    expected = {name: engine.tokenizer.decode(reference(forward, base_model, weights, ids, 5)[0])
                for name, weights in [("base", params), ("a2", merged(params, *adapters["a2"]))]}
    assert expected["base"] != expected["a2"]
    with LiveServer(engine, TextFrontend(engine.tokenizer, None, vocab_size=256)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        listed = [m.id for m in client.models.list().data]
        answers = {name: client.completions.create(model=name, prompt=ids, max_tokens=5, temperature=0)
                   for name in expected}
        with pytest.raises(openai.NotFoundError, match="a3"):
            client.completions.create(model="a3", prompt=ids, max_tokens=5)
    assert listed == ["base", "a1", "a2"]
    assert {name: a.choices[0].text for name, a in answers.items()} == expected
    engine.close()


@pytest.mark.slow  # Two more runs, the plugin's merge and another engine.
def test_a_qlora_int8_adapter_equals_its_merge_and_base_rows_the_quantized_base(runs, forward, tmp_path):
    """A LoRA run on an int8 base (`lora init --base-format int8`, adapters randomized): its rows equal the plugin's
    merge (dequantized base + adapter), base rows of the same engine the merge of the fresh (B = 0) run, and the
    QLoRA run served on its own (no adapters resident) its merge too."""
    root, params, _ = runs
    peft.init(root / "base", tmp_path / "fresh", {"rank": 4, "alpha": 8.0, "target": "q|v", "base_format": "int8"})
    fresh = load_model(tmp_path / "fresh")
    adapters, frozen = split_params(_numpy(fresh.params))
    save_model(fresh.experiment, merge_params(_randomized(adapters, 3), frozen), tmp_path / "q8")
    engine = load_engine(str(root / "base"), config=CONFIG, adapters={"q8": str(tmp_path / "q8")})
    ids = [prompt(20, 7), prompt(21, 5)]
    outs = engine.generate([GenerationRequest(f"q{k}", p, SamplingParams(max_tokens=5, **GREEDY), a)
                            for k, (p, a) in enumerate(zip(ids, ["q8", None]))])
    engine.close()
    alone = load_engine(str(tmp_path / "q8"), config=CONFIG)  # The QLoRA run served on its own: its adapter.
    (own,) = alone.generate([GenerationRequest("own", ids[0], SamplingParams(max_tokens=5, **GREEDY))])
    alone.close()
    for k, run in enumerate(["q8", "fresh"]):
        peft.merge(tmp_path / run, tmp_path / f"{run}_merged")
        plain = load_model(tmp_path / f"{run}_merged")
        tokens, lps = reference(forward, plain.model, plain.params, ids[k], 5)
        assert outs[k].choices[0].token_ids == tokens, run
        np.testing.assert_allclose(outs[k].choices[0].logprobs, lps, atol=1e-4, err_msg=run)
        if run == "q8":
            assert own.choices[0].token_ids == tokens
            np.testing.assert_allclose(own.choices[0].logprobs, lps, atol=1e-4)
    assert outs[0].choices[0].token_ids != reference(forward, plain.model, plain.params, ids[0], 5)[0]


def test_runs_that_are_no_adapters_of_this_base_are_refused(runs, tmp_path):
    root, params, _ = runs
    with pytest.raises(AdapterLoadError, match="none of these runs uses a plugin that serves adapters"):
        load_engine(str(root / "base"), config=CONFIG, adapters={"plain": str(root / "base")})
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterLoadError, match="a PEFT adapter directory, not a run; import it"):
        load_engine(str(root / "base"), config=CONFIG, adapters={"p": str(tmp_path / "peft")})
    other = jax.tree.map(lambda x: x + np.float32(0.01), params)
    _lora_run(tmp_path, other, "elsewhere", 2, 2.0, "q", 5)
    with pytest.raises(lora.LoraConfigError, match="its frozen weights differ from base run"):
        load_engine(str(root / "base"), config=CONFIG, adapters={"e": str(tmp_path / "elsewhere")})


def test_axcore_serve_loads_each_lora_flag_as_a_model(runs):
    """`axcore serve BASE --lora NAME=PATH ...` builds the engine with those adapters, in flag order."""
    from axcore.cli.serve import build_engine

    root = runs[0]
    args = argparse.Namespace(step=None, overrides=[], objects=None, served_model_name="tiny",
                              adapters=[f"second={root / 'a2'}", f"first={root / 'a1'}"])
    engine = build_engine(str(root / "base"), args)
    assert engine.model_names() == ["tiny", "second", "first"]
    assert engine.adapter_slots == {"second": 1, "first": 2}
    np.testing.assert_array_equal(engine.params["decoder"]["layer0"]["self_attention"]["kernel_state"]["q_proj"]
                                  ["lora_scale"], [0.0, 4.0 / 2, 8.0 / 4])
