"""Built-in plugin: the experiments shipped in `axcore/experiments/*.yaml`."""

import importlib.resources

from axcore.markers import hookimpl


@hookimpl
def axcore_register_experiments(register):
    for resource in importlib.resources.files("axcore.experiments").iterdir():
        if resource.name.endswith(".yaml"):
            register(resource.name[: -len(".yaml")], resource)
