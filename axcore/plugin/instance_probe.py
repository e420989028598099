"""This machine's instance type, found before JAX starts a backend (so XLA flags can still apply).

`probe_instance_type()` reads JAX_PLATFORMS and XLA_FLAGS for CPU runs, and otherwise
asks only the installed hardware plugins (entry points named after a platform of
`HARDWARE_PLATFORMS`) through their module-level `axcore_probe_instance_type`. No
plugin manager is built and no other plugin is imported: start-up stays cheap.
"""

from __future__ import annotations

import logging
import os
import re

from axcore.plugin.entry_points import autoload_disabled, installed_entry_points

logger = logging.getLogger(__name__)

# Platforms whose hardware plugin (the entry point of that name) may say, before JAX starts,
# whether this machine has its devices; a platform's plugin is named after it to autoload.
HARDWARE_PLATFORMS = ("gpu", "tpu", "neuron")
# CPU devices JAX creates, from XLA_FLAGS (1 when the flag is absent).
_HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _jax_platforms() -> str:
    """JAX's `jax_platforms` setting (JAX_PLATFORMS), read without starting a backend."""
    import jax  # Reading a config option starts no backend; importing JAX is deferred to the first probe.

    return jax.config.jax_platforms or ""


def probe_instance_type() -> str | None:
    """This machine's instance type, found without starting JAX's backend, or None.

    JAX_PLATFORMS naming `cpu` first gives `cpu-N` (N from the host-device-count flag);
    otherwise the installed hardware plugins (the entry points named after a platform
    of `HARDWARE_PLATFORMS`, as hardware plugins are named so that they autoload) are
    asked through `axcore_probe_instance_type`, in that order, the first non-None answer
    winning. Other plugins are never imported here (start-up stays cheap).
    Autoloading disabled (AXCORE_DISABLE_PLUGIN_AUTOLOAD) asks no plugin.

    A plugin that fails to import or whose probe raises is skipped with a warning naming
    it (the run may not use it; loading it by name reports the error).
    """
    platforms = [p for p in _jax_platforms().split(",") if p]
    if platforms and platforms[0] == "cpu":
        count = _HOST_DEVICE_COUNT.search(os.environ.get("XLA_FLAGS", ""))
        return f"cpu-{count[1] if count else 1}"
    if autoload_disabled():
        return None
    installed = installed_entry_points()
    for name in HARDWARE_PLATFORMS:
        entry_points = installed.get(name, [])
        if len(entry_points) != 1:
            continue  # None, or ambiguous (reported when the plugin is loaded by name).
        try:
            module = entry_points[0].load()
            probe = getattr(module, "axcore_probe_instance_type", None)
            found = probe() if callable(probe) else None
        except Exception as e:  # An installed plugin the run may not use: warned about by name, then skipped.
            logger.warning(
                "Plugin '%s' failed while probing the instance type (%s: %s); skipped. 'axcore plugins' "
                "shows its state; uninstall it or name the instance with --mesh-selector.",
                name,
                type(e).__name__,
                e,
            )
            continue
        if found:
            logger.debug("Plugin '%s' probed instance type %s.", name, found)
            return str(found)
    return None
