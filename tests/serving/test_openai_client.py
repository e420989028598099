"""The `openai` Python client against a live server (uvicorn on 127.0.0.1) over the rule engine.

Every expected text is computed from the rule alone (`rule_engine.expected`), never by the server.
"""

import math

import openai
import pytest

from axcore.data.chat import ChatTemplate

from rule_engine import ADAPTER, BASE, LOG_HALF, LOG_REST, LiveServer, RuleEngine, expected

# Replies end at "QRS" (the template's end-of-turn marker); the generation prompt ends with ':'.
TEMPLATE = ("{% for m in messages %}{{ m['role'] + ':' + m['content'] + 'QRS\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
# The rule after ':' (58): ';' (59) up to 'P' (80), then 'Q' starts the marker.
REPLY = "".join(chr(c) for c in range(59, 81))


@pytest.fixture(scope="module")
def live():
    with LiveServer(RuleEngine(), chat_template=ChatTemplate(TEMPLATE, name="test")) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_completion(client):
    answer = client.completions.create(model=BASE, prompt="abc", max_tokens=5)
    assert [c.text for c in answer.choices] == [expected("abc", 5)[0]] == ["defgh"]
    assert answer.choices[0].finish_reason == "length" and answer.model == BASE
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 5)


def test_n_2_and_an_adapter_by_name(client):
    answer = client.completions.create(model=ADAPTER, prompt="hello", n=2, max_tokens=6)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    assert texts == [expected("hello", 6, i, ADAPTER)[0] for i in range(2)]
    assert texts[0] != expected("hello", 6)[0]  # The adapter's rule differs from the base's.


def test_a_stop_string_ends_the_text_before_it(client):
    answer = client.completions.create(model=BASE, prompt="a", max_tokens=10, stop=["ef"])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == expected("a", 10, stop="ef") == ("bcd", "stop")


def test_streamed_completion_equals_the_whole_one(client):
    chunks = list(client.completions.create(model=BASE, prompt="Hi", max_tokens=7, n=2, stream=True))
    for index in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == expected("Hi", 7, index)[0]
        assert [c.finish_reason for c in mine][-1] == "length" and all(c.finish_reason is None for c in mine[:-1])


def test_several_prompts_number_their_choices_prompt_by_prompt(client):
    answer = client.completions.create(model=BASE, prompt=["ab", "xy"], n=2, max_tokens=3)
    got = {c.index: c.text for c in answer.choices}
    assert got == {2 * k + i: expected(p, 3, i)[0] for k, p in enumerate(["ab", "xy"]) for i in range(2)}


def test_logprobs_with_echo_cover_prompt_and_completion(client):
    answer = client.completions.create(model=BASE, prompt="abd", max_tokens=2, logprobs=2, echo=True)
    lp = answer.choices[0].logprobs
    assert answer.choices[0].text == "abdef" and lp.tokens == list("abdef")
    # 'b' follows 'a' by the rule, 'd' does not follow 'b'; the first token has none.
    assert lp.token_logprobs == [None, pytest.approx(LOG_HALF), pytest.approx(LOG_REST)] + [pytest.approx(LOG_HALF)] * 2
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert lp.top_logprobs[3] == {"e": pytest.approx(LOG_HALF), "\x00": pytest.approx(LOG_REST)}
    # The prompt's tokens carry their positions' top 2 too ('c' follows 'b' by the rule); the first has none.
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[2] == {"c": pytest.approx(LOG_HALF), "\x00": pytest.approx(LOG_REST)}


def test_max_tokens_0_with_echo_scores_the_prompt_only(client):
    answer = client.completions.create(model=BASE, prompt="abc", max_tokens=0, echo=True, logprobs=0)
    assert answer.choices[0].text == "abc" and answer.usage.completion_tokens == 0
    assert answer.choices[0].logprobs.token_logprobs == [None, pytest.approx(LOG_HALF), pytest.approx(LOG_HALF)]


def test_a_prompt_of_token_ids(client):
    answer = client.completions.create(model=BASE, prompt=[104, 105], max_tokens=3)
    assert answer.choices[0].text == expected("hi", 3)[0]


def test_chat_reply_ends_before_the_templates_end_of_turn_marker(client):
    answer = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hey"}], max_tokens=40)
    assert answer.choices[0].message.content == REPLY and answer.choices[0].finish_reason == "stop"
    rendered = ChatTemplate(TEMPLATE).render([{"role": "user", "content": "hey"}], add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(rendered.encode())


def test_streamed_chat_never_shows_part_of_the_marker(client):
    chunks = list(client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hey"}], max_tokens=40, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_and_top_logprobs(client):
    answer = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert [e.token for e in content] == list(answer.choices[0].message.content) == ["<", ">"]  # The adapter steps by 2 from ":" (58).
    for entry in content:
        assert entry.logprob == pytest.approx(math.log(0.5))
        assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs[1:]] == [pytest.approx(LOG_REST)] * 2


def test_models_lists_the_base_then_each_adapter(client):
    assert [m.id for m in client.models.list().data] == [BASE, ADAPTER]


def test_a_bad_request_raises_the_clients_bad_request_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=BASE, prompt="a", top_p=0)
    assert caught.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
