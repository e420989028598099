"""Conformance suites: base test classes a component's author subclasses with one line.

    from axcore.testing import AttentionKernelConformance

    class TestMyKernel(AttentionKernelConformance):
        kernel = MyKernel()

Each suite checks numbers against an independent formula (NumPy float64) or
behaviour against the protocol, never a component against itself; the checks are
also plain functions (`axcore.testing.check_*`) for use outside pytest. Class
attributes configure a suite; see each class.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from axcore.experiment.builtins import create_plugin_manager
from axcore.experiment.loading import load_experiment
from axcore.testing import attention, checkpoint, decoding, position, transform
from axcore.testing.training import TINY_OVERRIDES


def _manager(plugins: Sequence[str], objects: Mapping[str, Any] | None):
    return create_plugin_manager(list(plugins), objects=dict(objects or {}))


class AttentionKernelConformance:
    """An `attention` kernel: output and q/k/v gradients against the formula, honest `is_supported`.

    Cases (`cases`, default `DEFAULT_CASES`) cover float32 and bfloat16, causal,
    sliding-window and key-padding masks, cross lengths and GQA/MQA; a case the kernel
    declines (with a reason) is skipped, and a kernel that declines them all fails.
    """

    # The kernel under test (an object with name, priority, is_supported and __call__).
    kernel: ClassVar[Any] = None
    # The cases to run.
    cases: ClassVar[Sequence[attention.AttentionCase]] = attention.DEFAULT_CASES
    # Platform written into the problems; None = JAX's default backend.
    platform: ClassVar[str | None] = None
    # dtype name -> (output, gradient) tolerance; merged over DEFAULT_TOLERANCES.
    tolerances: ClassVar[dict] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "attention_case" in metafunc.fixturenames:
            metafunc.parametrize("attention_case", list(self.cases), ids=[c.name for c in self.cases])

    def test_has_a_name_and_priority(self):
        assert isinstance(self.kernel.name, str) and self.kernel.name
        assert isinstance(self.kernel.priority, int)

    def test_declines_unknown_extras(self):
        attention.check_declines_unknown_extras(self.kernel, self.cases[0], platform=self.platform)

    def test_supports_some_case(self):
        supported = [c.name for c in self.cases if self.kernel.is_supported(c.problem(self.platform))]
        assert supported, f"kernel {self.kernel.name!r} declines every case; the suite would check nothing"

    def test_matches_the_attention_formula(self, attention_case):
        support = attention.check_case(
            self.kernel, attention_case, platform=self.platform, tolerances=self.tolerances
        )
        if not support:
            pytest.skip(f"{self.kernel.name} declines: {support.reason}")

    def test_segment_ids_keep_packed_documents_apart(self):
        """Packed rows (the first case's shape, q_len == kv_len): each segment attends as if alone."""
        support = check_segment_ids(self.kernel, self.cases[0], platform=self.platform, tolerances=self.tolerances)
        if not support:
            pytest.skip(f"{self.kernel.name} declines: {support.reason}")


def segment_lengths(length: int, batch: int) -> list[list[int]]:
    """Segment lengths of each packed row of `length` tokens: even rows in three, odd rows in two."""
    if length < 4:
        raise ValueError(f"packed rows need at least 4 tokens, got {length}")
    three = [3 * length // 8, 3 * length // 8]
    two = [5 * length // 8]
    return [(three if b % 2 == 0 else two) + [length - sum(three if b % 2 == 0 else two)] for b in range(batch)]


def check_segment_ids(
    kernel: Any, case: attention.AttentionCase, *, platform: str | None = None, tolerances: dict | None = None
) -> Any:
    """Packed rows: the kernel's output and q/k/v gradients with segment ids equal the attention
    formula (NumPy float64) run on each segment alone; or the kernel declines, with a reason.

    The case's shape and masks are kept, with kv_len = q_len and no key padding; rows pack
    `segment_lengths` segments, numbered from 1 in even rows and `1, 0` in odd rows (0 is
    the batch schema's padding: to a kernel, an id like any other). Returns the `Support`
    of the problem with segment ids (falsy: declined; nothing was run).
    """
    case = dataclasses.replace(case, name=f"{case.name}-segments", kv_len=case.q_len, kv_padding=0)
    support = kernel.is_supported(case.problem(platform, has_segment_ids=True))
    if not support:
        assert support.reason.strip(), f"{kernel.name} declined segment ids without a reason"
        return support
    lengths = segment_lengths(case.q_len, case.batch)
    ids = np.stack([np.repeat([1, 2, 3] if b % 2 == 0 else [1, 0], row) for b, row in enumerate(lengths)])
    inputs = case.inputs()
    want_out = np.zeros(inputs["q"].shape)
    want_grads = [np.zeros(inputs[n].shape) for n in ("q", "k", "v")]
    for b, row in enumerate(lengths):
        for start, n in zip(np.cumsum([0, *row[:-1]]), row):
            alone = dataclasses.replace(case, batch=1, q_len=n, kv_len=n)
            span = (slice(b, b + 1), slice(start, start + n))
            out, grads = attention.numpy_attention(alone, *(inputs[k][span] for k in ("q", "k", "v", "d_out")))
            want_out[span] = out
            for want, grad in zip(want_grads, grads):
                want[span] = grad
    def loss(q, k, v):
        segments = jnp.asarray(ids, jnp.int32)
        out = kernel(case.problem(platform, has_segment_ids=True), q, k, v, q_segment_ids=segments,
                     kv_segment_ids=segments)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(inputs["d_out"], jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jnp.asarray(inputs[n]) for n in ("q", "k", "v"))
    )
    tol_out, tol_grad = {**attention.DEFAULT_TOLERANCES, **(tolerances or {})}[case.dtype]
    where = f"kernel {kernel.name!r}, case {case.name} (segments {lengths})"
    attention._close("output", out, want_out, tol_out, where)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        attention._close(name, got, want, tol_grad, where)
    return support


class PositionEmbeddingConformance:
    """A position embedding: shapes and dtypes in every place, positions matter, relative invariance if claimed."""

    # The embedding's config, e.g. `MyEmbedding.default_config()` (dim/num_heads are set if unset).
    embedding: ClassVar[Any] = None
    # Whether attention logits depend only on position differences (then checked).
    relative: ClassVar[bool] = False
    # Whether it is the identity (then "positions matter" is not checked).
    identity: ClassVar[bool] = False
    # Plugins (names, or keys of `objects`) whose registries build it.
    plugins: ClassVar[Sequence[str]] = ()
    objects: ClassVar[Mapping[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def built(cls):
        registries = _manager(cls.plugins, cls.objects).registries
        return position.build(cls.embedding, registries)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_shapes_and_dtypes(self, built, dtype):
        import jax.numpy as jnp

        position.check_shapes_and_dtypes(*built, jnp.dtype(dtype))

    def test_positions_matter(self, built):
        if self.identity:
            pytest.skip("declared the identity")
        position.check_positions_matter(*built)

    def test_relative_position_invariance(self, built):
        if not self.relative:
            pytest.skip("does not claim relative positions")
        position.check_relative_invariance(*built)


class CheckpointBackendConformance:
    """A checkpoint backend: round trip, commit-marker atomicity, restore into another sharding, mismatch errors."""

    # A registered backend name (looked up in the registries of `plugins`) or a factory.
    backend: ClassVar[Any] = None
    plugins: ClassVar[Sequence[str]] = ()
    objects: ClassVar[Mapping[str, Any]] = {}
    # A step's commit marker relative to the checkpoint directory, `{step}` formatted in,
    # e.g. "step_{step:08d}/COMMITTED"; or override `uncommit`.
    commit_marker: ClassVar[str | None] = None

    def uncommit(self, directory: str, step: int) -> None:
        """Removes the commit marker of `step`, as if its write had stopped just before the commit."""
        if self.commit_marker is None:
            pytest.fail("Set `commit_marker` (a path with {step}) or override `uncommit(directory, step)`.")
        marker = os.path.join(directory, self.commit_marker.format(step=step))
        assert os.path.exists(marker), f"the committed step {step} has no commit marker {marker}"
        os.remove(marker)

    @pytest.fixture
    def open_backend(self):
        factory = self.backend
        if isinstance(factory, str):
            factory = _manager(self.plugins, self.objects).registries.checkpoint_backends[factory]
        opened = []

        def open_backend(directory, **kwargs):
            backend = factory(directory, **kwargs)
            opened.append(backend)
            return backend

        yield open_backend
        for backend in opened:
            backend.close()

    def test_round_trip(self, open_backend, tmp_path):
        checkpoint.check_round_trip(open_backend, str(tmp_path))

    def test_commit_marker_atomicity(self, open_backend, tmp_path):
        checkpoint.check_commit_atomicity(open_backend, str(tmp_path), self.uncommit)

    def test_restore_into_another_sharding(self, open_backend, tmp_path):
        checkpoint.check_restore_into_another_sharding(open_backend, str(tmp_path))

    def test_mismatch_errors(self, open_backend, tmp_path):
        checkpoint.check_mismatch_errors(open_backend, str(tmp_path))


class ConfigTransformConformance:
    """A plugin's config transform: applies to every target, idempotent or refusing, touches nothing else."""

    # The plugin's name: an installed entry point, or a key of `objects`.
    plugin: ClassVar[str] = ""
    objects: ClassVar[Mapping[str, Any]] = {}
    # The plugin's settings section (as in the experiment file), or None.
    settings: ClassVar[Mapping[str, Any] | None] = None
    # Experiment (built-in name or file) and overrides giving the config before the transform.
    experiment: ClassVar[str] = "default"
    overrides: ClassVar[Sequence[str]] = TINY_OVERRIDES
    # What it must transform: a class, a predicate (path, node) -> bool, or a tuple of them.
    targets: ClassVar[Any] = None
    # What else it may change (e.g. an input embedding it removes): the same forms as `targets`.
    also_touches: ClassVar[Any] = ()

    @pytest.fixture(scope="class")
    @classmethod
    def transformed(cls):
        manager = _manager([cls.plugin], cls.objects)
        raw = {cls.plugin: dict(cls.settings)} if cls.settings else {}
        settings = manager.settings(raw)
        # The experiment resolved without plugins: the config the transform receives.
        before = load_experiment(cls.experiment, [*cls.overrides, "plugins=[]"], objects=dict(cls.objects)).config
        after = transform.transform(manager, before, settings)
        return manager, settings, before, after

    def test_applies_to_every_target(self, transformed):
        manager, _, before, after = transformed
        transform.check_applies_to_every_target(before, after, self.targets, manager.registries)

    def test_touches_nothing_else(self, transformed):
        manager, _, before, after = transformed
        allowed = transform.target_paths(before, self.targets)
        also = self.also_touches if isinstance(self.also_touches, (tuple, list)) else (self.also_touches,)
        if also:
            allowed += transform.target_paths(before, tuple(also))
        transform.check_touches_nothing_else(before, after, allowed, manager.registries)

    def test_idempotent_or_refuses_a_second_application(self, transformed):
        manager, settings, _, after = transformed
        transform.check_idempotent_or_refuses(manager, after, settings, manager.registries)


class DecodingConformance:
    """A model (and every layer plugin in it): KV-cache decoding gives the full forward's logits.

    Set `plugins` / `objects` (and `overrides`, e.g. `model.decoder.layer.type=my_block`);
    the suite builds `experiment` shrunk by TINY_OVERRIDES in float32 and decodes a
    prompt then one token at a time, unrolled and scanned (`scan` experiment) stacks both;
    then the inference engine's paged form (`CausalLM.extend_paged`: chunked prefills and
    decode steps of several sequences in one batch over shuffled KV blocks) must give the
    same logits too.
    """

    # Plugins (names, or keys of `objects`) to enable.
    plugins: ClassVar[Sequence[str]] = ()
    objects: ClassVar[Mapping[str, Any]] = {}
    # Overrides after TINY_OVERRIDES (e.g. the layer type a plugin registers).
    overrides: ClassVar[Sequence[str]] = ()
    # Experiments to check (built-in names or files); "scan" is the scanned stack.
    experiments: ClassVar[Sequence[str]] = ("default", "scan")

    @pytest.mark.parametrize("index", [0, 1])
    def test_decoding_matches_the_full_forward(self, index):
        if index >= len(self.experiments):
            pytest.skip("no such experiment configured")
        listed = "plugins=[" + ", ".join(self.plugins) + "]"
        overrides = [*TINY_OVERRIDES, listed, "model.compute_dtype=float32", *self.overrides]
        exp = load_experiment(self.experiments[index], overrides, objects=dict(self.objects))
        model = exp.config.model.instantiate(name="model", registries=exp.registries)
        params = model.initialize(jax.random.key(1))
        vocab = int(exp.config.model.vocab_size)
        decoding.check_decoding_matches_forward(model, params, vocab=vocab)
        decoding.check_paged_matches_forward(model, params, vocab=vocab)
