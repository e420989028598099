"""The `openai` client against `axcore serve`'s app over the REAL engine: a tiny random Llama imported offline.

Every answer is checked against the same engine's result for the same request ALONE (`Engine.generate`, no
server, nothing else running), and log-probabilities against NumPy's log_softmax of axcore's full forward
(no cache). One engine serves the module; its cache holds no live block after each test.
"""

import uuid

import jax.numpy as jnp
import numpy as np
import pytest

import axcore
from axcore.data.chat import ChatTemplate
from axcore.engine import EngineConfig
from axcore.engine.requests import GenerationRequest, SamplingParams
from axcore.inference import load_engine
from axcore.serving import TextFrontend

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("torch")
pytest.importorskip("axcore_hf")

from live_server import LiveServer  # noqa: E402
from tiny_llama import VOCAB, tiny_llama_run  # noqa: E402

pytestmark = pytest.mark.slow  # Compiles the engine's programs (about 20-40 s on 2 loaded cores for the module).

# Replies end at "QRS" (the template's end-of-turn marker).
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ':' + m['content'] + 'QRS\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
# One batch and one token bucket: few compiled programs (table widths 1, 2, 4; with and without all logits).
CONFIG = EngineConfig(block_size=16, num_blocks=32, max_seqs=4, max_tokens_per_step=32, max_model_len=64,
                      batch_buckets=(4,), token_buckets=(32,))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    _, run = tiny_llama_run(tmp_path_factory.mktemp("served"))
    engine = load_engine(str(run), config=CONFIG)
    frontend = TextFrontend(engine.tokenizer, ChatTemplate(TEMPLATE, name="test"), vocab_size=VOCAB)
    with LiveServer(engine, frontend) as server:
        yield server
    engine.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def no_block_left(live):
    yield
    assert live.engine.stats().kv_blocks_used == 0 and not live.engine.has_unfinished()


def alone(engine, ids, **params):
    """The engine's choices for one request run by itself (no server)."""
    (out,) = engine.generate([GenerationRequest(f"alone-{uuid.uuid4().hex}", tuple(ids), SamplingParams(**params))])
    return out.choices


def test_completion_and_its_stream_equal_the_engine_alone(live, client):
    engine = live.engine
    (expected,) = alone(engine, engine.tokenizer.encode("Hello there"), max_tokens=8, temperature=0.0)
    answer = client.completions.create(model=engine.name, prompt="Hello there", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=engine.name, prompt="Hello there", max_tokens=8, temperature=0,
                                            stream=True))
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert answer.usage.completion_tokens == len(expected.token_ids) == 8
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_n_2_seeded_draws_equal_the_engine_alone(live, client):
    engine = live.engine
    expected = alone(engine, engine.tokenizer.encode("Once"), n=2, max_tokens=10, temperature=1.0, seed=11)
    answer = client.completions.create(model=engine.name, prompt="Once", n=2, max_tokens=10, temperature=1.0, seed=11)
    streamed = list(client.completions.create(model=engine.name, prompt="Once", n=2, max_tokens=10, temperature=1.0,
                                              seed=11, stream=True))
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in expected] and texts[0] != texts[1]
    for i in range(2):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) == texts[i]


def test_chat_and_its_stream_equal_the_engine_alone_on_the_rendered_prompt(live, client):
    engine = live.engine
    messages = [{"role": "user", "content": "Hi there"}]
    ids = engine.tokenizer.encode("user:Hi thereQRS\nassistant:")  # TEMPLATE rendered by hand.
    (expected,) = alone(engine, ids, max_tokens=12, temperature=0.0, stop=("QRS",))
    reply = client.chat.completions.create(model=engine.name, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=engine.name, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == (expected.text,
                                                                                  expected.finish_reason)
    assert reply.usage.prompt_tokens == len(ids)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text


def test_echo_with_logprobs_gives_every_token_and_its_top_n_as_the_full_forward(live, client):
    """`echo` + `logprobs=2`: the prompt's and the completion's tokens, each token's log-probability and its
    position's top 2 (None for the first token), within 1e-4 of log_softmax of the full forward's logits."""
    engine = live.engine
    answer = client.completions.create(model=engine.name, prompt="Hi axcore", max_tokens=3, temperature=0,
                                       logprobs=2, echo=True)
    lp = answer.choices[0].logprobs
    prompt = engine.tokenizer.encode("Hi axcore")
    (expected,) = alone(engine, prompt, max_tokens=3, temperature=0.0)
    ids = [*prompt, *expected.token_ids]
    logits = axcore.functional(engine.model, engine.params, (np.asarray([ids]),), None, False, method="logits")[0]
    logits = np.asarray(logits[0].astype(jnp.float32), np.float64)
    reference = logits - logits.max(-1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(-1, keepdims=True))
    text = [engine.tokenizer.decode([t]) for t in ids]
    assert answer.choices[0].text == "Hi axcore" + expected.text and lp.tokens == text
    assert lp.text_offset == np.cumsum([0] + [len(t) for t in text[:-1]]).tolist()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], reference[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    for p in range(1, len(ids)):
        top = np.argsort(-reference[p - 1], kind="stable")[:2]
        want = {engine.tokenizer.decode([t]): reference[p - 1, t] for t in top.tolist()}
        assert list(lp.top_logprobs[p]) == list(want)
        np.testing.assert_allclose(list(lp.top_logprobs[p].values()), list(want.values()), atol=1e-4)
