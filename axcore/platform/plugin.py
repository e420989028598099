"""Built-in plugin of the platform: the `default` mesh rule (one `data` axis over every device, lowest priority).

Registered under its former name `axcore.platform.mesh` (the provenance that configs and
`axcore plugins` show; `axcore.experiment.builtins`).
"""

from axcore.markers import hookimpl
from axcore.platform.mesh import DEFAULT_RULE


@hookimpl
def axcore_register_mesh_rules(register):
    register(DEFAULT_RULE)
