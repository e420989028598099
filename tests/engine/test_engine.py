"""`axcore.engine.Engine` on a tiny random Hugging Face Llama imported without downloads (`axcore_hf`).

References are independent of the engine: transformers' greedy `generate` on the same
weights, and axcore's full forward (`logits` over the whole sequence, no cache) for
log-probabilities and for parameters transformers does not hold. One engine (a small
cache: 12 blocks of 4 tokens, so several long sequences preempt each other) serves the
module, its steps split into calls (`split_mixed_steps`); a second with ragged steps (one
token per row) runs the equivalence scenarios too. Counters are compared before and after
each scenario.
"""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from live_server import LiveServer

import axcore
from axcore.engine import EngineConfig, EngineError
from axcore.engine.config import block_bytes, resolve
from axcore.engine.requests import GenerationRequest, SamplingParams, SamplingParamsError
from axcore.errors import ConfigError
from axcore.inference.run_loading import load_engine
from axcore.serving import TextFrontend

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
hf_testing = pytest.importorskip("axcore_hf.testing")

VOCAB = 256  # The run's byte tokenizer has 256 ids.
CONFIG = EngineConfig(block_size=4, num_blocks=13, max_seqs=4, max_tokens_per_step=16, batch_buckets=(4,),
                      token_buckets=(16,), ragged_steps=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, imported run directory) of a 2-layer Llama with GQA, vocabulary 256."""
    root = tmp_path_factory.mktemp("tiny")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = hf_testing.build(config)
    model.generation_config.eos_token_id = None  # Greedy to the length asked, as the engine with ignore_eos.
    model.save_pretrained(root / "hf")
    hf_testing.hf_to_axcore(root / "hf", root / "run", seq_len=32)
    return model, root / "run"


@pytest.fixture(scope="module")
def engine(tiny):
    engine = load_engine(str(tiny[1]), config=CONFIG)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ragged_engine(tiny):
    """The same cache and budget, each step one call of one token per row."""
    engine = load_engine(str(tiny[1]), config=dataclasses.replace(CONFIG, ragged_steps=True, ragged_buckets=(16,)))
    yield engine
    engine.close()


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=length).tolist()


def hf_greedy(model, ids, count: int) -> list[int]:
    """transformers' greedy continuation of `ids` by `count` tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


WIDTH = 64  # Sequences the full forward references pad to (causal: padding after a token never changes its logits).


@pytest.fixture(scope="module")
def forward(engine):
    """`forward(params, ids)`: float32 logits of axcore's full forward over `ids` (no cache): [len(ids), vocab].

    One compiled program: `ids` are padded to WIDTH."""
    jitted = jax.jit(lambda params, ids: axcore.functional(engine.model, params, (ids,), None, False,
                                                           method="logits")[0].astype(jnp.float32))

    def run(params, ids):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, : len(ids)] = ids
        return np.asarray(jitted(params, padded))[0, : len(ids)]

    return run


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """NumPy log_softmax over the last axis, in float64."""
    x = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def full_greedy(forward, params, ids, count: int) -> list[int]:
    """Greedy continuation by axcore's full forward, one token at a time."""
    ids = list(ids)
    for _ in range(count):
        ids.append(int(np.argmax(forward(params, ids)[-1])))
    return ids[len(ids) - count:]


def run_until_done(engine, requests, steps_between=()):
    """Adds `requests[k]` after `steps_between[k - 1]` more steps (all at once without), then steps to the end."""
    finals = {}

    def sink_for(rid):
        return lambda out: finals.__setitem__(rid, out)

    for k, request in enumerate(requests):
        if k and k - 1 < len(steps_between):
            for _ in range(steps_between[k - 1]):
                engine.step()
        engine.add_request(request, sink_for(request.request_id))
    while any(not (r.request_id in finals and finals[r.request_id].finished) for r in requests):
        engine.step()
    return [finals[r.request_id] for r in requests]


@pytest.mark.slow  # Compiles the engine's programs (about 10-30 s on 2 loaded cores).
@pytest.mark.parametrize("which", ["engine", "ragged_engine"])
def test_greedy_outputs_equal_transformers_generate(which, tiny, request):
    """Mixed prompt lengths, requests joining mid-flight, a shared prefix found in the prefix cache, n = 3 at
    temperature 0, and preemptions on the small cache: every choice is transformers' greedy continuation."""
    engine, model = request.getfixturevalue(which), tiny[0]
    shared = prompt(9, 13)
    prompts = [prompt(1, 3), prompt(2, 14), prompt(3, 9), shared + [5, 6], shared + [7]]
    before = engine.stats()
    requests = [GenerationRequest(f"greedy{k}", p, SamplingParams(max_tokens=10, n=3 if k == 2 else 1, **GREEDY))
                for k, p in enumerate(prompts)]
    outputs = run_until_done(engine, requests, steps_between=(2, 1, 0, 3))
    after = engine.stats()
    for p, out in zip(prompts, outputs):
        expected = hf_greedy(model, p, 10)
        assert [c.token_ids for c in out.choices] == [expected] * len(out.choices)
        assert all(c.finish_reason == "length" for c in out.choices)
        assert [c.text for c in out.choices] == [engine.tokenizer.decode(expected)] * len(out.choices)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 3  # The shared 12-token prefix, 3 blocks.
    assert after.preemptions > before.preemptions
    assert (after.kv_blocks_used, after.running, after.waiting) == (0, 0, 0)


@pytest.mark.slow  # Compiles the engine's programs (about 10-30 s on 2 loaded cores).
def test_decodes_beside_a_prefill_chunk_run_as_their_own_model_call(engine, tiny, monkeypatch):
    """A step with decode rows and a prompt chunk makes two calls, one token per decode row (packed as one
    [B, T] call, each decode row would pad to the chunk's 14 tokens); tokens stay transformers' greedy ones."""
    calls = []
    step = engine.runner.step

    def spy(params, tokens, positions, num_new, *args, **kwargs):
        calls.append(sorted(num_new.tolist()))
        return step(params, tokens, positions, num_new, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", spy)
    prompts = [prompt(31, 3), prompt(32, 2), prompt(33, 14)]
    requests = [GenerationRequest(f"split{k}", p, SamplingParams(max_tokens=6, **GREEDY)) for k, p in enumerate(prompts)]
    outputs = run_until_done(engine, requests, steps_between=(0, 2))
    for p, out in zip(prompts, outputs):
        assert out.choices[0].token_ids == hf_greedy(tiny[0], p, 6)
    assert [2, 3] in calls  # The two short prompts, prefilled together.
    assert [14] in calls and calls[calls.index([14]) - 1] == [1, 1]  # Their decodes, then the chunk: one step.
    assert all(kinds == [1] * len(kinds) or 1 not in kinds for kinds in calls)


@pytest.mark.slow  # Compiles the engine's programs (about 10-30 s on 2 loaded cores).
@pytest.mark.parametrize("which", ["engine", "ragged_engine"])
def test_logprobs_equal_the_full_forward(which, forward, request):
    """Sampled tokens' log-probabilities, their top 5, and the prompt's, within 1e-4 of log_softmax of the
    full forward's logits over the prompt and the output (a ragged engine computes the prompt's step
    unragged: it needs every token's logits)."""
    engine, ids = request.getfixturevalue(which), prompt(4, 11)
    params = SamplingParams(max_tokens=5, logprobs=5, prompt_logprobs=2, **GREEDY)
    (out,) = engine.generate([GenerationRequest("lp", ids, params)])
    choice = out.choices[0]
    reference = log_softmax(forward(engine.params, ids + choice.token_ids))
    for j, token in enumerate(choice.token_ids):
        row = reference[len(ids) + j - 1]
        assert token == int(np.argmax(row))
        assert abs(choice.logprobs[j] - row[token]) < 1e-4
        top = np.argsort(-row, kind="stable")[:5]
        assert list(choice.top_logprobs[j]) == top.tolist()
        np.testing.assert_allclose(list(choice.top_logprobs[j].values()), row[top], atol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    np.testing.assert_allclose(out.prompt_logprobs[1:], reference[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)


@pytest.mark.slow  # Compiles the engine's programs (about 10-30 s on 2 loaded cores).
def test_a_ragged_step_is_one_call_of_its_tokens_with_logits_for_its_sequences(ragged_engine, forward, monkeypatch):
    """Decodes beside prompt chunks: every step is one call, a row per token (prefill chunks on consecutive
    rows of their sequence's table), logits asked for each sequence's last row only; the sampled tokens'
    log-probabilities stay within 1e-4 of the full forward's."""
    engine, calls = ragged_engine, []
    step = engine.runner.step

    def spy(params, tokens, positions, num_new, tables, **kwargs):
        calls.append((tokens.shape, num_new.tolist(), positions[:, 0].tolist(), kwargs["logit_rows"].tolist()))
        return step(params, tokens, positions, num_new, tables, **kwargs)

    monkeypatch.setattr(engine.runner, "step", spy)
    prompts = [prompt(41, 3), prompt(42, 2), prompt(43, 14)]
    requests = [GenerationRequest(f"ragged{k}", p, SamplingParams(max_tokens=6, logprobs=0, **GREEDY))
                for k, p in enumerate(prompts)]
    outputs = run_until_done(engine, requests, steps_between=(0, 2))
    assert calls[0] == ((5, 1), [1] * 5, [0, 1, 2, 0, 1], [2, 4])  # Both short prompts, one row per token.
    mixed = [c for c in calls if len(c[3]) == 3]  # Two decodes and the long prompt's chunk in one call.
    assert mixed and mixed[0][0] == (16, 1) and mixed[0][2][2:] == list(range(14)) and mixed[0][3] == [0, 1, 15]
    for p, out in zip(prompts, outputs):
        tokens = out.choices[0].token_ids
        reference = log_softmax(forward(engine.params, p + tokens))
        assert tokens == [int(np.argmax(reference[len(p) + j - 1])) for j in range(6)]
        np.testing.assert_allclose(out.choices[0].logprobs, reference[len(p) - 1 + np.arange(6), tokens], atol=1e-4)
    assert engine.stats().kv_blocks_used == 0


def test_precompiling_compiles_each_ragged_row_bucket_once_and_steps_then_compile_nothing(tiny, engine):
    """`Engine.precompile` compiles one program per ragged row bucket (none for an engine without ragged steps);
    requests afterwards run on those programs and give the tokens of an engine that compiled as it went."""
    assert engine.precompile() == []  # CONFIG: ragged_steps False.
    fresh = load_engine(str(tiny[1]), config=dataclasses.replace(CONFIG, ragged_steps=True, ragged_buckets=(4, 8, 16)))
    try:
        keys = fresh.precompile()
        width = fresh.runner.ragged_table_buckets[0]
        assert keys == [(4, 1, width, False, 4), (8, 1, width, False, 4), (16, 1, width, False, 4)]
        assert fresh.runner.programs == keys and fresh.precompile() == []  # Already compiled: nothing new.
        requests = [GenerationRequest(f"pre{k}", prompt(50 + k, 3 + 2 * k), SamplingParams(max_tokens=4, **GREEDY))
                    for k in range(3)]
        outputs = fresh.generate(requests)
        assert fresh.runner.programs == keys  # Every step found its program.
        assert [o.choices[0].token_ids for o in outputs] == [o.choices[0].token_ids for o in engine.generate(requests)]
    finally:
        fresh.close()


def test_a_seed_draws_the_same_tokens_alone_and_in_a_batch(engine):
    ids = prompt(5, 6)

    def seeded(rid, seed):
        return GenerationRequest(rid, ids, SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True))

    (alone,) = engine.generate([seeded("alone", 7)])
    others = [GenerationRequest(f"other{k}", prompt(10 + k, 5 + 3 * k), SamplingParams(max_tokens=6, temperature=0.8))
              for k in range(2)]
    batched = run_until_done(engine, [others[0], seeded("batched", 7), others[1]], steps_between=(1, 0))[1]
    (other_seed,) = engine.generate([seeded("other-seed", 8)])
    assert batched.choices[0].token_ids == alone.choices[0].token_ids
    assert other_seed.choices[0].token_ids != alone.choices[0].token_ids


def test_closing_a_stream_early_aborts_its_request(engine):
    request = GenerationRequest("streamed", prompt(6, 7), SamplingParams(max_tokens=40, **GREEDY))

    async def first_then_close():
        stream = engine.stream(request)
        first = await anext(stream)
        held = engine.stats().kv_blocks_used
        await stream.aclose()
        return first, held

    first, held = asyncio.run(first_then_close())
    assert len(first.choices[0].token_ids) >= 1 and not first.finished and held > 0
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    assert not engine.abort("streamed")  # No longer live.
    engine.close()  # The stream's background thread stops: the tests after this one step by hand.


def test_a_failing_step_reaches_the_stream_and_frees_its_request(engine, monkeypatch):
    """The background thread hands a step's error to every live stream (which raises it) and ends its requests."""

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "step", broken)

    async def consume():
        return [out async for out in engine.stream(GenerationRequest("doomed", prompt(12, 5), SamplingParams()))]

    with pytest.raises(RuntimeError, match="device lost"):
        asyncio.run(consume())
    engine.close()
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_update_weights_mid_run_recomputes_on_the_new_parameters(engine, forward):
    old = engine.params
    new = jax.tree.map(lambda x: jax.device_put(jnp.flip(x, 0), x.sharding), old)
    ids = prompt(7, 10)
    try:
        seen = []
        engine.add_request(GenerationRequest("update", ids, SamplingParams(max_tokens=8, **GREEDY)), seen.append)
        while not seen or len(seen[-1].choices[0].token_ids) < 3:
            engine.step()
        engine.update_weights(new)
        while not seen[-1].finished:
            engine.step()
        tokens = seen[-1].choices[0].token_ids
        done = 3  # Tokens sampled before the update (a step adds one; the loop stopped at the first output with 3).
        assert tokens[:done] == full_greedy(forward, old, ids, done)
        assert tokens[done:] == full_greedy(forward, new, ids + tokens[:done], 8 - done)
        # The prompt's blocks cached under the old weights are not reused: a fresh request sees the new ones.
        (again,) = engine.generate([GenerationRequest("again", ids, SamplingParams(max_tokens=4, **GREEDY))])
        assert again.choices[0].token_ids == full_greedy(forward, new, ids, 4) != full_greedy(forward, old, ids, 4)
        with pytest.raises(EngineError, match="structure"):
            engine.update_weights({"not": jnp.zeros(2)})
    finally:
        engine.update_weights(old)


def test_update_weights_takes_a_jitted_update_of_restored_parameters(engine, forward):
    # Restored leaves carry NamedSharding P(None, None); a jitted update returns the equivalent P(), which
    # update_weights refused (so GRPO's first update on a run directory failed).
    old = engine.params
    new = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.5, p))(old)
    assert any(a.sharding != b.sharding for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)))
    ids = prompt(8, 9)
    try:
        engine.update_weights(new)
        (out,) = engine.generate([GenerationRequest("halved", ids, SamplingParams(max_tokens=3, **GREEDY))])
        assert out.choices[0].token_ids == full_greedy(forward, new, ids, 3)
    finally:
        engine.update_weights(old)


def test_the_server_over_the_engine_answers_the_openai_client(engine, tiny):
    """`axcore serve`'s app over the real engine: a completion and a streamed one, both transformers' greedy text."""
    expected = engine.tokenizer.decode(hf_greedy(tiny[0], list(b"Hello"), 6))
    with LiveServer(engine, TextFrontend(engine.tokenizer, None, vocab_size=VOCAB)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model=engine.name, prompt="Hello", max_tokens=6, temperature=0)
        chunks = list(client.completions.create(model=engine.name, prompt="Hello", max_tokens=6, temperature=0,
                                                stream=True))
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (5, 6)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    engine.close()
    assert engine.stats().kv_blocks_used == 0


def test_stop_tokens_and_stop_strings_end_a_choice(engine, tiny):
    ids = prompt(8, 6)
    greedy = hf_greedy(tiny[0], ids, 10)
    text = engine.tokenizer.decode(greedy)
    stop = next(ch for ch in text[1:] if ch != "\ufffd")
    requests = [GenerationRequest("stop-token", ids, SamplingParams(max_tokens=10, stop_token_ids=(greedy[3],),
                                                                    **GREEDY)),
                GenerationRequest("stop-string", ids, SamplingParams(max_tokens=10, stop=(stop,), **GREEDY))]
    by_token, by_string = (out.choices[0] for out in engine.generate(requests))
    first = greedy.index(greedy[3])  # The stop token's first occurrence ends the choice (it is kept, not decoded).
    assert (by_token.token_ids, by_token.text, by_token.finish_reason) == (
        greedy[: first + 1], engine.tokenizer.decode(greedy[:first]), "stop")
    assert (by_string.text, by_string.finish_reason) == (text[: text.index(stop)], "stop")
    assert by_string.token_ids == greedy[: len(by_string.token_ids)]
    assert engine.tokenizer.decode(by_string.token_ids).startswith(by_string.text)
    assert not engine.tokenizer.decode(by_string.token_ids[:-1]).count(stop)


@pytest.mark.slow  # Compiles the engine's programs (about 10-30 s on 2 loaded cores).
def test_penalties_follow_their_rules_on_the_full_forward(engine, forward):
    """Greedy with repetition 0.3 (prompt and output tokens: l / 0.3 if l > 0 else l * 0.3: seen tokens favoured),
    then frequency 1.5 per
    earlier output occurrence and presence 0.5 per output token seen: the argmax of those on the full forward."""
    ids = prompt(11, 5)
    params = SamplingParams(max_tokens=8, repetition_penalty=0.3, frequency_penalty=1.5, presence_penalty=0.5,
                            **GREEDY)
    (out,) = engine.generate([GenerationRequest("penalised", ids, params)])
    tokens = []
    for _ in range(8):
        logits = forward(engine.params, ids + tokens)[-1].astype(np.float64)
        seen = np.isin(np.arange(VOCAB), ids + tokens)
        logits = np.where(seen, np.where(logits > 0, logits / 0.3, logits * 0.3), logits)
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=VOCAB)
        tokens.append(int(np.argmax(logits - 1.5 * counts - 0.5 * (counts > 0))))
    assert out.choices[0].token_ids == tokens
    assert tokens != full_greedy(forward, engine.params, ids, 8)  # The penalties changed something.


@pytest.mark.parametrize("request_, field", [
    (GenerationRequest("adapter", (1, 2), adapter="lora"), "model"),
    (GenerationRequest("vocab", (1, VOCAB)), "prompt"),
    (GenerationRequest("long", tuple(range(1, 40)), SamplingParams(max_tokens=10)), "max_tokens"),
], ids=["adapter", "vocab", "too-long"])
def test_requests_the_engine_cannot_serve_are_refused_naming_the_field(engine, request_, field):
    with pytest.raises(SamplingParamsError) as error:
        engine.add_request(request_)
    assert error.value.field == field and not engine.has_unfinished()
    with pytest.raises(SamplingParamsError):  # generate takes all its requests or none.
        engine.generate([GenerationRequest("fine", (1, 2), SamplingParams(**GREEDY)), request_])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("changes, field", [
    ({"max_seqs": 8, "batch_buckets": (4,)}, "batch_buckets"),
    ({"max_tokens_per_step": 32}, "token_buckets"),
    ({"num_blocks": None, "kv_cache_bytes": 100}, "kv_cache_bytes"),
    ({"block_size": 0}, "block_size"),
], ids=["batch", "tokens", "budget", "block-size"])
def test_engine_settings_that_cannot_work_are_refused(engine, changes, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        resolve(engine.model, dataclasses.replace(CONFIG, **changes))


def test_a_kv_budget_sizes_the_cache_from_the_layers(engine):
    """2 layers x (key + value) x 2 kv heads x head dim 8 x float32 = 256 bytes per token."""
    assert block_bytes(engine.model, 4) == 2 * 2 * 2 * 8 * 4 * 4
    assert resolve(engine.model, dataclasses.replace(CONFIG, num_blocks=None, kv_cache_bytes=10 * 1024)).num_blocks == 10


@pytest.mark.slow  # Compiles the engine's programs with every token's logits (about 10-30 s on 2 loaded cores).
def test_prompt_top_n_across_chunked_prefill_skips_the_prefix_cache(engine, forward):
    """A 30-token prompt (two chunks of at most 16) whose blocks an earlier request left in the prefix cache:
    a request asking its prompt's log-probabilities computes every position again (no cache hit), and each
    position's log-probability and top 3 equal log_softmax of the full forward's logits within 1e-4."""
    ids = prompt(13, 30)
    engine.generate([GenerationRequest("warm", ids, SamplingParams(max_tokens=1, **GREEDY))])
    before = engine.stats()
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    (out,) = engine.generate([GenerationRequest("scored", ids, params)])
    after = engine.stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # Its prompt was computed, not found.
    assert after.prompt_tokens - before.prompt_tokens == len(ids)
    reference = log_softmax(forward(engine.params, ids))
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], reference[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    for p in range(1, len(ids)):
        row = reference[p - 1]
        top = np.argsort(-row, kind="stable")[:3]
        assert list(out.prompt_top_logprobs[p]) == top.tolist()
        np.testing.assert_allclose(list(out.prompt_top_logprobs[p].values()), row[top], atol=1e-4)
    assert out.choices[0].token_ids == full_greedy(forward, engine.params, ids, 2)
