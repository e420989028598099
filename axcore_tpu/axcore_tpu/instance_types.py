"""TPU instance types: `tpu-<generation>-<N>[x<S>]`, parsed, and found on a TPU VM without starting JAX.

Grammar (axcore's `<platform>-<device kind>-<device count>`, with an optional slice count):

    tpu-v5p-64      one slice of 64 JAX devices (TPU chips) of TPU v5p
    tpu-v5p-64x2    two such slices (128 devices) joined over the data-center network (DCN)

- N counts JAX devices per slice, i.e. TPU chips: on v4 and v5p (megacore) JAX shows
  one device per chip, two TensorCores. This is *not* the suffix of Cloud TPU's
  accelerator types, which counts TensorCores for v4 and v5p: Cloud's `v5p-128` is
  64 chips, `tpu-v5p-64` here; `v5litepod-16` and `v6e-8` count chips and map to
  `tpu-v5e-16` and `tpu-v6e-8`. `probe_instance_type` does the conversion.
- S (default 1) is the number of slices of a multi-slice job. Mesh rules put it on the
  `data` mesh axis (data parallelism over DCN) and the XLA flags add the DCN
  collective flags for S > 1. A run's slice count is known from the instance type
  only: name it in `--mesh-selector` (`tpu-v5p-64x2`), or let the probe read it from
  MEGASCALE_NUM_SLICES.
- Generations: v4, v5e, v5p, v6e. Accepted aliases: `v5litepod` (Cloud's name of v5e),
  and the tokens JAX's device kinds give when axcore detects the instance type from
  `jax.devices()` (`device_kind_token`): "TPU v4" -> v4, "TPU v5 lite" and "TPU v5"
  -> `v5` (v5e or v5p: their rules and flags here are the same), "TPU v6 lite" -> `v6`
  (v6e). A detected type counts every device of the job, so a multi-slice job whose
  instance type is detected rather than probed or named is laid out as one slice.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
from collections.abc import Mapping

# Instance-type generation token -> the generation it names.
GENERATIONS = {"v4": "v4", "v5e": "v5e", "v5litepod": "v5e", "v5p": "v5p", "v5": "v5", "v6e": "v6e", "v6": "v6e"}
# The generations of the grammar (v5 is JAX's token for both v5e and v5p).
CANONICAL_GENERATIONS = ("v4", "v5e", "v5p", "v6e")
# Cloud accelerator-type generations whose suffix counts TensorCores (two per chip, one JAX device).
CORE_COUNTED = ("v4", "v5p")
_INSTANCE_TYPE = re.compile(r"tpu-([a-z0-9]+)-(\d+)(?:x(\d+))?")
_ACCELERATOR_TYPE = re.compile(r"([a-z0-9]+)-(\d+)")
# Device files of TPU chips: /dev/accel<N> (v4, v5e) or /dev/vfio/<N> (v5p, v6e).
DEVICE_GLOBS = ("accel*", "vfio/[0-9]*")


@dataclasses.dataclass(frozen=True)
class TpuInstance:
    """A parsed TPU instance type."""

    # Canonical generation: v4, v5e, v5p, v6e, or v5 (JAX's token for v5e and v5p).
    generation: str
    # JAX devices (chips) per slice.
    devices_per_slice: int
    # Slices joined over DCN.
    slices: int = 1

    @property
    def devices(self) -> int:
        return self.devices_per_slice * self.slices


def parse_instance_type(instance_type: str) -> TpuInstance | None:
    """The `TpuInstance` of `tpu-<generation>-<N>[x<S>]`, or None for anything else (module docstring)."""
    match = _INSTANCE_TYPE.fullmatch(instance_type)
    if match is None or match[1] not in GENERATIONS:
        return None
    devices, slices = int(match[2]), int(match[3] or 1)
    if devices < 1 or slices < 1:
        return None
    return TpuInstance(GENERATIONS[match[1]], devices, slices)


def instance_type_pattern(*tokens: str) -> str:
    """The regular expression of the instance types of these generation tokens (slice count optional)."""
    return rf"tpu-({'|'.join(tokens)})-[1-9]\d*(x[1-9]\d*)?"


def instance_type_from_accelerator_type(accelerator_type: str, slices: int = 1) -> str | None:
    """`tpu-<generation>-<chips>[x<S>]` of a Cloud TPU accelerator type like `v5p-128`, or None.

    Cloud's suffix counts TensorCores for v4 and v5p (two per chip) and chips otherwise.
    """
    match = _ACCELERATOR_TYPE.fullmatch(accelerator_type.strip().lower())
    if match is None or match[1] not in GENERATIONS or GENERATIONS[match[1]] == "v5":
        return None
    generation, count = GENERATIONS[match[1]], int(match[2])
    chips = count // 2 if generation in CORE_COUNTED else count
    if chips < 1:
        return None
    return f"tpu-{generation}-{chips}" + (f"x{slices}" if slices > 1 else "")


def jax_tpu_installed() -> bool:
    """Whether JAX's TPU runtime (the `libtpu` package, installed by `jax[tpu]`) can be imported."""
    return importlib.util.find_spec("libtpu") is not None


def tpu_devices_present(dev_root: str | os.PathLike = "/dev") -> bool:
    """Whether this host has TPU chips' device files (`/dev/accel*` or `/dev/vfio/<N>`)."""
    root = pathlib.Path(dev_root)
    return any(any(root.glob(pattern)) for pattern in DEVICE_GLOBS)


def probe_instance_type(
    environ: Mapping[str, str] = os.environ, dev_root: str | os.PathLike = "/dev", libtpu: bool | None = None
) -> str | None:
    """This host's TPU instance type, read without starting JAX, or None.

    Reads TPU_ACCELERATOR_TYPE (e.g. `v5p-128`, set on GKE TPU nodes; on a TPU VM set it
    yourself or name the instance with --mesh-selector) and MEGASCALE_NUM_SLICES (the
    slice count of a multi-slice job, set by GKE JobSets), and answers only when TPU
    chips' device files exist under `dev_root` and JAX's TPU runtime is installed
    (`libtpu`; None = look), and JAX_PLATFORMS, if set, allows tpu. Starts nothing:
    no JAX backend, no metadata-server request.
    """
    platforms = [p for p in environ.get("JAX_PLATFORMS", "").split(",") if p]
    if platforms and "tpu" not in platforms:
        return None
    accelerator_type = environ.get("TPU_ACCELERATOR_TYPE", "").strip()
    if not accelerator_type or not tpu_devices_present(dev_root):
        return None
    if not (jax_tpu_installed() if libtpu is None else libtpu):
        return None
    slices = environ.get("MEGASCALE_NUM_SLICES", "1").strip()
    return instance_type_from_accelerator_type(accelerator_type, int(slices) if slices.isdigit() else 1)
