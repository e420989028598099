"""axcore-neuron: AWS Trainium support for axcore (mesh rules, Neuron compiler flags, instance probe).

Installed, it is the `neuron` plugin, autoloaded where the platform is `neuron`.
"""

from axcore_neuron.compiler_flags import FLAGS_ENVIRONMENT, flags_environment, format_neuron_cc_flags, neuron_cc_flags
from axcore_neuron.instance_types import KINDS, NeuronKind, parse_instance_type, probe_neuron_instance_type
from axcore_neuron.mesh_rules import neuron_mesh_rules, remat_transformer_layers, tensor_parallel

__all__ = [
    "FLAGS_ENVIRONMENT",
    "KINDS",
    "NeuronKind",
    "flags_environment",
    "format_neuron_cc_flags",
    "neuron_cc_flags",
    "neuron_mesh_rules",
    "parse_instance_type",
    "probe_neuron_instance_type",
    "remat_transformer_layers",
    "tensor_parallel",
]
