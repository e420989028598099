"""The dpo plugin: registers the `dpo` objective and the `preference` data source.

`plugins: [dpo]` with `trainer.objective: {type: dpo, beta: 0.1}` and `input.source: {type:
preference, paths: [...]}`. Its transform edits nothing; it refuses, in one line, input
settings that would break the (chosen, rejected) row pairs the objective reads, and
evaluations during training (`trainer.eval_every` > 0): the source holds nothing out, so
they would have nothing to evaluate.
"""

from __future__ import annotations

import axcore
from axcore.config import is_config_of

from axcore_dpo.data import PreferenceFiles
from axcore_dpo.objective import DPO, DpoError

# What keeps each (chosen, rejected) pair in consecutive rows of one batch: input field -> value.
PAIRED_ROWS = {"packing": "none", "shuffle": False, "long_documents": "error"}


@axcore.hookimpl
def axcore_register_objectives(register):
    register("dpo", DPO)


@axcore.hookimpl
def axcore_register_data_sources(register):
    register("preference", PreferenceFiles)


@axcore.hookimpl
def axcore_transform_config(config):
    if not is_config_of(config.trainer.objective, DPO):
        return config
    for field, wanted in PAIRED_ROWS.items():
        value = getattr(config.input, field)
        if getattr(value, "value", value) != wanted:
            raise DpoError(
                f"'input.{field}' is {getattr(value, 'value', value)!r}, but the dpo objective reads rows in "
                f"(chosen, rejected) pairs; set input.{field}: {str(wanted).lower()}."
            )
    fraction = getattr(config.input.source, "eval_fraction", 0.0)
    if fraction:
        raise DpoError(f"'input.source.eval_fraction' is {fraction}, but the held-out rule picks single documents "
                       f"and would split (chosen, rejected) pairs; set it to 0 (evaluate on another file).")
    if config.trainer.eval_every:
        raise DpoError(f"'trainer.eval_every' is {config.trainer.eval_every}, but the dpo objective's preference "
                       f"source holds out nothing (its eval_fraction is 0, to keep the pairs), so there is nothing "
                       f"to evaluate on; set trainer.eval_every: 0.")
    if config.input.data_shards not in (None, 1) or config.input.mixture is not None:
        raise DpoError("The dpo objective reads rows in (chosen, rejected) pairs: use one data shard "
                       "(input.data_shards: 1) and one source (no input.mixture).")
    return config
