"""`axcore loc`: integration cost computed from code, and the README's copy of its table."""

import pathlib
import textwrap

import pytest

from axcore.cli import main
from axcore.loc_report import body_lines, core_reference_lines, format_table, loc_report

README = pathlib.Path(__file__).parents[1] / "README.md"
FEATURES = {"rope", "moe", "swiglu", "alibi", "remat"}


def test_body_lines_skip_docstrings_comments_and_blanks():
    def example(x):
        """Docstring
        over two lines."""
        # A comment.
        y = x + 1

        return y

    assert body_lines(example) == 2


def test_core_reference_lines_ignore_docstrings_and_comments(tmp_path):
    (tmp_path / "m.py").write_text(textwrap.dedent('''
        """Mentions widget in a docstring."""
        # widget in a comment
        import widget_pkg
        x = "widget"
        widgets = 1
    '''))
    assert core_reference_lines({"widget", "widget_pkg"}, tmp_path) == 2


@pytest.fixture(scope="module")
def rows():
    return {row.name: row for row in loc_report()}


def test_every_feature_plugin_is_installed_and_needs_no_core_line(rows):
    assert FEATURES <= set(rows)
    for name in FEATURES:
        assert rows[name].core_lines == 0, name
        assert rows[name].integration_lines > 0, name


def test_rope_integration_is_at_most_10_lines_and_touches_every_attention_layer(rows):
    assert rows["rope"].integration_lines <= 10
    # Default model: 4 attention layers + 4 rotary slots + the LM root + the removed input embedding.
    assert rows["rope"].touched["default"] == 10


def test_readme_holds_the_current_table(rows, capsys):
    assert main(["loc"]) == 0
    table = capsys.readouterr().out
    assert table == format_table(list(rows.values()))
    assert table in README.read_text(), "README's LoC table is stale: paste the output of `axcore loc`"
