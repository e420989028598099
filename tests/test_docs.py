"""docs/: generated references stay equal to their generators, and the code the docs show runs."""

import inspect
import pathlib
import re
import sys
import tomllib
import types

import pytest

import axcore
from axcore.config import ConfigBase, InstantiableConfig, find
from axcore.experiment import ExperimentConfig
from axcore.layers import MultiheadAttention, RMSNorm
from axcore.plugin import hookspecs

from axcore_devtools.experiment_reference import experiment_reference, field_comment
from axcore_devtools.hook_reference import hook_names, hook_reference, signature_text

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
REGENERATE = "regenerate it (after pip install ./devtools): python -m axcore_devtools.{} > docs/{}"


def blocks(doc: str, language: str) -> list[str]:
    """The fenced code blocks of `language` in docs/`doc`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", (DOCS / doc).read_text(), re.S)


def block(doc: str, language: str, first_line: str) -> str:
    """The one block of `language` in docs/`doc` whose first line is `first_line`."""
    found = [b for b in blocks(doc, language) if b.splitlines()[0] == first_line]
    assert len(found) == 1, f"docs/{doc}: expected one {language} block starting {first_line!r}"
    return found[0]


def module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(compile(source, f"<docs {name}>", "exec"), mod.__dict__)  # Our own docs' code.
    return mod


# -- the hook reference ------------------------------------------------------------------


def test_hook_reference_is_up_to_date():
    assert (DOCS / "hooks.md").read_text() == hook_reference(), REGENERATE.format("hook_reference", "hooks.md")


@pytest.mark.parametrize("hook", hook_names())
def test_every_hookspec_is_documented_with_its_exact_signature(hook):
    text = (DOCS / "hooks.md").read_text()
    fn = getattr(hookspecs, hook)
    signature = signature_text(fn)
    # The exact inspect.signature, with postponed (string) annotations written unquoted.
    assert signature == hook + str(inspect.signature(fn)).replace("'", "")
    assert f"### `{hook}`\n\n```python\n{signature}\n```" in text
    assert inspect.getdoc(fn) in text


def test_hook_reference_lists_every_hookspec_and_nothing_else():
    text = (DOCS / "hooks.md").read_text()
    assert re.findall(r"^### `(\w+)`$", text, re.M) == hook_names()
    spec_names = [n for module in hookspecs.PHASES for n, f in vars(module).items()
                  if inspect.isfunction(f) and f.__module__ == module.__name__]
    assert sorted(hook_names()) == sorted(spec_names)


# -- the experiment file reference -------------------------------------------------------


def test_experiment_reference_is_up_to_date():
    text = experiment_reference()
    assert (DOCS / "experiments.md").read_text() == text, REGENERATE.format("experiment_reference", "experiments.md")


def _sections():
    """(path, config) of ExperimentConfig and each section directly below it (input, trainer, mesh, ...)."""
    root = ExperimentConfig()
    yield "", root
    for name, value in root.items():
        if isinstance(value, ConfigBase):
            yield name, value
    yield "mesh_rules[i]", ExperimentConfig.field_types()["mesh_rules"].__args__[0]()


@pytest.mark.parametrize("path, config", list(_sections()), ids=lambda v: v if isinstance(v, str) else "")
def test_experiment_reference_describes_every_field(path, config):
    text = (DOCS / "experiments.md").read_text()
    title = f"## `{path}`" if path else "## Top-level keys"
    assert title in text, f"docs/experiments.md has no section {title}"
    section = text.split(title, 1)[1].split("\n## ", 1)[0]
    for name in config.keys():
        comment = field_comment(type(config), name)
        assert comment, f"{type(config).__qualname__}.{name} has no comment (every config field has one)"
        assert f"| `{name}` |" in section and comment.replace("|", "\\|") in section, f"{path}.{name}"


def test_experiment_reference_names_the_plugin_sections():
    text = (DOCS / "experiments.md").read_text()
    assert "one top-level key per plugin" in text
    assert isinstance(ExperimentConfig().model, InstantiableConfig)


# -- getting started ---------------------------------------------------------------------


def test_getting_started_shows_the_readmes_two_commands():
    readme = (ROOT / "README.md").read_text()
    two = blocks("getting-started.md", "bash")[:2]
    for command in two:
        assert command in readme, f"docs/getting-started.md and README's 'Two commands' differ: {command!r}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert two[1].strip() in ci


def test_getting_started_experiment_resolves(tmp_path):
    file = tmp_path / "exp.yaml"
    file.write_text(block("getting-started.md", "yaml", "# exp.yaml"))
    experiment = axcore.load_experiment(str(file), ["model.dim=32", "input.seq_len=32", "input.batch_size=2"])
    assert experiment.config.name == "small-rope" and experiment.config.model.num_layers == 2
    assert experiment.config.trainer.max_steps == 50 and experiment.settings["rope"].theta == 10000.0
    source = block("getting-started.md", "yaml", "input:")
    assert "text_files" in source and "paths" in source


# -- writing a plugin --------------------------------------------------------------------


def test_the_ten_line_plugin_and_its_five_line_pyproject():
    source = block("writing-a-plugin.md", "python", "# axcore_qknorm.py")
    pyproject = block("writing-a-plugin.md", "toml", "# pyproject.toml")
    assert len([line for line in source.splitlines()[1:] if line.strip()]) <= 10
    assert len(pyproject.splitlines()[1:]) == 5
    project = tomllib.loads(pyproject)["project"]
    entry = project["entry-points"]["axcore"]
    assert entry == {"qknorm": "axcore_qknorm"} and project["name"] == "axcore-qknorm"
    plugin = module("axcore_qknorm", source)
    experiment = axcore.load_experiment(
        "default", ["plugins=[rope, qknorm]", "model.num_layers=2"], objects={"qknorm": plugin}
    )
    attentions = find(experiment.config, MultiheadAttention)
    assert attentions and all(a.q_norm.klass is RMSNorm and a.k_norm.klass is RMSNorm for _, a in attentions)
    assert "self_attention.q_norm.type: rms_norm" in experiment.flat()


def test_the_shared_qknorm_subclass_plugin_runs():
    source = block("writing-a-plugin.md", "python", "# axcore_shared_qknorm.py")
    plugin = module("axcore_shared_qknorm", source)
    import jax

    from axcore.data import Split
    from axcore.testing import load_tiny_experiment

    experiment = load_tiny_experiment(["shared_qknorm"], ["model.num_layers=1"], objects={"shared_qknorm": plugin})
    layers = find(experiment.config, MultiheadAttention)
    assert layers and all(a.klass is plugin.SharedQKNormAttention for _, a in layers)
    # A second application of the transform rebuilds the same config (replace matches subclasses).
    again = experiment.plugin_manager.transform_config(experiment.config, experiment.settings)
    assert again.model == experiment.config.model
    model = experiment.config.model.instantiate(name="model", registries=experiment.registries)
    params = model.abstract_parameters()  # Shapes only: nothing is allocated or compiled.
    assert params["decoder"]["layer0"]["self_attention"]["qk_norm"]["scale"].shape == (16,)
    batch = next(experiment.config.input.make_iterator(Split.TRAIN))
    # Traced, not compiled (cheap): the subclass's normalize_qk runs inside the model's loss and its gradient.
    loss, grads = jax.eval_shape(
        jax.value_and_grad(lambda p: axcore.functional(model, p, (batch,), None, True)[0][0]), params
    )
    assert loss.shape == () and grads["decoder"]["layer0"]["self_attention"]["qk_norm"]["scale"].shape == (16,)


def test_the_settings_hook_must_return_a_config():
    class Plugin:
        @axcore.hookimpl
        def axcore_settings_config(self):
            return {"base": 1.0}

    with pytest.raises(axcore.PluginLoadError, match=r"Plugin 'dict_settings': axcore_settings_config returned dict, not a config"):
        axcore.load_experiment("default", ["plugins=[dict_settings]"], objects={"dict_settings": Plugin()})


def test_the_position_embedding_hooks_shown_are_the_examples():
    plugin = (ROOT / "examples" / "axcore-sinusoidal" / "axcore_sinusoidal" / "plugin.py").read_text()
    layer = (ROOT / "examples" / "axcore-sinusoidal" / "axcore_sinusoidal" / "layer.py").read_text()
    shown = block("writing-a-plugin.md", "python", "@axcore.hookimpl")
    assert shown in plugin
    settings = block("writing-a-plugin.md", "python", "from typing import Annotated")
    for line in ("base: Annotated[float, Range(gt=1)] = 10000.0", "max_len: Annotated[int, Positive] | None = None"):
        assert line in settings and line in layer


def test_the_code_snippet_of_load_experiment_runs(capsys, monkeypatch):
    source = block("writing-a-plugin.md", "python", "import axcore")
    plugin = module("axcore_qknorm", block("writing-a-plugin.md", "python", "# axcore_qknorm.py"))
    monkeypatch.setitem(sys.modules, "axcore_qknorm", plugin)  # `import axcore_qknorm` finds the docs' module.
    module("snippet", source)
    assert "self_attention.q_norm.type: rms_norm" in capsys.readouterr().out


# -- writing a hardware plugin -----------------------------------------------------------


def test_the_hardware_plugin_autoloads_for_its_instance_type():
    source = block("writing-a-hardware-plugin.md", "python", "# axcore_myaccel/plugin.py")
    pyproject = tomllib.loads(block("writing-a-hardware-plugin.md", "toml", "# pyproject.toml"))
    assert pyproject["project"]["entry-points"]["axcore"] == {"myaccel": "axcore_myaccel.plugin"}
    plugin = module("axcore_myaccel.plugin", source)
    experiment = axcore.load_experiment("default", ["mesh.instance_type=myaccel-8"], objects={"myaccel": plugin})
    assert experiment.mesh_rule == "myaccel (plugin myaccel)"
    assert experiment.config.mesh.mesh_shape == (-1,) and experiment.config.xla_flags == {"xla_cpu_enable_fast_math": "false"}
    assert "# mesh rule: myaccel (plugin myaccel)" in experiment.flat()


# -- a model from a config (writing-a-plugin.md) ------------------------------------------


def test_the_model_from_a_config_snippet_runs_and_its_loss_is_the_cross_entropy(capsys):
    import jax
    import numpy as np

    snippet = module("model_from_config", block("writing-a-plugin.md", "python", "import jax, jax.numpy as jnp"))
    assert "decoder.layer.self_attention.num_kv_heads: 2" in capsys.readouterr().out
    logits, _ = axcore.functional(
        snippet.model, snippet.params, (snippet.ids,), None, False, method="logits"
    )
    logits = np.asarray(logits, np.float64)  # [2, 16, 256]; every target is id 0.
    expected = np.mean(np.log(np.exp(logits).sum(-1)) - logits[..., 0])
    assert logits.shape == (2, 16, 256) and np.isclose(float(snippet.loss), expected, rtol=1e-5)
    assert jax.tree.leaves(snippet.params)


# -- offline tokenizers (data.md) ---------------------------------------------------------


def test_the_offline_bpe_recipe_trains_a_tokenizer_that_axcore_trains_with(tmp_path, monkeypatch):
    import math

    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("axcore_tokenizers")
    from axcore.data.sources import read_corpus_documents
    from axcore.testing import TINY_OVERRIDES, train_steps

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_texts").mkdir()
    text = read_corpus_documents()[1].decode()  # One shipped novel stands for "your own text".
    (tmp_path / "my_texts" / "a.txt").write_text(text)
    monkeypatch.setattr(sys, "argv", ["train_tokenizer.py", "my_texts/a.txt"])
    module("train_tokenizer", block("data.md", "python", "# train_tokenizer.py: python train_tokenizer.py my_texts/*.txt  ->  tokenizer.json"))
    library = tokenizers.Tokenizer.from_file("tokenizer.json")  # The library's own reading of the file.
    assert library.get_vocab_size() == 4096

    (tmp_path / "bpe.yaml").write_text(block("data.md", "yaml", "# bpe.yaml"))
    experiment = axcore.load_experiment("bpe.yaml", [*TINY_OVERRIDES, "input.batch_size=2"])
    assert experiment.config.tokenizer.path == str(tmp_path / "tokenizer.json")  # Made absolute.
    tokenizer = experiment.config.tokenizer.instantiate()
    sample = text[1000:3000]
    assert list(tokenizer.encode(sample)) == library.encode(sample, add_special_tokens=False).ids
    assert tokenizer.eos_id == library.token_to_id("<|endoftext|>")
    losses = train_steps(experiment, steps=2)
    # A fresh model predicts about uniformly over the 4096 ids: a loss near ln(4096) = 8.32 nats.
    assert abs(losses[0] - math.log(4096)) < 0.5 and losses[1] < losses[0]


def test_the_imported_models_tokenizer_recipe_reads_the_imports_copy(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("axcore_tokenizers")
    import json

    from tokenizers import models, pre_tokenizers, trainers

    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "runs" / "llama" / "hf"  # Where `axcore convert hf-to-axcore HF_DIR runs/llama` puts it.
    kept.mkdir(parents=True)
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["a model's own tokenizer, kept by the import"] * 8, trainer)
    bpe.save(str(kept / "tokenizer.json"))
    (kept / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "own-model.yaml").write_text(block("data.md", "yaml", "# own-model.yaml"))
    experiment = axcore.load_experiment("own-model.yaml", ["model.dim=32", "model.num_layers=1"])
    assert experiment.config.tokenizer.path == str(kept)
    tokenizer = experiment.config.tokenizer.instantiate()
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bpe.token_to_id("<s>"), bpe.token_to_id("</s>"))
    ids = list(tokenizer.encode("the import"))
    assert ids == [bpe.token_to_id("<s>"), *bpe.encode("the import", add_special_tokens=False).ids]  # add_bos
    assert experiment.config.model.vocab_size >= bpe.get_vocab_size()


# -- timings -------------------------------------------------------------------------------

TIMES = re.compile(r"(?<![\d:])\d{1,2}:\d\d(?![\d:])")  # m:ss


def _measured():
    """{(row, column): m:ss} of benchmarks/README.md's wall-clock table, the one place the figures are measured."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    section = text.split("## Wall-clock times of the default run and the test suite", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `axcore train`"):
            rows["run"] = cells[1:3]
        elif line.startswith("| the test suite"):
            rows["suite"] = cells[1:3]
    assert set(rows) == {"run", "suite"}, section
    return rows


def test_the_run_and_suite_timings_are_one_figure_each_everywhere():
    rows = _measured()
    run_quiet, run_loaded = rows["run"]
    suite_quiet, suite_loaded = rows["suite"]
    run = f"{run_quiet} on 2 quiet CPU\ncores, {run_loaded} with the test suite running beside it"
    suite = f"{suite_quiet} on 2 quiet cores, {suite_loaded} loaded"
    for path in (ROOT / "README.md", DOCS / "getting-started.md"):
        text = path.read_text()
        flat = " ".join(text.split())
        assert " ".join(run.split()) in flat and " ".join(suite.split()) in flat, path.name
        assert sorted(TIMES.findall(text)) == sorted([run_quiet, run_loaded, suite_quiet, suite_loaded]), path.name
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert suite in pyproject and sorted(TIMES.findall(pyproject)) == sorted([suite_quiet, suite_loaded])


# -- links -------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_doc_is_linked_from_the_readme_and_links_and_anchors_resolve():
    readme = (ROOT / "README.md").read_text()
    for doc in sorted(p.name for p in DOCS.glob("*.md")):
        assert f"(docs/{doc})" in readme, f"README links no docs/{doc}"
    for page in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *DOCS.glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            path = (page.parent / target) if target else page
            assert path.exists(), f"{page.name} links a missing {target}"
            if anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name} links a missing {target}#{anchor}"


def test_the_readme_holds_what_a_user_needs_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings == ["Install and train", "Your own experiment", "Feature plugins", "Tests", "Where to go next"]
