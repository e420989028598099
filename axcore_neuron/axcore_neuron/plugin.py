"""The `neuron` plugin (entry point `neuron`): Trainium mesh rules and Neuron compiler flags.

Autoloaded where the instance type's platform is `neuron` (JAX's Neuron PJRT plugin
reports platform `neuron`, and `--mesh-selector neuron-trn2-64` selects it on any
host), or listed in `plugins:`. It has no config transform: listing it only makes its
mesh rules, modifiers and compiler flags (sent to NEURON_CC_FLAGS) available, e.g. to resolve and compile a Trainium
experiment ahead of time on a CPU machine. It registers no kernel: there is no NKI
attention kernel yet (README), so attention runs the XLA reference.

Importing it probes no device and compiles nothing: the probe reads /dev and DMI only
when axcore calls `axcore_probe_instance_type`, and the mesh-rule modifiers build the
model's parameter specs (no arrays) only when a rule is applied.
"""

from __future__ import annotations

from axcore import hookimpl

from axcore_neuron.compiler_flags import flags_environment, neuron_cc_flags
from axcore_neuron.instance_types import probe_instance_type
from axcore_neuron.mesh_rules import CONFIG_MODIFIERS, neuron_mesh_rules


@hookimpl
def axcore_register_mesh_rules(register):
    for rule in neuron_mesh_rules():
        register(rule)


@hookimpl
def axcore_register_config_modifiers(register):
    for name, factory in CONFIG_MODIFIERS.items():
        register(name, factory)


@hookimpl
def axcore_probe_instance_type():
    return probe_instance_type()


@hookimpl
def axcore_xla_flags(instance_type):
    return neuron_cc_flags(instance_type)


@hookimpl
def axcore_flags_environment(instance_type):
    return flags_environment(instance_type)
