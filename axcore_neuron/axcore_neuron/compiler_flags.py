"""Neuron compiler (neuronx-cc) flags for `neuron-<kind>-N`, carried by NEURON_CC_FLAGS.

JAX's Neuron PJRT plugin compiles each XLA program with neuronx-cc and passes it the
options in the NEURON_CC_FLAGS environment variable (AWS Neuron documentation, "JAX
NeuronX Environment Variables"), which plays the part XLA_FLAGS plays for XLA's own
backends. The plugin names that variable through axcore's `axcore_flags_environment`
hook and answers its flags hook with these options as `{name: value}` (names without
the leading `--`; an empty value marks a switch, which the compiler takes bare,
`--name`, as `format_neuron_cc_flags` writes it):

- `target`: trn1 or trn2. neuronx-cc otherwise targets the machine it runs on, so naming
  it is what makes `axcore compile --mesh-selector neuron-trn2-64` on another host
  produce code for Trainium2.
- `model-type: transformer`: the compiler's transformer-specific optimizations; set by
  every training recipe found (NeuronX Distributed's Llama scripts, AWS's AXLearn
  launch scripts for trn1 and trn2, optimum-neuron's compile cache).
- `distribution-strategy: llm-training` (trn1 only): optimizations for distributed LLM
  training (neuronx-cc 2.11 release notes); NeuronX Distributed's Llama-3-8B script
  and AWS's AXLearn trn1 scripts set it, AWS's AXLearn tutorial for trn2 does not.
- `logical-nc-config` (trn2): 2 for trn2/v3d, 1 for v3. It must equal the runtime's
  NEURON_LOGICAL_NC_CONFIG (Logical NeuronCore configuration page); naming it keeps a
  program compiled elsewhere consistent with the instance type's device count.
- `auto-cast: none`: keep the dtypes axcore chose. The compiler's default (`matmult`)
  casts float32 matmuls to bfloat16 on its own; axcore already runs matmuls in the
  model's compute dtype and keeps norms, softmax, logits and the loss in float32 on
  purpose, so a float32 experiment stays float32. AWS's AXLearn trn2 scripts and the
  optimum-neuron trn1/trn2 caches use it, and the compiler release notes announce it
  as the future default.
- `enable-mixed-precision-accumulation`: accumulate bfloat16 operations in float32
  inside the compiler (every AXLearn-on-Neuron recipe, trn1 and trn2).
- `optlevel: 1`: the fast-compiling optimization level of AWS's AXLearn recipes; JAX
  compiles the whole train step as one program, and the compiler release notes advise
  -O1 where a large program exceeds its instruction limits.

Left out: the recipes' `--framework=XLA` (the plugin passes it), their undocumented
`--internal-*` and `--no-internal-hlo-remat` options, and `--enable-saturate-infinity`
(set by optimum-neuron's PyTorch recipes; nothing in axcore's float32 softmax needs
it). The experiment overrides any flag with `xla_flags:` (null removes one); flags
already in NEURON_CC_FLAGS win over both. None of these was run on a Trainium host here.
"""

from __future__ import annotations

from collections.abc import Mapping

from axcore_neuron.instance_types import parse_instance_type

# The environment variable the Neuron compiler reads its options from.
FLAGS_ENVIRONMENT = "NEURON_CC_FLAGS"


def neuron_cc_flags(instance_type: str) -> dict[str, str] | None:
    """The recommended neuronx-cc flags for `neuron-<kind>-N` (module docstring), None for other types."""
    parsed = parse_instance_type(instance_type)
    if parsed is None:
        return None
    kind, _ = parsed
    flags = {"target": kind.target, "model-type": "transformer"}
    if kind.target == "trn1":
        flags["distribution-strategy"] = "llm-training"
    if kind.lnc is not None:
        flags["logical-nc-config"] = str(kind.lnc)
    flags.update({"auto-cast": "none", "enable-mixed-precision-accumulation": "", "optlevel": "1"})
    return flags


def flags_environment(instance_type: str) -> str | None:
    """NEURON_CC_FLAGS for any `neuron-*` instance type, None (XLA_FLAGS) for others."""
    return FLAGS_ENVIRONMENT if (instance_type or "").startswith("neuron-") else None


def format_neuron_cc_flags(flags: Mapping[str, str]) -> str:
    """NEURON_CC_FLAGS text: `--name=value`, or a bare `--name` for an empty value (a switch)."""
    return " ".join(f"--{name}={value}" if value != "" else f"--{name}" for name, value in flags.items())
