"""Walking, finding and replacing config nodes by dotted path."""

import pytest

from axcore.config import find, get_path, replace, walk
from axcore.errors import ConfigError, NoMatchError, UnknownFieldError
from axcore.layers import CausalLM, FeedForward, MultiheadAttention, StackedTransformer


def _lm():
    cfg = CausalLM.default_config().set(vocab_size=16, dim=8, num_layers=4)
    cfg.decoder.layer.self_attention.num_heads = 2
    cfg.decoder.layer.feed_forward.hidden_dim = 16
    return cfg


def test_walk_yields_dotted_paths():
    paths = dict(walk(_lm()))
    assert paths["decoder.layer.self_attention.num_heads"] == 2
    assert paths["dim"] == 8
    assert "" in paths  # The root itself.


def test_walk_indexes_lists():
    cfg = _lm()
    cfg.decoder.layer = [cfg.decoder.layer.clone() for _ in range(4)]
    paths = dict(walk(cfg))
    assert paths["decoder.layer[3].self_attention.num_heads"] == 2


def test_find_by_component_class():
    found = find(_lm(), MultiheadAttention)
    assert [path for path, _ in found] == ["decoder.layer.self_attention"]


def test_replace_returns_new_tree_and_leaves_input_alone():
    cfg = _lm()
    cfg.decoder.layer = [cfg.decoder.layer.clone() for _ in range(4)]
    new = replace(cfg, MultiheadAttention, lambda path, c: c.set(num_heads=4))
    assert [c.num_heads for _, c in find(new, MultiheadAttention)] == [4, 4, 4, 4]
    assert [c.num_heads for _, c in find(cfg, MultiheadAttention)] == [2, 2, 2, 2]


def test_replace_can_swap_component_type():
    new = replace(_lm(), FeedForward, lambda path, c: StackedTransformer.default_config())
    assert new.decoder.layer.feed_forward.klass is StackedTransformer


def test_replace_with_no_match_raises_unless_allowed():
    class NotThere(MultiheadAttention):
        pass

    with pytest.raises(NoMatchError, match="NotThere"):
        replace(_lm(), NotThere, lambda p, c: c)
    assert replace(_lm(), NotThere, lambda p, c: c, allow_no_match=True) == _lm()


def test_replace_must_return_a_config():
    with pytest.raises(ConfigError, match="decoder.layer.self_attention"):
        replace(_lm(), MultiheadAttention, lambda p, c: None)


def test_predicate_match_sees_paths():
    new = replace(_lm(), lambda path, c: path == "final_norm", lambda p, c: c.set(eps=0.5))
    assert new.final_norm.eps == 0.5


def test_get_path():
    assert get_path(_lm(), "decoder.layer.feed_forward.hidden_dim") == 16
    with pytest.raises(UnknownFieldError, match="did you mean 'hidden_dim'"):
        get_path(_lm(), "decoder.layer.feed_forward.hiden_dim")


def test_remove_empties_optional_slots():
    from axcore.config import remove
    from axcore.errors import ConfigTypeError
    from axcore.layers import LearnedPositionEmbedding, RMSNorm

    new = remove(_lm(), LearnedPositionEmbedding)
    assert new.position_embedding is None and _lm().position_embedding is not None
    with pytest.raises(NoMatchError):
        remove(new, LearnedPositionEmbedding)
    assert remove(new, LearnedPositionEmbedding, allow_no_match=True) == new
    with pytest.raises(ConfigTypeError, match="final_norm"):
        remove(_lm(), lambda path, c: path == "final_norm" and isinstance(c, RMSNorm.Config))
