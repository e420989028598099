"""axcore-cpu's `cpu_paged_decode` against dense attention in NumPy, and when it declines."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.kernels import PagedAttentionProblem

from axcore_cpu import CpuPagedDecode


def numpy_decode(q, key, value, tables, positions, *, scale, softcap=None, window=None):
    """Dense float64 attention of each row's one token over its sequence's slots 0..position (GQA by head groups)."""
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = key.shape
    out = np.zeros((batch, heads, dim))
    for b in range(batch):
        p = int(positions[b])
        slots = np.arange(p + 1)
        if window is not None:
            slots = slots[p - slots < window]
        blocks = tables[b, slots // block_size]
        k = key[blocks, slots % block_size].astype(np.float64)  # [s, kv, d]
        v = value[blocks, slots % block_size].astype(np.float64)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            logits = scale * k[:, kv] @ q[b, h].astype(np.float64)
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            w = np.exp(logits - logits.max())
            out[b, h] = (w / w.sum()) @ v[:, kv]
    return out


def case(rng, *, batch=5, heads=6, kv_heads=2, dim=16, block_size=4, width=6, num_blocks=40):
    """Random q and cache; each row's blocks scattered, its position anywhere in its table (edges too)."""
    q = rng.standard_normal((batch, heads, dim)).astype(np.float32)
    key = rng.standard_normal((num_blocks, block_size, kv_heads, dim)).astype(np.float32)
    value = rng.standard_normal((num_blocks, block_size, kv_heads, dim)).astype(np.float32)
    positions = np.array([0, block_size - 1, block_size, width * block_size - 1, 9][:batch], np.int32)
    tables = np.zeros((batch, width), np.int32)
    blocks = rng.permutation(num_blocks - 1) + 1
    for b in range(batch):
        used = positions[b] // block_size + 1
        tables[b, :used] = blocks[b * width: b * width + used]
    return q, key, value, tables, positions


def run_kernel(q, key, value, tables, positions, **flags):
    problem = PagedAttentionProblem.of(q[:, None], key, tables, platform="cpu", **flags)
    kernel = CpuPagedDecode()
    assert kernel.is_supported(problem), kernel.is_supported(problem).reason
    fn = jax.jit(lambda *a: kernel(problem, *a))
    out = fn(jnp.asarray(q[:, None]), jnp.asarray(key), jnp.asarray(value), jnp.asarray(tables),
             jnp.asarray(positions[:, None]), jnp.ones(len(q), jnp.int32))
    return np.asarray(out)[:, 0]


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 6), (6, 2), (6, 1)])
def test_matches_numpy_dense_attention_for_mha_gqa_mqa(heads, kv_heads):
    q, key, value, tables, positions = case(np.random.default_rng(heads + kv_heads), heads=heads, kv_heads=kv_heads)
    scale = 0.3
    got = run_kernel(q, key, value, tables, positions, scale=scale)
    np.testing.assert_allclose(got, numpy_decode(q, key, value, tables, positions, scale=scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("dim", "heads", "kv_heads"), [(64, 9, 3), (64, 4, 4), (128, 8, 1), (64, 9, 1), (32, 6, 2)])
@pytest.mark.parametrize("window_softcap", [(0, 0.0), (7, 2.5)])
def test_the_vector_paths_match_numpy(dim, heads, kv_heads, window_softcap):
    """Head dims 64 and 128 with 1-8 query heads per kv head take the vectorized path (queries and outputs held in
    registers, the next block prefetched); 9 per kv head and other dims the general one: all equal NumPy's."""
    window, softcap = window_softcap
    q, key, value, tables, positions = case(np.random.default_rng(dim + heads + kv_heads), heads=heads,
                                            kv_heads=kv_heads, dim=dim, block_size=8, width=5)
    got = run_kernel(q, key, value, tables, positions, scale=dim ** -0.5, sliding_window=window or None,
                     softcap=softcap or None)
    want = numpy_decode(q, key, value, tables, positions, scale=dim ** -0.5, softcap=softcap or None,
                        window=window or None)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_matches_numpy_with_a_sliding_window_and_a_softcap():
    q, key, value, tables, positions = case(np.random.default_rng(7))
    got = run_kernel(q, key, value, tables, positions, scale=1.0, sliding_window=5, softcap=2.5)
    want = numpy_decode(q, key, value, tables, positions, scale=1.0, softcap=2.5, window=5)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_reads_only_the_table_s_blocks():
    """Garbage in every block no table lists changes nothing (the kernel reads blocks in place)."""
    rng = np.random.default_rng(3)
    q, key, value, tables, positions = case(rng)
    unused = np.setdiff1d(np.arange(key.shape[0]), tables)
    before = run_kernel(q, key, value, tables, positions, scale=0.25)
    key[unused], value[unused] = 1e6, -1e6
    np.testing.assert_array_equal(run_kernel(q, key, value, tables, positions, scale=0.25), before)


def test_declines_what_it_does_not_compute():
    q = jnp.zeros((2, 1, 4, 8))
    key = jnp.zeros((10, 4, 2, 8))
    tables = jnp.zeros((2, 3), jnp.int32)
    base = PagedAttentionProblem.of(q, key, tables, platform="cpu")
    kernel = CpuPagedDecode()
    assert kernel.is_supported(base)
    declines = {
        "platform": dataclasses.replace(base, platform="gpu"),
        "q_len": dataclasses.replace(base, q_len=3),
        "float32": dataclasses.replace(base, dtype=np.dtype(jnp.bfloat16)),
        "position biases": dataclasses.replace(base, bias_slopes=(0.5,) * 4),
        "extras": dataclasses.replace(base, extras={"new_flag": 1}),
    }
    for what, problem in declines.items():
        support = kernel.is_supported(problem)
        assert not support, what


@pytest.mark.parametrize(("kernels", "ragged"), [(None, True), ({"paged_attention": "xla"}, False)])
def test_the_engine_runs_ragged_steps_where_this_kernel_serves_its_decodes(kernels, ragged):
    """The kernel declares `reads_blocks_in_place`: an engine whose decode steps it serves runs ragged steps by
    default; one whose decodes go to the gathering reference does not."""
    from axcore.engine import Engine, EngineConfig
    from axcore.experiment import load_experiment
    from axcore.testing import TINY_OVERRIDES

    assert CpuPagedDecode.reads_blocks_in_place
    exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    engine = Engine(model, model.initialize(jax.random.key(0)), None,
                    config=EngineConfig(max_seqs=2, num_blocks=8, kernels=kernels))
    assert engine.ragged_steps is ragged and engine.runner.num_programs == 0  # Decided by tracing, not compiling.
    runner = engine.runner
    # In place, a wide table costs nothing: ragged tables pad to few widths (here the longest table, 7 blocks).
    assert runner.ragged_table_buckets == ((runner.max_blocks_per_seq,) if ragged else runner.table_buckets)


def test_with_wide_ragged_tables_short_and_long_sequences_share_one_program():
    """An engine serving its decodes in place pads every ragged step's table to 64 blocks (then 8x wider): a
    sequence of 1 block and one of 40 run through the same program, and give the tokens of an engine whose
    tables are padded as little as possible (the gathering reference, split steps)."""
    from axcore.engine import Engine, EngineConfig
    from axcore.engine.requests import GenerationRequest, SamplingParams
    from axcore.experiment import load_experiment
    from axcore.testing import TINY_OVERRIDES

    exp = load_experiment(None, [*TINY_OVERRIDES, "model.compute_dtype=float32", "model.position_embedding.max_len=1024"])
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(0))
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    prompts = [[5, 9, 2], list(np.random.default_rng(0).integers(1, 200, 150))]  # 1 and 40 blocks of 4.

    def generate(kernels, prompt):
        engine = Engine(model, params, None, config=EngineConfig(max_seqs=2, num_blocks=600, block_size=4,
                                                                 kernels=kernels))
        out = engine.generate([GenerationRequest(request_id="r", prompt_token_ids=tuple(int(t) for t in prompt),
                                                 params=greedy)])
        return out[0].choices[0].token_ids, engine.runner

    for prompt in prompts:
        tokens, runner = generate(None, prompt)
        assert runner.ragged_table_buckets[0] == 64 and {key[2] for key in runner.programs} == {64}
        assert tokens == generate({"paged_attention": "xla"}, prompt)[0]
