"""The core's files form layers: no import cycle among axcore's modules, counting imports
inside functions too (a cycle dodged with a function-level import is still a cycle)."""

import ast
import pathlib

import axcore

ROOT = pathlib.Path(axcore.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    return {".".join(f.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): f for f in ROOT.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> axcore modules it imports anywhere in its body (TYPE_CHECKING blocks excluded)."""
    files = _modules()

    def target(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for name in names:
                t = target(name)
                # Importing a submodule runs its package's __init__ first; that is not an edge back.
                if t and t != mod and not (mod.startswith(t + ".") and files[t].name == "__init__.py"):
                    edges[mod].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walker_finds_a_cycle_when_there_is_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_axcore_modules():
    graph = import_graph()
    assert "axcore.plugins" in graph["axcore.experiment"]  # The walker sees real imports.
    assert cycles(graph) == []


def test_lower_layers_never_import_higher_ones():
    graph = import_graph()
    # Components (the classes hookspecs validate registrations against) sit below hookspecs.
    components = ("axcore.kernels", "axcore.layers", "axcore.mesh", "axcore.sharding", "axcore.data",
                  "axcore.observe", "axcore.checkpoint", "axcore.commands", "axcore.experiments",
                  "axcore.trainer.optimizers", "axcore.trainer.schedules", "axcore.trainer.objectives")
    order = [
        ("axcore.errors", "axcore.config", "axcore.markers"),
        ("axcore.params", "axcore.module", "axcore.registry"),
        components,
        ("axcore.hookspecs",),
        ("axcore.plugins",),
        ("axcore.experiment", "axcore.trainer"),
        ("axcore.cli",),
    ]

    def level(module):
        for i, prefixes in enumerate(order):
            if any(module == p or module.startswith(p + ".") for p in prefixes):
                return i
        return None

    wrong = []
    for module, targets in graph.items():
        here = level(module)
        if here is None or module.endswith(".plugin"):  # Built-in plugin modules sit with the manager.
            continue
        wrong += [f"{module} -> {t}" for t in targets if level(t) is not None and level(t) > here]
    assert wrong == []
