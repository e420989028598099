"""Offline generation on the engine (`axcore.engine.offline`, what `axcore generate`, the end-of-run
sample and lm-eval's `generate_until` run) against an independent greedy loop over full forwards."""

import jax
import numpy as np
import pytest

from axcore.engine.config import block_bytes
from axcore.engine.engine import Engine
from axcore.engine.offline import offline_config, run_requests
from axcore.engine.requests import GenerationRequest, SamplingParams, SamplingParamsError
from axcore.experiment import load_experiment
from axcore.module import functional

SMALL = [
    "plugins=[rope, swiglu]",
    "model.dim=32",
    "model.num_layers=2",
    "model.decoder.layer.self_attention.num_heads=4",
    "model.decoder.layer.self_attention.num_kv_heads=2",
    "model.decoder.layer.feed_forward.hidden_dim=48",
    "input.seq_len=16",
    "model.compute_dtype=float32",  # Also on a GPU, whose mesh rules would switch compute to bfloat16.
]


@pytest.fixture(scope="module")
def model_and_params():
    exp = load_experiment(None, SMALL)
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = jax.jit(model.initialize)(jax.random.key(4))
    # Sharper logits than at init, so greedy choices are not near-ties.
    params = jax.tree.map(lambda p: p * 3.0 if p.ndim > 1 else p, params)
    return model, params


_LOGITS = {}


def _greedy_by_full_forward(model, params, prompt, num_new, stops=(), width=32):
    """The reference: re-run the whole sequence for every new token (no cache), argmax. The
    model is causal, so a fixed-width buffer (one compilation) gives the same logits."""
    if id(model) not in _LOGITS:
        _LOGITS[id(model)] = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])
    logits, tokens, out = _LOGITS[id(model)], list(prompt), []
    for _ in range(num_new):
        buffer = np.zeros((1, width), np.int32)
        buffer[0, : len(tokens)] = tokens
        token = int(np.argmax(np.asarray(logits(params, buffer))[0, len(tokens) - 1]))
        out.append(token)
        tokens.append(token)
        if token in stops:
            break
    return out


def _run(model, params, prompts, num_new, progress=None, **sampling):
    engine = Engine(model, params, config=offline_config(model, [len(p) for p in prompts], num_new, max_seqs=2))
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=num_new, temperature=0.0, **sampling))
                for i, p in enumerate(prompts)]
    return engine, [out.choices[0].token_ids for out in run_requests(engine, requests, progress)]


def test_greedy_prompts_of_different_lengths_match_full_forward_reruns_and_progress_counts_them(model_and_params):
    """Four prompts on two rows: two wait and join the running batch as the first ones finish."""
    model, params = model_and_params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 7, 3, 18)]
    seen = []
    engine, generated = _run(model, params, prompts, 6, progress=lambda done, total: seen.append((done, total)))
    for prompt, tokens in zip(prompts, generated):
        assert tokens == _greedy_by_full_forward(model, params, prompt, 6)
    assert seen[-1] == (4, 4) and [d for d, _ in seen] == sorted({d for d, _ in seen})
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_stop_tokens_end_each_sequence_where_they_come(model_and_params):
    model, params = model_and_params
    prompts = [[5, 6, 7], [100]]
    _, free = _run(model, params, prompts, 8)
    stop = free[0][2]  # The third token of the first sequence becomes a stop token.
    _, stopped = _run(model, params, prompts, 8, stop_token_ids=[stop])
    for prompt, tokens in zip(prompts, stopped):
        assert tokens == _greedy_by_full_forward(model, params, prompt, 8, stops={stop})
    assert stopped[0] == free[0][: free[0].index(stop) + 1]


def test_the_cache_holds_the_longest_sequences_that_run_at_once_within_the_byte_budget(model_and_params):
    model, _ = model_and_params
    # Blocks of 16 tokens: (40 + 8) -> 3, (3 + 8) -> 1, (20 + 8) -> 2; two rows hold the 3 and the 2, plus the null block.
    config = offline_config(model, [40, 3, 20], 8, max_seqs=2, seed=5)
    assert (config.num_blocks, config.max_seqs, config.seed) == (1 + 3 + 2, 2, 5)
    assert offline_config(model, [3], 8).max_seqs == 1
    small = offline_config(model, [40, 3, 20], 8, max_cache_bytes=4 * block_bytes(model, 16))
    assert small.num_blocks is None and small.kv_cache_bytes == 4 * block_bytes(model, 16)


def test_a_refused_request_leaves_none_of_its_batch_running(model_and_params):
    model, params = model_and_params
    engine = Engine(model, params, config=offline_config(model, [3], 4))
    vocab = int(model.config.vocab_size)
    requests = [GenerationRequest("ok", [1, 2, 3], SamplingParams(max_tokens=4)),
                GenerationRequest("bad", [1, vocab], SamplingParams(max_tokens=4))]
    with pytest.raises(SamplingParamsError, match="'prompt'"):
        run_requests(engine, requests)
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_a_prompt_near_the_learned_position_limit_pads_no_step_past_it():
    """20 learned positions: a 17-token prompt would pad to the 64-token bucket; the default buckets stop at
    the model's length (16, 20), and 3 new tokens still fit (17 + 3 = 20)."""
    exp = load_experiment(None, [*SMALL[1:], "model.position_embedding.max_len=20"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = jax.jit(model.initialize)(jax.random.key(5))
    prompt = (np.arange(17) * 5).tolist()
    engine, [tokens] = _run(model, params, [prompt], 3)
    assert engine.settings.token_buckets == (1, 16, 20)
    assert tokens == _greedy_by_full_forward(model, params, prompt, 3, width=20)
    with pytest.raises(SamplingParamsError, match="'max_tokens'"):
        _run(model, params, [prompt], 4)
