"""`ModelRunner` on a tiny Llama-like model (RoPE, SwiGLU, GQA): chunked prefills and decode steps of several
sequences in one batch give the full forward's logits; programs are bucketed, counted and capped; the cache is
donated, the parameters are not; bad settings and arrays name their field."""

import jax
import numpy as np
import pytest

from axcore import AxcoreError
from axcore.engine.model_runner import ModelRunner, ModelRunnerError
from axcore.module import functional
from axcore.testing import load_tiny_experiment

VOCAB, BLOCK, TOTAL = 256, 4, 12  # The byte tokenizer of the default experiment needs 256 ids.
# Per sequence, the tokens fed at each step (0: not running that step): prefills in three chunks, a sequence
# joining at step 2, then decoding.
PLAN = ((3, 2, 2, 1, 1, 1, 1, 1), (4, 1, 3, 1, 1, 1, 1), (0, 0, 2, 4, 3, 1, 1, 1))


@pytest.fixture(scope="module")
def llama():
    exp = load_tiny_experiment(
        ("rope", "swiglu"),
        ("model.compute_dtype=float32", f"model.vocab_size={VOCAB}",
         "model.decoder.layer.self_attention.num_heads=4", "model.decoder.layer.self_attention.num_kv_heads=2"),
    )
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(1))
    ids = np.asarray(jax.random.randint(jax.random.key(2), (len(PLAN), TOTAL), 0, VOCAB))
    full = jax.jit(lambda p, x: functional(model, p, (x,), None, False, method="logits")[0])(params, ids)
    return model, params, ids, np.asarray(full)


def runner_of(model, **changes):
    settings = dict(num_blocks=16, block_size=BLOCK, batch_buckets=[2, 4], token_buckets=[1, 4], max_programs=8)
    return ModelRunner(model, **{**settings, **changes})


def test_chunked_steps_of_mixed_rows_give_the_full_forward_logits(llama):
    model, params, ids, full = llama
    runner = runner_of(model)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(np.arange(1, 16))[: 3 * 3].reshape(3, 3).astype(np.int32)  # Shuffled block ids.
    done = [0, 0, 0]
    for step in range(max(len(p) for p in PLAN)):
        rows = [s for s in rng.permutation(3) if step < len(PLAN[s]) and PLAN[s][step] > 0]
        t = max(PLAN[s][step] for s in rows)
        tokens, positions = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), np.int32)
        num_new = np.array([PLAN[s][step] for s in rows], np.int32)
        for r, s in enumerate(rows):
            tokens[r, : num_new[r]] = ids[s, done[s] : done[s] + num_new[r]]
            positions[r, : num_new[r]] = np.arange(done[s], done[s] + num_new[r])
        tables = blocks[rows][:, : -(-(max(done[s] + PLAN[s][step] for s in rows)) // BLOCK)]
        if step == 0:  # The prompt log-probabilities form: every token's logits too.
            last, every = runner.step(params, tokens, positions, num_new, tables, all_logits=True)
            for r, s in enumerate(rows):
                np.testing.assert_allclose(every[r, : num_new[r]], full[s, : num_new[r]], atol=2e-5, rtol=1e-5)
        else:
            last = runner.step(params, tokens, positions, num_new, tables)
        assert last.shape[1] == VOCAB and last.shape[0] in runner.batch_buckets and np.isfinite(last).all()
        for r, s in enumerate(rows):
            done[s] += int(num_new[r])
            np.testing.assert_allclose(last[r], full[s, done[s] - 1], atol=2e-5, rtol=1e-5)
    assert done == [TOTAL] * 3
    assert runner.num_programs == len(set(runner.programs)) <= 8


def test_a_ragged_step_gives_the_full_forward_logits_of_its_logit_rows(llama):
    """Two sequences' chunks one token per row (3 rows of sequence 0, 2 of sequence 1, each row its sequence's
    table), logits asked for each chunk's last row: the full forward's logits there; a second ragged step of the
    same row bucket and width, another number of logit rows, compiles no program; too many logit rows are refused."""
    model, params, ids, full = llama
    runner = runner_of(model, ragged_buckets=[8])
    tables = np.array([[1, 2, 0], [3, 0, 0]], np.int32)
    owner, positions = np.array([0, 0, 0, 1, 1]), np.array([0, 1, 2, 0, 1])
    tokens = ids[owner, positions][:, None].astype(np.int32)
    last = runner.step(params, tokens, positions[:, None], np.ones(5, np.int32), tables[owner],
                       logit_rows=np.array([2, 4]))
    assert last.shape == (4, VOCAB)  # S = min(8 rows, the largest batch bucket 4).
    np.testing.assert_allclose(last[:2], full[[0, 1], [2, 1]], atol=2e-5, rtol=1e-5)
    more = runner.step(params, ids[0, 3:5][:, None].astype(np.int32), np.array([[3], [4]]), np.ones(2, np.int32),
                       tables[[0, 0]], logit_rows=np.array([1]))
    np.testing.assert_allclose(more[0], full[0, 4], atol=2e-5, rtol=1e-5)
    assert runner.programs == [(8, 1, 4, False, 4)]
    with pytest.raises(ModelRunnerError, match=r"^'logit_rows': names 5 rows, more than the largest batch bucket 4"):
        runner.step(params, tokens, positions[:, None], np.ones(5, np.int32), tables[owner],
                    logit_rows=np.arange(5))


def test_programs_are_one_per_bucket_shape_and_capped(llama):
    model, params, _, _ = llama
    runner = runner_of(model, max_programs=3)

    def step(rows, t, width=1):
        tables = np.tile(np.arange(1, width + 1, dtype=np.int32), (rows, 1))
        return runner.step(params, np.ones((rows, t), np.int32), np.zeros((rows, t), np.int32),
                           np.ones(rows, np.int32), tables)

    step(2, 3, width=3)  # (2 rows, 3 tokens, 3 blocks) -> bucket (2, 4, 4).
    step(1, 1)  # -> (2, 1, 1).
    step(2, 2, width=2)  # -> (2, 4, 2).
    step(1, 4, width=4)  # -> (2, 4, 4): no new program.
    assert runner.programs == [(2, 4, 4, False, None), (2, 1, 1, False, None), (2, 4, 2, False, None)]
    with pytest.raises(ModelRunnerError, match=r"^'max_programs': .*needs compiled program 4, past max_programs 3"):
        step(3, 1)  # -> (4, 1, 1), a fourth program.
    assert runner.num_programs == 3
    assert isinstance(ModelRunnerError("max_programs", "x"), AxcoreError)


def test_the_cache_is_donated_and_the_parameters_are_not(llama):
    model, params, _, _ = llama
    runner = runner_of(model)
    before = jax.tree.leaves(runner.cache)
    runner.step(params, np.ones((1, 1), np.int32), np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                np.ones((1, 1), np.int32))
    assert all(leaf.is_deleted() for leaf in before)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    after = jax.tree.leaves(runner.cache)
    assert [a.shape for a in after] == [b.shape for b in before]
    # Token 1's key went to block 1 (slot 0): nonzero there, zeros in an untouched block.
    assert all(np.abs(np.asarray(a)[1, 0]).max() > 0 and not np.asarray(a)[2].any() for a in after)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"batch_buckets": []}, "batch_buckets"),
        ({"token_buckets": [4, 0]}, "token_buckets"),
        ({"token_buckets": [4, 4]}, "token_buckets"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_programs": 0}, "max_programs"),
    ],
)
def test_bad_settings_name_their_field(llama, changes, field):
    with pytest.raises(ModelRunnerError, match=f"^'{field}': "):
        runner_of(llama[0], **changes)


@pytest.mark.parametrize(
    "rows, t, num_new, table, field",
    [
        (5, 1, 1, 1, "batch_buckets"),  # More rows than the largest batch bucket.
        (1, 5, 1, 1, "token_buckets"),
        (1, 1, 2, 1, "num_new"),  # More valid tokens than the row holds.
        (1, 1, 1, 16, "block_tables"),  # No block 16 in a cache of 16.
        (1, 1, 1, 0, "block_tables"),  # A valid token in the null block.
    ],
)
def test_bad_steps_name_their_array(llama, rows, t, num_new, table, field):
    model, params, _, _ = llama
    runner = runner_of(model)
    with pytest.raises(ModelRunnerError, match=f"^'{field}': "):
        runner.step(params, np.ones((rows, t), np.int32), np.zeros((rows, t), np.int32),
                    np.full(rows, num_new, np.int32), np.full((rows, 1), table, np.int32))
    assert runner.num_programs == 0


def test_a_token_past_its_block_table_is_refused(llama):
    model, params, _, _ = llama
    runner = runner_of(model)
    with pytest.raises(ModelRunnerError, match="^'block_tables': a valid token's position has no block"):
        runner.step(params, np.ones((1, 1), np.int32), np.full((1, 1), BLOCK, np.int32), np.ones(1, np.int32),
                    np.ones((1, 1), np.int32))  # Position 4 is in the table's second block; it lists one.


@pytest.mark.parametrize("source", ["default", "scan"])
def test_steps_update_the_cache_in_place(source):
    """Unrolled and scanned stacks, one token or a chunk: no program needs scratch memory for a copy of the
    cache (a one-slot write or a scanned stack's per-layer slices used to copy all of it, every step)."""
    exp = load_tiny_experiment(("rope", "swiglu"), ("model.compute_dtype=float32",), source=source)
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    params = model.initialize(jax.random.key(1))
    runner = ModelRunner(model, num_blocks=1024, block_size=16, batch_buckets=[1, 2], token_buckets=[1, 4],
                         max_programs=2)
    for rows, t in ((1, 1), (2, 4)):
        runner.step(params, np.ones((rows, t), np.int32), np.zeros((rows, t), np.int32), np.ones(rows, np.int32),
                    np.ones((rows, 1), np.int32))
    scratch = runner.temp_bytes()
    assert len(scratch) == 2 and max(scratch.values()) < runner.cache_bytes / 8, (scratch, runner.cache_bytes)


@pytest.mark.parametrize("adapters", [np.zeros(2, np.int32), np.array([-1]), np.array([0.5])])
def test_bad_adapter_slots_are_refused_naming_adapters(llama, adapters):
    """One non-negative integer adapter slot per row (`axcore.kernels.adapter_rows`), else refused before compiling."""
    model, params, _, _ = llama
    runner = runner_of(model)
    with pytest.raises(ModelRunnerError, match="^'adapters': "):
        runner.step(params, np.ones((1, 1), np.int32), np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                    np.ones((1, 1), np.int32), adapters=adapters)
    assert runner.num_programs == 0


def test_programs_are_traced_forward_only_and_a_training_trace_is_not(llama, monkeypatch):
    """Kernels without a backward pass may serve the runner's programs: the runner traces them inside
    `forward_only_programs()`, and nothing else is (a gradient of the same model sees False)."""
    from axcore.kernels import KernelRegistry, forward_only_programs, tracing_forward_only

    model, params, ids, _ = llama
    seen: list[bool] = []  # tracing_forward_only() at each dot kernel selection.
    original = KernelRegistry.select

    def spy(self, op, problem, requested=None):
        if getattr(op, "name", op) == "dot":
            seen.append(tracing_forward_only())
        return original(self, op, problem, requested)

    monkeypatch.setattr(KernelRegistry, "select", spy)
    runner_of(model).step(params, np.ones((1, 1), np.int32), np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                          np.ones((1, 1), np.int32))
    assert seen and all(seen)
    seen.clear()
    loss = lambda p: functional(model, p, (ids[:1, :4],), None, False, method="logits")[0].sum()  # noqa: E731
    jax.grad(loss)(params)
    assert seen and not any(seen)
    with forward_only_programs():
        assert tracing_forward_only()
    assert not tracing_forward_only()
