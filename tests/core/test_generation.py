"""Generation with the KV cache against an independent greedy loop over full forwards, and
the sampling rules against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.experiment import load_experiment
from axcore.generation import Generator, Sampling, sample_logits
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


def _full_logits(model, params, ids):
    if id(model) not in _LOGITS:
        _LOGITS[id(model)] = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])
    return _LOGITS[id(model)](params, ids)


def _greedy_by_full_forward(model, params, prompt, num_new, stops=(), width=32):
    """The reference: re-run the whole sequence for every new token (no cache), argmax. The
    model is causal, so a fixed-width buffer (one compilation) gives the same logits."""
    tokens = list(prompt)
    out = []
    for _ in range(num_new):
        buffer = np.zeros((1, width), np.int32)
        buffer[0, : len(tokens)] = tokens
        token = int(np.argmax(np.asarray(_full_logits(model, params, buffer))[0, len(tokens) - 1]))
        out.append(token)
        tokens.append(token)
        if token in stops:
            break
    return out


def test_greedy_batch_of_different_lengths_matches_full_forward_reruns(model_and_params):
    model, params = model_and_params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).astype(np.int32) for n in (1, 7, 3, 18)]
    generated = Generator(model, max_new_tokens=6, bucket=8)(params, prompts)
    for prompt, tokens in zip(prompts, generated):
        assert tokens.tolist() == _greedy_by_full_forward(model, params, prompt, 6)


def test_stop_tokens_end_each_sequence_where_they_come(model_and_params):
    model, params = model_and_params
    prompts = [np.array([5, 6, 7], np.int32), np.array([100], np.int32)]
    free = Generator(model, max_new_tokens=8)(params, prompts)
    stop = int(free[0][2])  # The third token of the first sequence becomes a stop token.
    stopped = Generator(model, max_new_tokens=8, stop_tokens=[stop])(params, prompts)
    for prompt, tokens in zip(prompts, stopped):
        assert tokens.tolist() == _greedy_by_full_forward(model, params, prompt, 8, stops={stop})
    assert stopped[0].tolist() == free[0][: free[0].tolist().index(stop) + 1].tolist()


def _empirical(logits, sampling, draws=20000):
    keys = jax.random.split(jax.random.key(7), draws)
    batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (1, len(logits)))
    tokens = jax.jit(jax.vmap(lambda k: sample_logits(batch, k, sampling)[0]))(keys)
    return np.bincount(np.asarray(tokens), minlength=len(logits)) / draws


def _numpy_distribution(logits, temperature, top_k=None, top_p=1.0):
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(len(z), bool)
    if top_k is not None:
        keep[order[top_k:]] = False
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if top_p < 1.0:
        cumulative = 0.0
        nucleus = np.zeros(len(z), bool)
        for i in order:
            if not keep[i] or cumulative >= top_p:
                break
            nucleus[i] = True
            cumulative += p[i]
        p = np.where(nucleus, np.exp(z - z.max()), 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize(
    "sampling",
    [Sampling(temperature=1.0), Sampling(temperature=0.5), Sampling(temperature=1.0, top_k=3),
     Sampling(temperature=2.0, top_p=0.7), Sampling(temperature=1.0, top_k=4, top_p=0.5)],
)
def test_sampling_distribution_matches_numpy(sampling):
    logits = np.array([2.0, 1.5, 0.3, -1.0, 0.9, 1.2, -0.4, 0.0])
    expected = _numpy_distribution(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    seen = _empirical(logits, sampling)
    assert np.all(seen[expected == 0] == 0), (seen, expected)
    np.testing.assert_allclose(seen, expected, atol=0.015)


def test_greedy_is_argmax_and_bad_settings_are_refused():
    logits = jnp.asarray([[0.1, 3.0, -2.0], [5.0, 1.0, 4.9]])
    assert sample_logits(logits, jax.random.key(0), Sampling()).tolist() == [1, 0]
    for bad in [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_prompt_padding_never_exceeds_the_learned_position_limit():
    """A prompt of 17 tokens pads to the 32-token bucket, but the model has only 20 positions:
    the padding is cut to the cache, and 3 new tokens still fit (17 + 3 = 20)."""
    exp = load_experiment(None, [*SMALL[1:], "model.position_embedding.max_len=20"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = jax.jit(model.initialize)(jax.random.key(5))
    prompt = np.arange(17, dtype=np.int32) * 5
    [tokens] = Generator(model, max_new_tokens=3)(params, [prompt])
    assert tokens.tolist() == _greedy_by_full_forward(model, params, prompt, 3, width=20)
    with pytest.raises(ValueError, match="max_len 20"):
        Generator(model, max_new_tokens=4)(params, [prompt])
