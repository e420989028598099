"""Trainium instance types `neuron-<kind>-N`, and finding this host's without starting JAX.

N counts JAX devices, i.e. *logical* NeuronCores, as for every axcore instance type
(`axcore.platform.mesh.detect_instance_type` counts `jax.devices()`). The kind is one of:

    kind   chip        cores per chip   cores per node (the largest instance)
    trn1   Trainium1   2 NeuronCore-v2  32 (trn1.32xlarge, trn1n.32xlarge)
    trn2   Trainium2   4 logical (LNC=2, 64 (trn2.48xlarge, trn2u.48xlarge)
                       the default)
    v2     = trn1: the token of the device kind JAX reports on trn1 ("NC_v2")
    v3d    = trn2: the token of "NC_v3d", a logical core of two NeuronCore-v3 (LNC=2)
    v3     Trainium2 with LNC=1 ("NC_v3"): 8 cores per chip, 128 per node

so `neuron-trn2-64` is one trn2.48xlarge, `neuron-trn1-32` one trn1.32xlarge,
`neuron-trn2-16` a quarter of a trn2.48xlarge (4 chips). The v2/v3d/v3 spellings are
what `detect_instance_type` produces on the machine itself (JAX's device kind, through
`device_kind_token`), so rules and flags accept both.

Sources: the Logical NeuronCore configuration page of the AWS Neuron documentation
(about-neuron/arch/neuron-features/logical-neuroncore-config.rst: "With LNC=2 (default),
these are grouped into 4 Logical NeuronCores", software ids NC_v3d / NC_v3, "a
Trn2.48xlarge instance presents 64 available NeuronCores"); AXLearn's Neuron flash
attention (`lnc = 2 if jax.devices()[0].device_kind == "NC_v3d" else 1`), which confirms
the device-kind string on trn2; the AWS AXLearn-on-trn2 tutorial (64 devices per node)
and AWS's trn1 launch scripts (32 devices per node). The trn1 device kind "NC_v2" is
inferred from the same naming and has not been seen on a machine.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import re
from collections.abc import Mapping

from axcore.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class NeuronKind:
    """What axcore needs to know about one kind of Trainium device."""

    # Chip generation, the compiler's --target: "trn1" or "trn2".
    target: str
    # Logical NeuronCores (JAX devices) in one node of the largest instance size.
    cores_per_node: int
    # Logical NeuronCores per chip.
    cores_per_chip: int
    # Logical NeuronCore configuration (--logical-nc-config); None where it does not apply (trn1).
    lnc: int | None


TRN1 = NeuronKind("trn1", cores_per_node=32, cores_per_chip=2, lnc=None)
TRN2 = NeuronKind("trn2", cores_per_node=64, cores_per_chip=4, lnc=2)
TRN2_LNC1 = NeuronKind("trn2", cores_per_node=128, cores_per_chip=8, lnc=1)

# Instance-type kind token -> kind. trn1/trn2 are the names users write; v2/v3d/v3 are what JAX reports.
KINDS: dict[str, NeuronKind] = {"trn1": TRN1, "v2": TRN1, "trn2": TRN2, "v3d": TRN2, "v3": TRN2_LNC1}

_INSTANCE_TYPE = re.compile(r"neuron-([a-z0-9]+)-(\d+)")


def parse_instance_type(instance_type: str) -> tuple[NeuronKind, int] | None:
    """`(kind, device count)` of `neuron-<kind>-N`, or None for any other instance type."""
    match = _INSTANCE_TYPE.fullmatch(instance_type or "")
    if match is None or match[1] not in KINDS or int(match[2]) < 1:
        return None
    return KINDS[match[1]], int(match[2])


def require_instance_type(instance_type: str, where: str) -> tuple[NeuronKind, int]:
    """`parse_instance_type`, raising a ConfigError naming `where` for anything else."""
    parsed = parse_instance_type(instance_type)
    if parsed is None:
        raise ConfigError(
            f"{where}: instance type {instance_type!r} is not a Trainium one; expected neuron-<kind>-<N> with kind "
            f"one of {', '.join(KINDS)} and N the number of (logical) NeuronCores, e.g. neuron-trn2-64."
        )
    return parsed


# -- The probe: this host's instance type, without JAX ------------------------------------

# Where the Neuron driver puts one device node per Neuron device (chip): /dev/neuron0, /dev/neuron1, ...
DEV_ROOT = "/dev"
# The EC2 instance type ("trn1.32xlarge") as the Nitro hypervisor reports it through DMI.
DMI_PRODUCT_NAME = "/sys/devices/virtual/dmi/id/product_name"
# Names the EC2 instance type where DMI is not readable (some containers); wins over DMI.
INSTANCE_TYPE_ENV = "AXCORE_NEURON_INSTANCE_TYPE"
# EC2 instance families -> Trainium generation (trn1n, trn2n, trn2u: the same chips, more network).
_EC2_FAMILY = re.compile(r"(trn1n?|trn2[a-z]?)\.[a-z0-9]+")


def _ec2_instance_type(product_name_file: str | os.PathLike, environ: Mapping[str, str]) -> str | None:
    if environ.get(INSTANCE_TYPE_ENV):
        return environ[INSTANCE_TYPE_ENV].strip().lower()
    try:
        return pathlib.Path(product_name_file).read_text(errors="replace").strip().lower()
    except OSError:  # Not readable here (no DMI, a container without /sys): the family is unknown.
        return None


def _core_count(spec: str) -> int:
    """Cores named by NEURON_RT_VISIBLE_CORES: "3", "0-15" or "0,1,4-7"."""
    count = 0
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r} is not a core range like 0-15 or 0,1,2.")
        count += int(last) - int(first) + 1 if last else 1
    return count


def probe_neuron_instance_type(
    dev_root: str | os.PathLike = DEV_ROOT,
    product_name_file: str | os.PathLike = DMI_PRODUCT_NAME,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """`neuron-<kind>-N` of this host's visible NeuronCores, or None when it is not a Trainium host.

    Reads, and starts nothing (no Neuron runtime, no JAX backend):
    - the device nodes `<dev_root>/neuron<i>`, one per chip;
    - the EC2 instance type from `AXCORE_NEURON_INSTANCE_TYPE`, else from DMI
      (`product_name_file`, e.g. "trn2.48xlarge"): trn1/trn1n -> trn1, trn2/trn2n/trn2u -> trn2;
      anything else (inf2, an unreadable file) -> None;
    - on trn2, `NEURON_LOGICAL_NC_CONFIG` (default 2): LNC=1 gives kind v3 (8 cores per chip);
    - `NEURON_RT_VISIBLE_CORES` ("0-15", "0,1"), else `NEURON_RT_NUM_CORES`, to count
      only the cores this process may use (as the Neuron runtime does).

    N counts logical NeuronCores, the devices JAX will show.
    """
    root = pathlib.Path(dev_root)
    chips = [p for p in root.glob("neuron*") if re.fullmatch(r"neuron\d+", p.name)] if root.is_dir() else []
    if not chips:
        return None
    ec2 = _ec2_instance_type(product_name_file, environ)
    family = _EC2_FAMILY.fullmatch(ec2 or "")
    if family is None:
        return None
    if family[1].startswith("trn1"):
        token, kind = "trn1", TRN1
    elif environ.get("NEURON_LOGICAL_NC_CONFIG", "2").strip() == "1":
        token, kind = "v3", TRN2_LNC1
    else:
        token, kind = "trn2", TRN2
    cores = len(chips) * kind.cores_per_chip
    if environ.get("NEURON_RT_VISIBLE_CORES", "").strip():
        cores = min(cores, _core_count(environ["NEURON_RT_VISIBLE_CORES"]))
    elif environ.get("NEURON_RT_NUM_CORES", "").strip().isdigit():
        cores = min(cores, int(environ["NEURON_RT_NUM_CORES"]))
    return f"neuron-{token}-{cores}" if cores > 0 else None


def jax_neuron_installed() -> bool:
    """Whether JAX's Neuron PJRT plugin (libneuronxla, from AWS's pip index) is installed; imports nothing."""
    for entry_point in importlib.metadata.entry_points(group="jax_plugins"):
        if "neuron" in entry_point.name or "neuron" in entry_point.value:
            return True
    return importlib.util.find_spec("libneuronxla") is not None


def probe_instance_type() -> str | None:
    """This host's Trainium instance type when JAX can use its NeuronCores, else None (no backend started)."""
    platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
    if platforms and "neuron" not in platforms:
        return None
    if not jax_neuron_installed():
        return None
    return probe_neuron_instance_type()
