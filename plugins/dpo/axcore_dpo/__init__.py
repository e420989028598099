"""DPO for axcore: the `dpo` objective (`axcore_dpo.objective`) and the `preference` data source (`axcore_dpo.data`)."""

from axcore_dpo.data import PreferenceError, PreferenceFiles
from axcore_dpo.objective import DPO, sequence_log_probs

__all__ = ["DPO", "PreferenceError", "PreferenceFiles", "sequence_log_probs"]
