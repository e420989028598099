"""`DecodingConformance`: every built-in and example layer decodes to its full forward, and the
suite fails a layer whose decoding skips its steps."""

import axcore
from axcore.layers.transformer import TransformerLayer
from axcore.testing import DecodingConformance

pytest_plugins = ["pytester"]


class TestBuiltInLayers(DecodingConformance):
    pass


class TestRopeSwigluGqa(DecodingConformance):
    plugins = ("rope", "swiglu")
    overrides = ("model.decoder.layer.self_attention.num_kv_heads=1",)


class TestAlibiSlidingWindow(DecodingConformance):
    plugins = ("alibi",)
    overrides = ("model.decoder.layer.self_attention.sliding_window=3",)


class TestMoe(DecodingConformance):
    plugins = ("rope", "moe")
    overrides = ("moe.capacity_factor=null",)  # No token dropped: routing is per token.


class TestSinusoidalExample(DecodingConformance):
    plugins = ("sinusoidal",)


class ParallelBlock(TransformerLayer):
    """GPT-J-style: x + attn(norm(x)) + ffn(norm(x)), written by overriding the steps only."""

    def attention_block(self, x, **kwargs):
        h = self.attention_norm(x)
        return x + self.self_attention(h, **kwargs) + self.feed_forward(h)

    def ffn_block(self, x):
        return x


class ParallelPlugin:
    @axcore.hookimpl
    def axcore_register_layers(self, register):
        register("parallel_block", ParallelBlock)


class TestParallelBlockPlugin(DecodingConformance):
    plugins = ("parallel",)
    objects = {"parallel": ParallelPlugin()}
    overrides = (
        "model.decoder.layer.type=parallel_block",
        "model.decoder.layer.self_attention.causal=true",
        "model.decoder.layer.self_attention.num_heads=2",
        "model.decoder.layer.feed_forward.hidden_dim=64",
    )


def test_the_parallel_block_really_computes_another_function():
    """So its decoding test above checks a forward that differs from the built-in sequential block's."""
    import jax
    import numpy as np

    from axcore.experiment import load_experiment
    from axcore.module import functional
    from axcore.testing import TINY_OVERRIDES

    base = [*TINY_OVERRIDES, "model.compute_dtype=float32"]
    parallel = load_experiment(None, [*base, "plugins=[parallel]", *TestParallelBlockPlugin.overrides],
                               objects={"parallel": ParallelPlugin()})
    sequential = load_experiment(None, [*base, "plugins=[]"])
    models = [e.config.model.instantiate(name="model", registries=e.registries) for e in (parallel, sequential)]
    params = models[0].initialize(jax.random.key(1))  # The same children, so the same parameter tree.
    ids = jax.random.randint(jax.random.key(2), (2, 8), 0, 256)
    a, b = (functional(m, params, (ids,), None, False, method="logits")[0] for m in models)
    assert not np.allclose(a, b, atol=1e-3)


def test_the_suite_fails_a_layer_whose_decoding_skips_a_step(pytester):
    pytester.makepyfile(
        """
        import axcore
        from axcore.layers.transformer import TransformerLayer
        from axcore.testing import DecodingConformance

        class SkipsFfnWhenDecoding(TransformerLayer):
            def extend(self, x, cache, *, positions):  # The old shape of extend, minus the feed-forward.
                h, cache = self.self_attention.extend(self.attention_norm(x), cache, positions=positions)
                return x + h, cache

        class Plugin:
            @axcore.hookimpl
            def axcore_register_layers(self, register):
                register("skips_ffn", SkipsFfnWhenDecoding)

        class TestSkips(DecodingConformance):
            plugins = ("skips",)
            objects = {"skips": Plugin()}
            experiments = ("default",)
            overrides = (
                "model.decoder.layer.type=skips_ffn",
                "model.decoder.layer.self_attention.causal=true",
                "model.decoder.layer.self_attention.num_heads=2",
                "model.decoder.layer.feed_forward.hidden_dim=64",
            )
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, skipped=1)
    result.stdout.fnmatch_lines(["*KV-cache decoding differs from the full forward by up to*"])
