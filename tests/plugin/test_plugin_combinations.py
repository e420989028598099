"""Feature plugins together: swiglu + alibi + remat compose; alibi and rope conflict; swiglu and moe compose."""

import re

import pytest

from axcore.config import find
from axcore.errors import ConfigError, PluginConflictError
from axcore.experiment import load_experiment
from axcore.layers import Activation, FeedForward, LearnedPositionEmbedding, MultiheadAttention, RepeatedTransformer
from axcore.testing import TINY_OVERRIDES, train_params

from axcore_alibi import AlibiBias
from axcore_swiglu import GatedFeedForward


def _swiglu_everywhere(config):
    ffns = find(config, GatedFeedForward)
    assert ffns and all(f.activation is Activation.SILU for _, f in ffns), ffns
    assert not find(config, FeedForward)  # No plain feed-forward left, experts included.
    return [path for path, _ in ffns]


def test_swiglu_alibi_remat_on_the_scan_experiment_compose_and_train():
    exp = load_experiment("scan", ["plugins=[swiglu, alibi, remat]", *TINY_OVERRIDES])
    assert _swiglu_everywhere(exp.config) == ["model.decoder.layer.feed_forward"]
    attention = find(exp.config, MultiheadAttention)
    assert attention and all(a.position_embedding.klass is AlibiBias for _, a in attention)
    assert [d.remat_policy for _, d in find(exp.config, RepeatedTransformer)] == ["nothing_saveable"]
    assert exp.config.model.position_embedding is None and not find(exp.config, LearnedPositionEmbedding)
    flat = exp.flat()
    for line in [
        "model.decoder.layer.feed_forward.type: gated_feed_forward",
        "model.decoder.layer.feed_forward.activation: silu",
        "model.decoder.layer.self_attention.position_embedding.type: alibi",
        "model.decoder.remat_policy: nothing_saveable",
        "model.position_embedding: null",
    ]:
        assert line in flat.splitlines()
    params, losses = train_params(exp)
    assert set(params["decoder"]["layer"]["feed_forward"]) == {"gate_proj", "up_proj", "down_proj"}
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("plugins", [["alibi", "rope"], ["rope", "alibi"]])
def test_alibi_and_rope_conflict(plugins):
    first, second = plugins
    pattern = rf"Plugins '{first}' and '{second}' both set config '\S*self_attention\.position_embedding\.type'"
    with pytest.raises(PluginConflictError, match=pattern) as info:
        load_experiment("scan", [f"plugins=[{first}, {second}]"])
    assert re.search(r"enable only one of them", str(info.value))


def _experts_and_dense_ffns(exp):
    paths = _swiglu_everywhere(exp.config)
    experts = [p for p in paths if p.endswith(".expert")]
    assert experts and len(experts) < len(paths), paths  # Both MoE experts and dense FFNs.
    return experts


# Where moe puts its experts: every other layer of the unrolled stack; in the scan
# experiment, the second layer of the two-layer block that the scan repeats.
EXPERTS = {
    None: ["model.decoder.layer[1].feed_forward.expert", "model.decoder.layer[3].feed_forward.expert"],
    "scan": ["model.decoder.layer.layer[1].feed_forward.expert"],
}
@pytest.mark.parametrize(
    "source, plugins",
    [
        (None, "[swiglu, moe]"),
        (None, "[moe, swiglu]"),
        ("scan", "[swiglu, moe]"),
        ("scan", "[moe, swiglu]"),
    ],
)
def test_swiglu_and_moe_give_swiglu_experts_in_either_order(source, plugins):
    # On scan, moe wraps the layer into a block: swiglu's values move deeper and stay swiglu's.
    exp = load_experiment(source, [f"plugins={plugins}"])
    assert _experts_and_dense_ffns(exp) == EXPERTS[source]
    # The built model has gated experts (abstract parameters only: nothing is allocated).
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    decoder = model.abstract_parameters()["decoder"]
    ffn = decoder["layer1"]["feed_forward"] if source is None else decoder["layer"]["layer1"]["feed_forward"]
    assert set(ffn["expert"]) == {"gate_proj", "up_proj", "down_proj"}


def test_swiglu_then_moe_carries_the_scaled_hidden_dim_to_the_experts():
    exp = load_experiment(None, ["plugins=[swiglu, moe]", f"swiglu.hidden_dim_multiplier={2 / 3}"])
    assert _experts_and_dense_ffns(exp) == EXPERTS[None]
    # moe moves the (already scaled) hidden_dim onto the MoE layer, which passes it to its experts.
    flat = exp.flat().splitlines()
    assert "model.decoder.layer[0].feed_forward.hidden_dim: 704" in flat
    assert "model.decoder.layer[1].feed_forward.type: mixture_of_experts" in flat
    assert "model.decoder.layer[1].feed_forward.hidden_dim: 704" in flat


def test_moe_then_swiglu_cannot_scale_the_experts_hidden_dim():
    # moe holds the experts' hidden_dim on the MoE layer; swiglu cannot see it, so it refuses.
    with pytest.raises(ConfigError, match=r"'model\.decoder\.layer\[1\]\.feed_forward\.expert' has no hidden_dim.*"
                                          r"plugins: \[swiglu, moe\]"):
        load_experiment(None, ["plugins=[moe, swiglu]", "swiglu.hidden_dim_multiplier=0.5"])


@pytest.mark.parametrize("plugins", ["[moe, alibi]", "[alibi, moe]", "[rope, moe]", "[moe, rope]"])
def test_moe_composes_with_position_plugins_on_scan(plugins):
    # moe's block keeps (or leaves empty for filling) the attention slots a position plugin sets.
    exp = load_experiment("scan", [f"plugins={plugins}"])
    kinds = {line.split(": ")[1] for line in exp.flat().splitlines() if "position_embedding.type" in line}
    assert kinds == {"alibi" if "alibi" in plugins else "rotary"}


def test_a_moved_component_keeps_its_owner():
    with pytest.raises(PluginConflictError, match="'rope' and 'alibi'"):
        load_experiment("scan", ["plugins=[rope, moe, alibi]"])
