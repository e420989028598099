"""The placement object: an experiment's model laid out on its mesh, without an optimizer or a run.

`Placement(experiment)` builds what every use of a model needs, training or not:

- the mesh (`mesh.mesh_shape` over the devices) and the logical -> mesh axis rules
  (`mesh.axis_rules` over `axcore.platform.sharding.DEFAULT_AXIS_RULES`);
- the model (`experiment.config.model` instantiated as "model") and the tokenizer
  (checked against the model's vocabulary);
- the parameter specs (`model.parameter_specs()`) and their shardings
  (`param_shardings`: each parameter by its logical axes under the axis rules);
  `abstract_params()` (ShapeDtypeStructs with those shardings, nothing allocated),
  `init_params(seed)` and `restore_params(backend, step)` (a partial restore of
  `{"params": ...}`: a train-state checkpoint's optimizer state is never read);
- the batch layout: `batch_sharding` (batches `[batch, ...]` split over the mesh axes of
  logical axis "batch"), the data shards this process reads (`shard_layout`),
  `abstract_batch()` and `loader(pipeline)`;
- the op environment (`op_environment()`): the mesh and axis rules the kernels of ops
  traced inside see.

The train step (`axcore.trainer.step.TrainStep`) owns one and adds the objective, the
learner (optimizer, trainable mask) and the compiled steps; run loading, `axcore eval`,
`axcore generate` and the exporters use a placement alone, so they never build an
optimizer or its state. It creates no run directory, prints nothing and talks to no
other process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from axcore.checkpoint import restore_verified
from axcore.data.device_loader import DeviceLoader, shard_layout
from axcore.data.schema import BATCH_SCHEMA
from axcore.errors import ConfigError
from axcore.kernels import op_environment
from axcore.platform.sharding import batch_sharding, check_batch_size, make_mesh, parameter_shardings, resolve_rules

if TYPE_CHECKING:  # A placement is given a loaded experiment; it never loads one.
    from axcore.experiment.loading import Experiment


class Placement:
    """An experiment's mesh, model, tokenizer, parameter and batch shardings and op environment (module docstring)."""

    def __init__(self, experiment: Experiment, *, devices: Sequence[Any] | None = None):
        """`devices`: the devices of the mesh (`mesh.mesh_shape` over them); None = all of JAX's.

        Raises:
            ConfigError: the tokenizer has more ids than the model's vocabulary, the batch does not
                divide over the mesh, or a parameter's dims do not divide their mesh axes.
        """
        self.experiment = experiment
        self.cfg = cfg = experiment.config
        self.mesh = make_mesh(cfg.mesh.mesh_shape, cfg.mesh.mesh_axis_names, devices)
        # Logical -> mesh axes: the mesh rule's axis_rules over axcore.platform.sharding.DEFAULT_AXIS_RULES.
        self.axis_rules = resolve_rules(cfg.mesh.axis_rules)
        self.model = cfg.model.instantiate(name="model", registries=experiment.registries)
        BATCH_SCHEMA.check_accepted(self.model.accepted_batch_fields(), f"model ({type(self.model).__name__})")
        # Tokenizes text sources (and prompts); checked against the model's vocabulary.
        self.tokenizer = cfg.tokenizer.instantiate()
        model_vocab = cfg.model.vocab_size if "vocab_size" in cfg.model.keys() else None
        if isinstance(model_vocab, int) and self.tokenizer.vocab_size > model_vocab:
            raise ConfigError(
                f"The tokenizer ({type(self.tokenizer).__name__}) has {self.tokenizer.vocab_size} token ids but "
                f"model.vocab_size is {model_vocab}; set model.vocab_size to at least {self.tokenizer.vocab_size}."
            )
        # The model's parameter specs (a tree of ParamSpec: shape, dtype, logical axes, initializer).
        self.specs = self.model.parameter_specs()
        check_batch_size(cfg.input.batch_size, self.mesh, self.axis_rules)
        self.batch_sharding = batch_sharding(self.mesh, self.axis_rules)
        # The data shards this process reads (ConfigError when input.data_shards does not fit the layout).
        self.shard_layout = shard_layout(self.batch_sharding, (cfg.input.batch_size, cfg.input.seq_len),
                                         cfg.input.data_shards)
        # A NamedSharding per parameter; raises ConfigError naming a parameter whose dims do not divide their mesh axes.
        self.param_shardings = parameter_shardings(self.specs, self.axis_rules, self.mesh)

    # -- Parameters -------------------------------------------------------------------

    def abstract_params(self) -> Any:
        """The parameter tree as ShapeDtypeStructs carrying `param_shardings` (nothing is allocated)."""
        abstract = jax.eval_shape(self.model.initialize, jax.random.key(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                            self.param_shardings)

    def init_params(self, seed: int) -> Any:
        """The model's initial parameters from `jax.random.key(seed)`, placed with `param_shardings`."""
        key_data = jax.random.key_data(jax.random.key(seed))
        return jax.jit(lambda k: self.model.initialize(jax.random.wrap_key_data(k)),
                       out_shardings=self.param_shardings)(key_data)

    def restore_params(self, backend: Any, step: int | None = None, report: Callable[[str], None] = print
                       ) -> tuple[Any, int]:
        """`(params, step)`: the parameters of checkpoint `step` of `backend` (None: the latest step that verifies,
        see `axcore.checkpoint.restore_verified`), placed with `param_shardings`. Only `{"params": ...}` is read
        (a partial restore): a train-state checkpoint's optimizer state is never read nor held in memory.

        Raises:
            CheckpointError (and its subclasses): no such step, a step that fails verification, or
                parameters whose shapes or dtypes differ from the model's.
        """
        state, _, restored = restore_verified(backend, {"params": self.abstract_params()}, step, report=report,
                                              partial=True)
        return state["params"], int(restored)

    # -- Batches and ops --------------------------------------------------------------

    def abstract_batch(self) -> dict:
        """One batch (`BATCH_SCHEMA` fields, `[batch_size, seq_len]`) as ShapeDtypeStructs with `batch_sharding`."""
        return BATCH_SCHEMA.shapes(self.cfg.input.batch_size, self.cfg.input.seq_len, self.batch_sharding)

    def loader(self, pipeline: Any, where: str = "The eval split's batch") -> DeviceLoader:
        """`pipeline`'s host batches (this process's rows) as batches on the devices, with `batch_sharding`."""
        shape = (self.cfg.input.batch_size, self.cfg.input.seq_len)
        return DeviceLoader(pipeline, self.batch_sharding, shape, local_rows=self.shard_layout.local_rows, where=where)

    def op_environment(self):
        """Makes the mesh and axis rules visible to the kernels of ops traced inside (a context manager)."""
        return op_environment(self.mesh, self.axis_rules, instance_type=self.cfg.mesh.instance_type)


__all__ = ["Placement"]
