"""`python -m axcore_devtools.call_walk`: the walk of a command through a small synthetic package with
three layers, whose stops and climbs are counted by hand below."""

import json
import sys
import textwrap

import pytest

from axcore_devtools.call_walk import contract_layers, layer_of, main, walk_calls

PYPROJECT = """\
[tool.importlinter]
root_package = "walkpkg"

[[tool.importlinter.contracts]]
name = "inside walkpkg.low (not the top-level contract: it has containers)"
type = "layers"
containers = ["walkpkg.low"]
layers = ["a", "b"]

[[tool.importlinter.contracts]]
name = "walkpkg layers"
type = "layers"
layers = ["walkpkg.cli", "walkpkg.mid | walkpkg.side", "walkpkg.low"]
"""

SOURCES = {
    "walkpkg/__init__.py": "",
    "walkpkg/cli.py": """
        import argparse

        from walkpkg import low, mid


        def main(argv):
            parser = argparse.ArgumentParser()
            parser.add_argument("items", nargs="*")
            args = parser.parse_args(argv)
            return mid.run(args, report)


        def report(job):
            return len(job.items)


        def main_pair(argv):
            args = argparse.Namespace(items=list(argv))
            holder, _ = mid.pair(args)
            return low.size(holder.job)
        """,
    "walkpkg/mid.py": """
        from walkpkg import low, side


        def run(args, callback):
            job = low.Job(args.items)
            side.untouched(3)
            helper(job)
            side.describe(job)
            return low.apply(job, callback)


        def helper(job):
            return low.size(job)


        class Holder:
            pass


        def pair(args):
            holder = Holder()
            holder.job = low.Job(list(args.items))  # A new list: nothing followed goes in.
            return holder, 1
        """,
    "walkpkg/side.py": """
        from walkpkg import low


        def untouched(n):
            return n


        def describe(job):
            return low.size(job)


        def add(job):
            return low.size(job) + 1
        """,
    "walkpkg/low.py": """
        import walkhelper


        class Job:
            def __init__(self, items):
                self.items = items


        def size(job):
            return len(job.items)


        def apply(job, callback):
            from walkpkg import side  # The injected side.add arrives through a foreign module.

            return callback(job) + walkhelper.call(side.add, job)
        """,
    "walkhelper.py": """
        def call(function, value):
            return function(value)
        """,
}

# By hand: mid.run(args) is a stop from cli; Job(args.items) from mid; helper -> low.size repeats (mid, low)
# and collapses; side.untouched(3) takes nothing followed; describe, then its low.size; apply; the callback
# cli.report(job) climbs from low; side.add(job), called through walkhelper, climbs from low (apply's frame)
# and descends to low.size.
STOPS = [
    ("walkpkg.cli", "walkpkg.mid"),
    ("walkpkg.mid", "walkpkg.low"),
    ("walkpkg.mid", "walkpkg.side"),
    ("walkpkg.side", "walkpkg.low"),
    ("walkpkg.mid", "walkpkg.low"),
    ("walkpkg.low", "walkpkg.cli"),
    ("walkpkg.low", "walkpkg.side"),
    ("walkpkg.side", "walkpkg.low"),
]
CLIMBS = [("walkpkg.low", "walkpkg.cli"), ("walkpkg.low", "walkpkg.side")]


@pytest.fixture
def walkpkg(tmp_path, monkeypatch):
    for path, text in SOURCES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "walkhelper" or n.split(".")[0] == "walkpkg"]:
        del sys.modules[name]


def test_the_top_level_layers_contract_is_read_with_alternatives_sharing_a_layer(walkpkg):
    layers = contract_layers(walkpkg / "pyproject.toml")
    assert layers == {"walkpkg.cli": 0, "walkpkg.mid": 1, "walkpkg.side": 1, "walkpkg.low": 2}
    assert layer_of("walkpkg.low.deep", layers) == 2 and layer_of("walkpkg", layers) is None
    assert layer_of("walkpkg.lower", layers) is None  # A prefix of the name is not its package.


def test_a_walk_counts_the_stops_and_climbs_counted_by_hand(walkpkg):
    from walkpkg.cli import main as entry

    layers = contract_layers(walkpkg / "pyproject.toml")
    walk = walk_calls(entry, [["a", "b", "c"]], root="walkpkg", layers=layers)
    assert walk.result == 3 + 4  # report(job) + side.add(job): the command itself ran unchanged.
    assert walk.stops == STOPS
    assert walk.climbs == CLIMBS
    assert walk.functions == ["run", "Job.__init__", "describe", "size", "apply", "report", "add", "size"]
    assert walk.modules == ["walkpkg.mid", "walkpkg.low", "walkpkg.side", "walkpkg.cli"]
    assert sys.getprofile() is None


def test_a_leaf_package_is_a_stop_but_not_walked_into(walkpkg):
    from walkpkg.cli import main as entry

    layers = contract_layers(walkpkg / "pyproject.toml")
    walk = walk_calls(entry, [["a"]], root="walkpkg", layers=layers, leaves=["walkpkg.side"])
    assert walk.stops == [s for s in STOPS if s != ("walkpkg.side", "walkpkg.low")]
    assert walk.climbs == CLIMBS


def test_the_command_line_prints_the_walk(walkpkg, capsys):
    argv = ["--entry", "walkpkg.cli:main", "--root", "walkpkg", "--pyproject", str(walkpkg / "pyproject.toml"),
            "--leaves", "", "--json", "--", "x", "y"]
    assert main(argv) == 2 + 3
    walk = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [tuple(s) for s in walk["stops"]] == STOPS and [tuple(c) for c in walk["climbs"]] == CLIMBS
    assert main(argv[:-4] + ["--", "x"]) == 1 + 2
    text = capsys.readouterr().out
    assert "stops: 8\nclimbs: 2\n" in text and "walkpkg.low -> walkpkg.cli: report  x1" in text


def test_a_returned_tuple_brings_its_items_attributes(walkpkg):
    from walkpkg.cli import main_pair

    layers = contract_layers(walkpkg / "pyproject.toml")
    walk = walk_calls(main_pair, [["a", "b"]], root="walkpkg", layers=layers)
    # Neither Holder() nor Job(new list) takes anything followed; the returned (holder, 1) is followed
    # item by item with their attributes, so low.size(holder.job) is.
    assert walk.result == 2
    assert walk.stops == [("walkpkg.cli", "walkpkg.mid"), ("walkpkg.cli", "walkpkg.low")]
    assert walk.functions == ["pair", "size"] and walk.climbs == []
