"""Compiler flags for TPUs, per generation, and where they go (LIBTPU_INIT_ARGS).

TPU compiler flags are read by libtpu from the LIBTPU_INIT_ARGS environment variable
when the TPU backend starts, not from XLA_FLAGS (the CPU/GPU XLA flag parser aborts on
TPU flag names); the plugin's `axcore_flags_environment` hook says so for `tpu-*`
instance types.

Flags for `tpu-<generation>-<N>[x<S>]` (`axcore_tpu.instance_types`):

- v5e, v5p, v6e (and `v5`, JAX's token for v5e/v5p): the two bundles every dense-model
  recipe of MaxText's benchmarks sets on these generations
  (AI-Hypercomputer/maxtext, `benchmarks/xla_flags_library.py`, used by
  `benchmarks/maxtext_v5e_model_configs.py`, `maxtext_v5p_model_configs.py` and
  `maxtext_trillium_model_configs.py`):
  - CF_FOR_ALL_GATHER, continuation fusion of all-gathers (overlapping fsdp's parameter
    all-gathers with compute): `xla_tpu_enable_async_collective_fusion`,
    `xla_tpu_enable_async_collective_fusion_fuse_all_gather`,
    `xla_tpu_enable_async_collective_fusion_multiple_steps`,
    `xla_tpu_overlap_compute_collective_tc`, `xla_enable_async_all_gather`, all true;
  - DATA_PARALLEL_OVERLAP, pipelining data-parallel all-reduces with the backward
    pass: `xla_tpu_enable_data_parallel_all_reduce_opt`,
    `xla_tpu_data_parallel_opt_different_sized_ops`, both true.
- v6e adds MaxText's DENSE_VMEM_LIMIT_FLAG, `xla_tpu_scoped_vmem_limit_kib=98304`
  (AXLearn's v6e defaults set the same value).
- v4 (MaxText has no v4 recipes): AXLearn's v4 defaults
  (apple/axlearn, `axlearn/common/compiler_options.py`, `default_xla_options`):
  `xla_enable_async_all_gather` and `xla_enable_async_collective_permute`, true
  (enabled by default from v5 on).
- S > 1 slices, any generation: AXLearn's multi-slice options, for collectives over
  DCN: `xla_tpu_enable_megascale_barrier`,
  `xla_tpu_enable_data_parallel_all_reduce_opt`,
  `xla_tpu_data_parallel_opt_different_sized_ops` (gradient all-reduces overlapping
  the next layer's gradient computation) and
  `xla_tpu_enable_sunk_dcn_allreduce_done_with_host_reduction` (fewer DCN
  all-reduce stages), all true.

Nothing here has been measured by this package (no TPU was available to it): these are
the published recipes' settings. The user overrides any flag with the experiment's
`xla_flags:` (null removes it) or by setting it in LIBTPU_INIT_ARGS, which wins.
"""

from __future__ import annotations

from axcore_tpu.instance_types import parse_instance_type

# The environment variable libtpu reads its flags from.
FLAGS_ENVIRONMENT = "LIBTPU_INIT_ARGS"

CONTINUATION_FUSION_FOR_ALL_GATHER = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}
DATA_PARALLEL_OVERLAP = {
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
}
V6E_SCOPED_VMEM_LIMIT = {"xla_tpu_scoped_vmem_limit_kib": "98304"}
V4_ASYNC_COLLECTIVES = {"xla_enable_async_all_gather": "true", "xla_enable_async_collective_permute": "true"}
MULTISLICE = {
    "xla_tpu_enable_megascale_barrier": "true",
    **DATA_PARALLEL_OVERLAP,
    "xla_tpu_enable_sunk_dcn_allreduce_done_with_host_reduction": "true",
}


def tpu_xla_flags(instance_type: str) -> dict[str, str] | None:
    """The recommended flags for a `tpu-*` instance type (module docstring), None for other instance types."""
    instance = parse_instance_type(instance_type)
    if instance is None:
        return None
    if instance.generation == "v4":
        flags = dict(V4_ASYNC_COLLECTIVES)
    else:
        flags = {**CONTINUATION_FUSION_FOR_ALL_GATHER, **DATA_PARALLEL_OVERLAP}
        if instance.generation == "v6e":
            flags.update(V6E_SCOPED_VMEM_LIMIT)
    if instance.slices > 1:
        flags.update(MULTISLICE)
    return dict(sorted(flags.items()))


def flags_environment(instance_type: str) -> str | None:
    """LIBTPU_INIT_ARGS for every `tpu-*` instance type (libtpu reads it whatever the generation), else None."""
    return FLAGS_ENVIRONMENT if instance_type.startswith("tpu-") else None
