"""SamplingParams and GenerationRequest refuse bad fields, naming the field (the server's 400 names it too)."""

import math

import pytest

from axcore import AxcoreError
from axcore.engine.requests import GenerationRequest, SamplingParams, SamplingParamsError

BAD = [
    ("n", 0), ("max_tokens", 0), ("max_tokens", True), ("top_k", -1), ("temperature", -0.1),
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.5),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("seed", 1.5), ("stop", ("",)), ("logprobs", -1), ("logprobs", 21), ("prompt_logprobs", 30),
]


@pytest.mark.parametrize("field,value", BAD)
def test_a_bad_field_is_refused_by_name(field, value):
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field and str(caught.value).startswith(f"'{field}': ")
    assert isinstance(caught.value, AxcoreError)


def test_good_fields_are_kept_and_sequences_become_tuples():
    params = SamplingParams(n=3, temperature=0, top_k=5, stop=["\n"], stop_token_ids=[2], logprobs=0, seed=7)
    assert (params.n, params.top_k, params.stop, params.stop_token_ids, params.seed) == (3, 5, ("\n",), (2,), 7)
    assert params.greedy and not SamplingParams().greedy


def test_a_request_needs_a_prompt_token():
    with pytest.raises(SamplingParamsError, match="'prompt'"):
        GenerationRequest("r", ())
    assert GenerationRequest("r", [1, 2]).prompt_token_ids == (1, 2)
