"""Testing tools for plugin authors: conformance suites, tiny experiments, a pytest plugin.

    from axcore.testing import AttentionKernelConformance

    class TestMyKernel(AttentionKernelConformance):
        kernel = MyKernel()

Suites (base test classes, configured by class attributes): AttentionKernelConformance,
PositionEmbeddingConformance, CheckpointBackendConformance, ConfigTransformConformance,
DecodingConformance.
Their checks are plain functions too (`check_attention_kernel`, ...). Helpers shared by
axcore's own tests and the plugins' (each plugin's tests run from its package alone):
`TINY_OVERRIDES`, `load_tiny_experiment`, `train_steps` and `train_params` (a few SGD
steps of a tiny model), `NP_ACTIVATIONS` (NumPy activations), the
`rms_norm` op's NumPy oracle (`np_rms_norm`, `check_rms_norm`, `RMS_NORM_CASES`, ...), `run_host_device_worker`
(a script on 8 host CPU devices in a fresh process) and `host_devices_env` (its environment). The pytest plugin
(`axcore.testing.pytest_plugin`, loaded through the `pytest11` entry point) adds the
fixtures `axcore_plugin_manager`, `axcore_registries`, `axcore_tiny_experiment` and
`axcore_train_steps`. Names load lazily (PEP 562): importing this package imports
neither JAX nor pytest.
"""

from __future__ import annotations

from axcore.config.lazy import lazy_exports

_EXPORTS = {
    "axcore.testing.conformance": [
        "AttentionKernelConformance",
        "CheckpointBackendConformance",
        "ConfigTransformConformance",
        "DecodingConformance",
        "PositionEmbeddingConformance",
    ],
    "axcore.testing.decoding": [
        "check_decoding_matches_forward",
        "check_experiment_paged",
        "check_paged_matches_forward",
    ],
    "axcore.testing.attention": [
        "DEFAULT_CASES",
        "AttentionCase",
        "check_attention_kernel",
        "numpy_attention",
    ],
    "axcore.testing.training": ["TINY_OVERRIDES", "load_tiny_experiment", "train_params", "train_steps"],
    "axcore.testing.activations": ["NP_ACTIVATIONS"],
    "axcore.testing.rms_norm": [
        "RMS_NORM_CASES",
        "RMS_NORM_EPS",
        "RMS_NORM_TOLERANCE",
        "check_rms_norm",
        "np_rms_norm",
        "np_rms_norm_vjp",
        "rms_norm_case_arrays",
    ],
    "axcore.testing.devices": ["host_devices_env", "run_host_device_worker"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(globals(), _WHERE)
