"""Built-in plugin: the `jsonl` and `tensorboard` metrics writers."""

from axcore.markers import hookimpl
from axcore.observe.factories import METRICS_WRITERS


@hookimpl
def axcore_register_metrics_writers(register):
    for name, factory in METRICS_WRITERS.items():
        register(name, factory)
