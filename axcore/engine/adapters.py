"""Per-request adapters (e.g. LoRA) resident in the engine, loaded without naming the plugin that provides them.

The engine holds N adapters at once: its parameters stack every adapter's per-site state
on a slot axis (slot 0 = no adapter, the base), a request names its adapter
(`GenerationRequest.adapter`, None = the base), and each row of a step carries its slot
to the model call (`ModelRunner.step(adapters=...)`, `axcore.kernels.adapter_rows`), so
rows of different adapters and base rows share ONE model call.

How the stacked model comes to be is the adapter plugin's: a kernel registered by it
(in the registries of an adapter run) provides

    stack_adapters(base: LoadedModel, adapters: dict[str, LoadedModel]) -> (model, params)

which returns the model whose kernels gather each row's slot and its parameter tree (the
base's weights plus the adapters stacked in the order of `adapters`: slot i + 1 is the
i-th). `axcore.inference.load_adapters` loads the adapter runs, finds that kernel (`find_stacker`)
and calls it; axcore never imports the plugin.
"""

from __future__ import annotations

from typing import Any

from axcore.errors import AxcoreError

# The hook a kernel provides to stack adapters for the engine (module docstring).
STACK = "stack_adapters"


class AdapterLoadError(AxcoreError, ValueError):
    """An adapter given to the engine (`--lora NAME=PATH`) cannot be served; names it and what to do."""


def parse_adapters(specs: list[str] | tuple[str, ...], base_name: str | None = None) -> dict[str, str]:
    """`{name: path}` of `--lora NAME=PATH` strings, in order; `AdapterLoadError` for a malformed or repeated one."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise AdapterLoadError(f"--lora {spec!r} is not NAME=PATH; give e.g. --lora sql=runs/sql-lora.")
        if name in adapters or name == base_name:
            raise AdapterLoadError(f"--lora {spec!r}: the name {name!r} is taken (by another --lora or the base "
                                   "model); give each adapter its own name.")
        adapters[name] = path
    return adapters


def check_names(base_name: str, adapters: Any) -> tuple[str, ...]:
    """The adapter names as a tuple; `AdapterLoadError` if one repeats, is empty or is the base model's name."""
    names = tuple(adapters)
    for name in names:
        if not isinstance(name, str) or not name or name == base_name or names.count(name) > 1:
            raise AdapterLoadError(f"adapter name {name!r} is empty, repeated or the base model's ({base_name!r}); "
                                   "give each adapter its own name.")
    return names


def find_stacker(registries: Any) -> Any:
    """The registered kernel (of any op) providing `stack_adapters`, or None."""
    kernels = registries.kernels
    for op in kernels.ops():
        for kernel in kernels.candidates(op):
            if callable(getattr(kernel, STACK, None)):
                return kernel
    return None
