"""The train step object: an experiment's state, shardings and jitted steps, without a run.

`TrainStep(experiment)` owns the experiment's placement (`axcore.placement.Placement`:
mesh, axis rules, model, tokenizer, parameter and batch shardings, op environment), adds
the objective (`trainer.objective`) and the learner, and derives, without allocating anything:

- the train state (a plain dict, so every checkpoint backend can store it):
  `{"params", "opt_state", "step": int32 [], "prng_key": uint32 key data}`, plus
  `"objective"` when the objective keeps state (`axcore.learning.objectives`);
- its shardings (`state_shardings`): parameters by their logical axes under the mesh
  rule's `axis_rules`, optimizer and objective state like their parameter
  (`opt_state_shardings`), step and key replicated; and `batch_sharding` (batches
  `[batch, ...]` split over the mesh axes of logical axis "batch") with the data shards
  this process reads (`shard_layout`);
- `train_step(state, batch) -> (state, metrics)`: the objective's gradients (over
  `trainer.microbatches` microbatches), clipping, the optimizer update and kernel-state
  updates; its randomness is `fold_in(prng_key, step)`. `eval_step(params, batch)`: the
  objective's held-out sums. `compiled_train_step()` / `compiled_eval_step()` jit them
  with these shardings; `compile()` compiles the train step ahead on abstract inputs,
  recording the kernel each op got and refusing a step too big for the device memory.

It creates no run directory, prints nothing and talks to no other process, so
`axcore.cli.compile` builds one cheaply; the training loop (`axcore.trainer.trainer.Trainer`)
holds one. Run loading and evaluation build only the placement (no optimizer state).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from axcore.data.device_loader import DeviceLoader
from axcore.data.schema import BatchSchema
from axcore.kernels import describe_kernel_choices, record_kernel_choices
from axcore.learning.objectives import Objective
from axcore.placement.evaluate import EvalTotals, Evaluator
from axcore.placement.placement import Placement
from axcore.trainer.gradients import accumulated_gradients
from axcore.trainer.learner import (
    apply_state_updates,
    build_optimizer,
    overwrite_with_gradient_mask,
    restrict_trainable,
    trainable_mask,
)
from axcore.trainer.memory_check import check_compiled_memory

if TYPE_CHECKING:  # The trainer is given a loaded experiment; it never loads one.
    from axcore.experiment.loading import Experiment

# The train state's entry holding the objective's own state (only when it keeps one).
OBJECTIVE_STATE = "objective"


def _flatten_scalars(tree: dict, prefix: str) -> dict[str, jax.Array]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(_flatten_scalars(value, name))
        else:
            out[name] = jnp.mean(value)  # Stacked (scanned) summaries are averaged.
    return out


def opt_state_shardings(opt_state: Any, params: Any, param_shardings: Any, trainable: Any, replicated: Any) -> Any:
    """Shardings of the optimizer state: a parameter's sharding for state shaped like it, else replicated.

    State trees shaped like the parameter tree (all of it, or only the `trainable`
    leaves, as masked optimizers keep it) are matched leaf by leaf; a leaf with its
    parameter's shape (e.g. Adam's moments) is sharded like it, any other leaf (a
    count, Adafactor's factored rows) is `replicated`. Works on abstract trees
    (`jax.eval_shape` outputs) and with shardings of an `AbstractMesh`.
    """
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings), strict=True))
    masked = jax.tree.map(lambda t, p: p if t else optax.MaskedNode(), trainable, params)
    flags = jax.tree.leaves(trainable)
    like_params = {
        jax.tree.structure(params): pairs,
        jax.tree.structure(masked): [pair for pair, t in zip(pairs, flags) if t],
    }

    def is_params_like(x):
        return jax.tree.structure(x) in like_params

    def assign(x):
        if not is_params_like(x):
            return replicated
        leaves = [
            sharding if leaf.shape == param.shape else replicated
            for leaf, (param, sharding) in zip(jax.tree.leaves(x), like_params[jax.tree.structure(x)])
        ]
        return jax.tree.unflatten(jax.tree.structure(x), leaves)

    return jax.tree.map(assign, opt_state, is_leaf=is_params_like)


@dataclasses.dataclass(frozen=True)
class CompiledTrainStep:
    """`TrainStep.compile()`'s result."""

    # The jitted step that was compiled (its first call hits JAX's cache).
    step: Any
    # The compiled executable (memory_analysis, cost_analysis, as_text).
    compiled: Any
    # Seconds spent lowering and compiling.
    seconds: float
    # Op name -> the kernels it got, as `describe_kernel_choices` words them.
    kernels: dict[str, str]


class TrainStep:
    """An experiment's train state, shardings and jitted train and eval steps (module docstring)."""

    def __init__(self, experiment: Experiment, *, devices: Sequence[Any] | None = None):
        """`devices`: the devices of the mesh (`mesh.mesh_shape` over them); None = all of JAX's.

        Raises:
            ConfigError: the tokenizer has more ids than the model's vocabulary, the batch does not
                divide over the mesh, or a parameter's dims do not divide their mesh axes.
        """
        self.experiment = experiment
        self.cfg = cfg = experiment.config
        # The mesh, axis rules, model, tokenizer, parameter and batch shardings, op environment.
        self.placement = placement = Placement(experiment, devices=devices)
        self.mesh, self.axis_rules, self.model = placement.mesh, placement.axis_rules, placement.model
        self.tokenizer = placement.tokenizer
        self.batch_sharding, self.shard_layout = placement.batch_sharding, placement.shard_layout
        tcfg = cfg.trainer
        # The loss the step differentiates (axcore.learning.objectives).
        self.objective: Objective = tcfg.objective.instantiate()
        # The eval step and loop of the placement under the objective (what `axcore eval` builds alone).
        self.evaluator = Evaluator(placement, self.objective)
        # The model's specs, those learner.trainable does not match frozen.
        specs = restrict_trainable(placement.specs, tcfg.learner.trainable)
        # Whether each parameter is trainable (a tree like the parameters, of Python bools).
        self.trainable = trainable_mask(specs)
        # Whether each (non-trainable) parameter's new value is the step's gradient of it.
        self.overwrite_with_gradient = overwrite_with_gradient_mask(specs)
        self.optimizer, self.schedule = build_optimizer(tcfg.learner, specs, tcfg.max_steps)
        self.state_shardings = self._state_shardings(placement.param_shardings)

    # -- State ------------------------------------------------------------------------

    def _init_state(self, key_data: jax.Array) -> dict:
        params = self.model.initialize(jax.random.wrap_key_data(key_data))
        state = {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "step": jnp.zeros((), jnp.int32),
            "prng_key": key_data,
        }
        objective_state = self.objective.init_state(params)
        if objective_state is not None:
            state[OBJECTIVE_STATE] = objective_state
        return state

    def _state_shardings(self, param_shardings: Any) -> dict:
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        abstract = jax.eval_shape(self._init_state, jax.random.key_data(jax.random.key(0)))

        def like_params(tree):
            return opt_state_shardings(tree, abstract["params"], param_shardings, self.trainable, replicated)

        shardings = {"params": param_shardings, "opt_state": like_params(abstract["opt_state"]),
                     "step": replicated, "prng_key": replicated}
        if OBJECTIVE_STATE in abstract:
            shardings[OBJECTIVE_STATE] = like_params(abstract[OBJECTIVE_STATE])
        return shardings

    def abstract_state(self) -> dict:
        """The train state as ShapeDtypeStructs carrying their target shardings."""
        abstract = jax.eval_shape(self._init_state, jax.random.key_data(jax.random.key(0)))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, self.state_shardings
        )

    def init_state(self) -> dict:
        """The initial train state of `trainer.seed`, placed with `state_shardings`."""
        key_data = jax.random.key_data(jax.random.key(self.cfg.trainer.seed))
        return jax.jit(self._init_state, out_shardings=self.state_shardings)(key_data)

    def abstract_batch(self) -> dict:
        """One batch (`BATCH_SCHEMA` fields plus the objective's `batch_fields`, `[batch_size, seq_len]`) as
        ShapeDtypeStructs with `batch_sharding`."""
        batch = self.placement.abstract_batch()
        extra = BatchSchema(self.objective.batch_fields())
        batch.update(extra.shapes(self.cfg.input.batch_size, self.cfg.input.seq_len, self.batch_sharding))
        return batch

    # -- Steps ------------------------------------------------------------------------

    def op_environment(self):
        """Makes the mesh and axis rules visible to the kernels of ops traced inside (a context manager)."""
        return self.placement.op_environment()


    def train_step(self, state: dict, batch: dict) -> tuple[dict, dict]:
        """One optimizer step: `(state, batch) -> (new state, metrics)` (not jitted; see compiled_train_step).

        Metrics: `loss`, `grad_norm`, `learning_rate` (of the step taken), the objective's
        metrics, and `summaries/<path>` for every summary the layers recorded.
        """
        with self.op_environment():
            key = jax.random.fold_in(jax.random.wrap_key_data(state["prng_key"]), state["step"])
            owg = self.overwrite_with_gradient
            objective_state = state.get(OBJECTIVE_STATE)
            if objective_state is not None:
                objective_state = jax.lax.stop_gradient(objective_state)
            loss, metrics, summaries, state_updates, raw_grads = accumulated_gradients(
                self, state["params"], batch, key, objective_state
            )
            # Overwrite-with-gradient "gradients" are new values, not gradients: zero for the optimizer
            # (which freezes them anyway), the clipping norm and the logged gradient norm.
            grads = jax.tree.map(lambda o, g: jnp.zeros_like(g) if o else g, owg, raw_grads)
            updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            # The optimizer never touches non-trainable leaves; their new values are the step's state updates.
            params = jax.tree.map(lambda t, new, old: new if t else old, self.trainable, params, state["params"])
            params = apply_state_updates(params, state_updates, self.trainable)
            # Last (it wins over a forward state update): an overwrite-with-gradient leaf's new value is its gradient.
            params = jax.tree.map(lambda o, p, g: g.astype(p.dtype) if o else p, owg, params, raw_grads)
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        out = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": self.schedule(state["step"]),
        }
        out.update(metrics)
        out.update(_flatten_scalars(summaries, "summaries"))
        return new_state, out

    def eval_step(self, params: dict, batch: dict) -> dict:
        """`{"xent_sum", "tokens"}` of one held-out batch (the objective's `eval_sums`; not jitted)."""
        return self.evaluator.eval_step(params, batch)

    def compiled_train_step(self):
        """The jitted train step (state donated, explicit in/out shardings)."""
        return jax.jit(
            self.train_step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, None),
            donate_argnums=0,
        )

    def compiled_eval_step(self):
        """`(params, batch, totals) -> totals`, jitted: adds a batch's weighted cross-entropy and weights on device."""
        return self.evaluator.compiled_eval_step()

    def compile(self, train_step: Any = None, *, check_memory: bool | None = None) -> CompiledTrainStep:
        """Compiles `train_step` (default `compiled_train_step()`) ahead, on abstract inputs (nothing allocated).

        With `check_memory` (default `trainer.check_memory`), raises MemoryEstimateError when the
        compiled step's estimated per-device peak exceeds the device's memory.
        """
        train_step = train_step if train_step is not None else self.compiled_train_step()
        started = time.perf_counter()
        # Outside the recording: declaring the state's kernel state selects each dot site's kernel too.
        state, batch = self.abstract_state(), self.abstract_batch()
        with record_kernel_choices() as choices:
            compiled = train_step.lower(state, batch).compile()
        seconds = time.perf_counter() - started
        if self.cfg.trainer.check_memory if check_memory is None else check_memory:
            check_compiled_memory(compiled, self.mesh)
        return CompiledTrainStep(train_step, compiled, seconds, describe_kernel_choices(choices))

    # -- Evaluation -------------------------------------------------------------------

    def loader(self, pipeline: Any, where: str = "The eval split's batch") -> DeviceLoader:
        """`pipeline`'s host batches (this process's rows) as batches on the devices, with `batch_sharding`."""
        return self.placement.loader(pipeline, where)

    def evaluate(self, params: dict, loader: Any, max_batches: int | None, *, eval_step: Any = None,
                 progress: Any = None) -> EvalTotals:
        """Held-out loss of `params` over `loader`'s batches (`axcore.placement.evaluate.Evaluator.evaluate`)."""
        return self.evaluator.evaluate(params, loader, max_batches, eval_step=eval_step, progress=progress)


__all__ = ["OBJECTIVE_STATE", "CompiledTrainStep", "TrainStep", "opt_state_shardings"]
