"""Built-in plugin of the trainer: the training loop's hooks (its own, then the loss plot and the end-of-run sample)."""

from axcore.markers import hookimpl


@hookimpl
def axcore_register_loop_hooks(register):
    from axcore.trainer.builtin_hooks import BUILTIN_LOOP_HOOKS  # The loop's modules load when a loop is built.
    from axcore.trainer.callbacks import BUILTIN_CALLBACKS

    for name, hook in {**BUILTIN_LOOP_HOOKS, **BUILTIN_CALLBACKS}.items():
        register(name, hook)
