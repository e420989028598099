"""`axcore loc`: integration cost computed from code and traced runs, and docs/integration-cost.md's copy of its tables."""

import inspect
import pathlib
import sys
import textwrap

import pytest

import axcore
from axcore.cli import main
from axcore.config import replace
from axcore.layers import RepeatedTransformer
from axcore.layers.base import BaseLayer, checkpoint_policy

import axcore_devtools.loc_report
from axcore_devtools.loc_report import (
    CoreLineTracer,
    Probe,
    body_lines,
    core_fields_written,
    core_usage,
    format_table,
    loc_report,
)

TABLES_DOC = pathlib.Path(__file__).parents[2] / "docs" / "integration-cost.md"
FEATURES = {"rope", "moe", "swiglu", "alibi", "remat", "lora"}


def test_body_lines_skip_docstrings_comments_and_blanks():
    def example(x):
        """Docstring
        over two lines."""
        # A comment.
        y = x + 1

        return y

    assert body_lines(example) == 2


def test_tracer_records_the_function_lines_that_run_under_its_root(tmp_path, monkeypatch):
    (tmp_path / "traced_example.py").write_text(textwrap.dedent('''
        def f(x):
            if x:
                return 1
            return 2
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import traced_example

    previous = sys.gettrace()
    with CoreLineTracer(tmp_path) as tracer:
        traced_example.f(True)
    assert tracer.relative() == {"traced_example.py:3", "traced_example.py:4"}  # Not the `return 2` line.
    assert sys.gettrace() is previous  # Uninstalled again.


def _line_of(fn, text):
    """`file:line` (relative to axcore/) of the line of `fn` containing `text`."""
    fn = inspect.unwrap(fn)  # Module methods are wrapped to enter their invocation context.
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    path = pathlib.Path(inspect.getsourcefile(fn)).relative_to(pathlib.Path(axcore.__file__).parent).as_posix()
    return f"{path}:{start + offset}"


def _lines_of(fn):
    """`file:line` (relative to axcore/) of every line of `fn`."""
    fn = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(fn)
    path = pathlib.Path(inspect.getsourcefile(fn)).relative_to(pathlib.Path(axcore.__file__).parent).as_posix()
    return {f"{path}:{start + i}" for i in range(len(lines))}


class SetRematPolicy:
    """A test plugin whose transform sets a core field: every scanned stack's remat_policy."""

    @axcore.hookimpl
    def axcore_transform_config(self, config):
        return replace(config, RepeatedTransformer, lambda _, c: c.set(remat_policy="dots_saveable"))


def test_a_core_line_that_runs_only_for_a_plugin_is_counted():
    usage = core_usage(["policy"], ["scan"], objects={"policy": SetRematPolicy()})["policy"]
    # RepeatedTransformer wraps its scan body in jax.checkpoint only when remat_policy is set.
    checkpoint = _line_of(RepeatedTransformer.forward, "body = jax.checkpoint(")
    assert checkpoint in usage.lines
    assert _line_of(RepeatedTransformer.forward, "x, collections = jax.lax.scan(") not in usage.lines  # Runs anyway.
    assert usage.fields == ("repeated_transformer.remat_policy",) and usage.errors == {}


def _probe(values, lists=(), labels=None):
    values = {p: frozenset(v) for p, v in values.items()}
    return Probe(frozenset(), values, frozenset(lists), labels or {"": "ExperimentConfig", "model": "causal_lm"})


def test_core_fields_written_name_a_replaced_component_by_its_slot():
    labels = {"": "ExperimentConfig", "model": "causal_lm", "model.decoder": "repeated_transformer"}
    before = _probe({"model.decoder.type": {"repeated_transformer"}, "model.decoder.remat_policy": {None},
                     "model.decoder.layer.type": {"transformer_layer"}, "model.decoder.layer.dim": {8},
                     "plugins": {"[]"}}, labels=labels)
    after = _probe({"model.decoder.type": {"repeated_transformer"}, "model.decoder.remat_policy": {"dots_saveable"},
                    "model.decoder.layer.type": {"stacked_transformer"}, "model.decoder.layer.layer.type": {"x"},
                    "model.decoder.layer.layer.dim": {8}, "plugins": {"['p']"}},
                   lists={"model.decoder.layer.layer"}, labels=labels)
    # The slot once (not what the new component holds), the changed value, and not `plugins`.
    assert core_fields_written(before, after) == {"repeated_transformer.layer", "repeated_transformer.remat_policy"}
    assert core_fields_written(before, before) == set()


@pytest.fixture(scope="module")
def report():
    return loc_report()


@pytest.fixture(scope="module")
def rows(report):
    return {row.name: row for row in report}


@pytest.mark.slow
def test_every_feature_plugin_is_installed_and_integrates_through_a_transform(rows):
    assert FEATURES <= set(rows)
    for name in FEATURES:
        assert rows[name].integration_lines > 0, name


@pytest.mark.slow
def test_swiglu_needs_no_core_line_and_remat_one_core_mechanism(rows):
    # swiglu's gated layer lives in the plugin; it only fills the core's feed-forward slot.
    assert rows["swiglu"].core_lines == frozenset()
    assert rows["swiglu"].core_mechanisms == ("transformer_layer.feed_forward",)
    # remat sets a generic core field; what runs only for it is the line that field switches on and
    # the core's reading of the policy name (BaseLayer's check and `checkpoint_policy`).
    assert rows["remat"].core_mechanisms == ("repeated_transformer.remat_policy",)
    body = _line_of(RepeatedTransformer.forward, "body = jax.checkpoint(")
    assert body in rows["remat"].core_lines
    assert rows["remat"].core_lines - {body} <= _lines_of(BaseLayer.__init__) | _lines_of(checkpoint_policy)


@pytest.mark.slow
def test_rope_integration_is_at_most_10_lines_and_touches_every_attention_layer(rows):
    assert rows["rope"].integration_lines <= 10
    # Default model: 4 attention layers + 4 rotary slots + the LM root + the removed input embedding.
    assert rows["rope"].touched["default"] == 10
    assert "multihead_attention.position_embedding" in rows["rope"].core_mechanisms


@pytest.mark.slow
def test_the_integration_cost_doc_holds_the_current_tables(report, capsys, monkeypatch):
    monkeypatch.setattr(axcore_devtools.loc_report, "loc_report", lambda: report)  # Computed once.
    assert main(["loc"]) == 0
    table = capsys.readouterr().out
    assert table == format_table(report) and "| model family |" in table  # Both tables.
    assert table in TABLES_DOC.read_text(), "docs/integration-cost.md's tables are stale: paste the output of `axcore loc`"


@pytest.mark.slow
def test_model_family_rows_name_the_core_mechanisms_each_family_uses():
    from axcore.layers.attention import MultiheadAttention

    from axcore_devtools.family_loc import family_report

    rows = {row.model_type: row for row in family_report()}
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(rows)
    assert rows["qwen2"].plugin == "qwen" and rows["qwen2"].hook_lines == 2
    assert {"multihead_attention.qkv_bias", "stacked_transformer.layer_types"} <= set(rows["qwen2"].core_mechanisms)
    assert {"multihead_attention.q_norm", "causal_lm.lm_head"} <= set(rows["qwen3"].core_mechanisms)
    assert "multihead_attention.qkv_bias" not in rows["qwen3"].core_mechanisms  # Released Qwen3: no biases.
    assert "multihead_attention.sliding_window" in rows["mistral"].core_mechanisms
    # Only Qwen2's example has biases: the line declaring them runs for it alone.
    assert _line_of(MultiheadAttention._bias_specs, 'specs["bq"]') in rows["qwen2"].core_lines
    assert rows["llama"].core_lines == frozenset()


def test_loc_without_the_developer_tools_names_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "axcore_devtools.loc_report", None)  # As if axcore-devtools were absent.
    assert main(["loc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "axcore-devtools" in err and "pip install ./devtools" in err, err
