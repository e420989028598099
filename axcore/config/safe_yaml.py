"""A hardened YAML loader for every YAML axcore reads (experiment files, `--set` values).

`load(source, label)` parses with `HardenedLoader`, a `yaml.SafeLoader` subclass (no
Python object construction: `!!python/object` and other unknown tags are refused)
that also

- refuses input above `MAX_BYTES` before parsing (files are read at most that far);
- decodes bytes as strict UTF-8, naming the byte offset of the first bad byte;
- refuses duplicate mapping keys, naming the key and both lines;
- limits nesting depth to `MAX_DEPTH`, counting through aliases;
- limits the size of the tree the document expands to (aliases counted each time
  they are used) to `MAX_NODES`, and refuses recursive aliases, so an alias bomb
  ("billion laughs") fails before anything is expanded;
- reads `1e-4` and `3E5` as floats (YAML 1.2 floats; PyYAML follows YAML 1.1).

Every failure is a `YAMLInputError` (a ConfigError) whose message is one line:
`<label>: <problem>`.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from axcore.errors import ConfigError, one_line

MAX_BYTES = 1 << 20  # 1 MiB
MAX_DEPTH = 64
MAX_NODES = 100_000

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLInputError(ConfigError):
    """YAML input that is malformed, hostile or too large (one-line message naming its source).

    `label` names the input and `problem` says what is wrong; the message is `label: problem`.
    """

    def __init__(self, label: str, problem: str) -> None:
        super().__init__(f"{label}: {problem}")
        self.label = label
        self.problem = problem


class _Refused(Exception):
    """Raised inside the loader; `load` turns it into a YAMLInputError with the label."""


def _at(mark: Any) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


class HardenedLoader(yaml.SafeLoader):
    """yaml.SafeLoader with depth, expansion and duplicate-key limits (see the module doc)."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_NODES

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._composed = 0

    # Composition: nesting depth and node count as written (fails early), and duplicate keys.
    def compose_node(self, parent: Node | None, index: Any) -> Node:
        self._depth += 1
        self._composed += 1
        try:
            if self._depth > self.max_depth:
                raise _Refused(
                    f"nesting deeper than {self.max_depth} levels{_at(self.peek_event().start_mark)}"
                )
            if self._composed > self.max_nodes:
                raise _Refused(f"more than {self.max_nodes} nodes{_at(self.peek_event().start_mark)}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: str | None) -> MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            try:
                first = seen.get(key)
            except TypeError:  # Unhashable; the constructor reports it.
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise _Refused(f"duplicate key {key!r} at line {line} (first at line {first})")
            seen[key] = line
        return node

    # Whole document: expanded size, expanded depth and recursive aliases, before construction.
    def get_single_node(self) -> Node | None:
        node = super().get_single_node()
        if node is not None:
            self._check_expansion(node)
        return node

    def _check_expansion(self, root: Node) -> None:
        memo: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, height)
        active: set[int] = set()

        def children(node: Node) -> list[Node]:
            if isinstance(node, SequenceNode):
                return list(node.value)
            if isinstance(node, MappingNode):
                return [n for pair in node.value for n in pair]
            return []

        def visit(node: Node, depth: int) -> tuple[int, int]:
            key = id(node)
            if key in active:
                raise _Refused(f"recursive alias{_at(node.start_mark)}: a node contains itself")
            if key in memo:
                size, height = memo[key]
            else:
                if depth > self.max_depth:
                    raise _Refused(f"nesting deeper than {self.max_depth} levels through aliases{_at(node.start_mark)}")
                active.add(key)
                size, height = 1, 1
                for child in children(node):
                    child_size, child_height = visit(child, depth + 1)
                    size += child_size
                    height = max(height, child_height + 1)
                    if size > self.max_nodes:
                        raise _Refused(
                            f"expands to more than {self.max_nodes} nodes (aliases counted each time "
                            f"they are used){_at(node.start_mark)}"
                        )
                active.discard(key)
                memo[key] = (size, height)
            if depth + height - 1 > self.max_depth:
                raise _Refused(f"nesting deeper than {self.max_depth} levels through aliases{_at(node.start_mark)}")
            return size, height

        visit(root, 1)


HardenedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError):
        parts = [p for p in (e.context, e.problem) if p]
        mark = e.problem_mark or e.context_mark
        return " ".join(" ".join(parts).split()) + _at(mark)
    return one_line(e)


def decode(data: bytes, label: str) -> str:
    """`data` as strict UTF-8 (a leading BOM dropped); YAMLInputError naming the bad byte's offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YAMLInputError(
            label, f"not valid UTF-8: byte 0x{data[e.start]:02x} at byte offset {e.start} ({e.reason})"
        ) from None
    return text[1:] if text.startswith("\ufeff") else text


def load(source: str | bytes, label: str = "<yaml>") -> Any:
    """Parses one YAML document with `HardenedLoader`.

    Args:
        source: YAML text, or bytes (decoded as strict UTF-8).
        label: names the input in errors: a file path, `--set PATH`, ...

    Raises:
        YAMLInputError: one line, `<label>: <problem>`.
    """
    size = len(source)
    if size <= MAX_BYTES and isinstance(source, str):
        size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise YAMLInputError(label, f"YAML input is larger than the limit of {MAX_BYTES} bytes")
    text = decode(source, label) if isinstance(source, bytes) else source
    loader = None
    try:
        loader = HardenedLoader(text)
        return loader.get_single_data()
    except _Refused as e:
        raise YAMLInputError(label, str(e)) from None
    except yaml.YAMLError as e:
        raise YAMLInputError(label, f"invalid YAML: {_yaml_problem(e)}") from None
    except (ValueError, OverflowError, RecursionError) as e:  # e.g. a 5000-digit int, a bad date.
        raise YAMLInputError(label, f"invalid YAML value: {one_line(e)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_file(path: str | os.PathLike, label: str | None = None) -> bytes:
    """The bytes of a YAML file, read no further than `MAX_BYTES` (YAMLInputError if larger)."""
    label = os.fspath(path) if label is None else label
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise YAMLInputError(label, f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise YAMLInputError(label, f"file is larger than the limit of {MAX_BYTES} bytes for YAML input")
    return data
