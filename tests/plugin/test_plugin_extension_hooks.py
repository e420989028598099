"""A plugin adds an optimizer, a schedule, a tokenizer, a metrics writer, an experiment and a CLI
command, with no change to axcore, and each one takes effect."""

import jax
import numpy as np
import optax
import pytest

import axcore
from axcore.cli import main
from axcore.config import Configurable
from axcore.data import Split, Tokenizer, read_corpus_documents
from axcore.errors import ConfigError, PluginLoadError
from axcore.experiment import load_experiment
from axcore.observe import MetricsWriterFactory
from axcore.testing import TINY_OVERRIDES
from axcore.trainer import Optimizer, Schedule
from axcore.trainer.trainer import Trainer


class ScaledGradient(Optimizer):
    """direction = factor * gradient (stateless)."""

    class Config(Optimizer.Config):
        """Configures ScaledGradient."""

        # Multiplier on the gradient.
        factor: float = 3.0

    def transform(self):
        factor = self._config.factor

        def update(grads, state, params=None):
            return jax.tree.map(lambda g: factor * g, grads), state

        return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class Halving(Schedule):
    """The peak, halved every `every` steps after warmup."""

    class Config(Schedule.Config):
        """Configures Halving."""

        # Steps between halvings.
        every: int = 2

    def after_warmup(self, peak, num_steps):
        every = self._config.every
        return lambda step: peak * 0.5 ** (step // every)


class RecordingTokenizer(Tokenizer):
    """Bytes, recording every encode and decode."""

    calls = []
    vocab_size = 256

    def encode(self, text):
        RecordingTokenizer.calls.append(("encode", text))
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def decode(self, ids):
        ids = [int(i) for i in ids]
        RecordingTokenizer.calls.append(("decode", ids))
        return "<" + ",".join(map(str, ids)) + ">"


class ListWriter:
    def __init__(self, sink):
        self.sink = sink

    def write(self, step, metrics):
        self.sink["records"].append((step, dict(metrics)))

    def close(self):
        self.sink["closed"] = True


class ListWriterFactory(MetricsWriterFactory):
    """Collects records in `SINKS[name]`."""

    SINKS = {}

    class Config(MetricsWriterFactory.Config):
        """Configures ListWriterFactory."""

        # Key of the list the records go to.
        name: str = "default"

    def create(self, run_dir):
        sink = self.SINKS.setdefault(self._config.name, {"records": [], "closed": False, "run_dir": run_dir})
        return ListWriter(sink)


EXPERIMENT = """
name: ext_tiny
plugins: [ext]
trainer:
  learner:
    optimizer: {type: scaled_gradient, factor: 3.0}
    schedule: {type: halving, every: 2}
    learning_rate: 0.01
    weight_decay: 0.0
    max_grad_norm: null
  metrics_writers: [{type: list_writer, name: ext}]
  sample: {num_tokens: 4, temperature: 0.0}
tokenizer: {type: recording}
"""


def hello_arguments(parser):
    parser.add_argument("--name", default="world")
    parser.add_argument("--fail", action="store_true")


def hello(args):
    if args.fail:
        raise ConfigError("--fail was given; leave it out.")
    print(f"Hello, {args.name}!")
    return 3 if args.name == "three" else None


class Ext:
    @axcore.hookimpl
    def axcore_register_optimizers(self, register):
        register("scaled_gradient", ScaledGradient)

    @axcore.hookimpl
    def axcore_register_schedules(self, register):
        register("halving", Halving)

    @axcore.hookimpl
    def axcore_register_tokenizers(self, register):
        register("recording", RecordingTokenizer)

    @axcore.hookimpl
    def axcore_register_metrics_writers(self, register):
        register("list_writer", ListWriterFactory)

    @axcore.hookimpl
    def axcore_register_experiments(self, register):
        register("ext_tiny", EXPERIMENT)

    @axcore.hookimpl
    def axcore_register_commands(self, register):
        register("hello", hello, add_arguments=hello_arguments, help="greet someone")


OBJECTS = {"ext": Ext()}


def test_each_family_holds_the_plugins_component():
    regs = axcore.create_plugin_manager(["ext"], objects=OBJECTS).registries
    assert regs.optimizers["scaled_gradient"] is ScaledGradient and regs.lookup("halving") is Halving
    assert regs.tokenizers["recording"] is RecordingTokenizer and regs.metrics_writers["list_writer"] is ListWriterFactory
    assert regs.experiments.entry("ext_tiny").provenance.plugin == "ext"
    assert regs.commands["hello"].help == "greet someone"


def test_the_plugins_experiment_optimizer_schedule_writer_and_tokenizer_take_effect(tmp_path):
    RecordingTokenizer.calls.clear()
    ListWriterFactory.SINKS.clear()
    overrides = [*TINY_OVERRIDES, f"trainer.run_dir={tmp_path}", "trainer.max_steps=4", "trainer.log_every=1",
                 "trainer.eval_every=0", "trainer.checkpoint.every_n_steps=1", "trainer.checkpoint.keep_last_n=null"]
    exp = load_experiment("ext_tiny", overrides, objects=OBJECTS)
    assert exp.config.name == "ext_tiny" and "plugin 'ext'" in exp.source
    trainer = Trainer(exp)
    initial = jax.device_get(trainer.step.init_state()["params"])
    result = trainer.run()

    # The writer got one record per step (log_every=1) and was closed.
    sink = ListWriterFactory.SINKS["ext"]
    assert [step for step, _ in sink["records"]] == [1, 2, 3, 4] and sink["closed"]
    assert sink["run_dir"] == tmp_path
    # The schedule: 0.01 halved every 2 steps (the record of step s has the rate of step s - 1).
    rates = [record["train/learning_rate"] for _, record in sink["records"]]
    np.testing.assert_allclose(rates, [0.01, 0.01, 0.005, 0.005], rtol=1e-6)
    assert not list(tmp_path.glob("metrics.jsonl"))  # Only the listed writer ran.

    # The optimizer: after step 1, params = initial - 0.01 * 3 * gradient (NumPy, from an independent gradient).
    batch = next(exp.config.input.make_iterator(Split.TRAIN))
    model = exp.config.model.instantiate(name="model", registries=exp.registries)
    grads = jax.grad(lambda p: axcore.functional(model, p, (batch,), None, True)[0][0])(initial)
    store = exp.registries.checkpoint_backends["orbax"](tmp_path / "checkpoints")
    after_one, _ = store.restore(trainer.step.abstract_state(), step=1)
    store.close()
    for got, p, g in zip(jax.tree.leaves(after_one["params"]), jax.tree.leaves(initial), jax.tree.leaves(grads)):
        expected = np.asarray(p, np.float64) - 0.01 * 3.0 * np.asarray(g, np.float64)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-6)

    # The tokenizer encoded the training text (the corpus), then the prompt, and decoded the sample.
    encoded = [text for kind, text in RecordingTokenizer.calls if kind == "encode"]
    corpus = "".join(d.decode("utf-8") for d in read_corpus_documents())
    assert encoded[-1] == "The " and len(encoded[0]) > 100 and encoded[0] in corpus
    kind, ids = RecordingTokenizer.calls[-1]
    assert kind == "decode" and len(ids) == 4
    assert result.sample == "The <" + ",".join(map(str, ids)) + ">"


def test_the_plugins_experiment_is_listed_when_a_name_is_unknown():
    with pytest.raises(ConfigError, match=r"available: default, ext_tiny \(plugin ext\), llama2_7b, llama3_70b, scan, sft"):
        load_experiment("ext_tinyy", objects=OBJECTS)


def test_the_plugins_command_runs_and_its_errors_are_one_line(capsys):
    assert main(["hello", "--name", "Ada"], objects=OBJECTS) == 0
    assert capsys.readouterr().out == "Hello, Ada!\n"
    assert main(["hello", "--name", "three"], objects=OBJECTS) == 3
    capsys.readouterr()
    assert main(["hello", "--fail"], objects=OBJECTS) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hello (plugin 'ext')" in err and "leave it out" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["hello", "--nmae", "x"], objects=OBJECTS)
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert main(["helo"], objects=OBJECTS) == 2
    assert "did you mean 'hello'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "hook,args,pattern",
    [
        ("axcore_register_commands", ("train", hello), "'train' is a built-in command"),
        ("axcore_register_commands", ("bad", "not callable"), "expected a Command"),
        ("axcore_register_experiments", ("exp", "exp.yaml"), r"looks like a file name; register pathlib\.Path"),
        ("axcore_register_experiments", ("exp", 42), "expected YAML text"),
        ("axcore_register_optimizers", ("opt", optax.adam), "expected a subclass of Optimizer"),
        ("axcore_register_tokenizers", ("tok", Configurable), "expected a subclass of Tokenizer"),
        ("axcore_register_metrics_writers", ("w", ListWriter), "expected a subclass of MetricsWriterFactory"),
        ("axcore_register_schedules", ("s", optax.constant_schedule), "expected a subclass of Schedule"),
    ],
)
def test_bad_registrations_name_the_plugin(hook, args, pattern):
    class Bad:
        pass

    setattr(Bad, hook, axcore.hookimpl(lambda self, register: register(*args)))
    with pytest.raises(PluginLoadError, match=rf"plugin 'bad'.*{pattern}"):
        _ = axcore.create_plugin_manager(["bad"], objects={"bad": Bad()}).registries
