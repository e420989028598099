"""lm-eval's `axcore` model against its `hf` model on the same tiny random transformers Llama.

A byte-level BPE tokenizer (trained here, offline) is saved with the transformers model; the
import (`hf_to_axcore`) makes it the run's tokenizer, so both models see the same text. The
tasks are written by the test (YAML + JSONL in tmp_path): nothing is downloaded.
"""

import json
import sys

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("axcore_tokenizers")
axcore_hf = pytest.importorskip("axcore_hf")

from lm_eval.tasks import TaskManager  # noqa: E402

from axcore.cli import main  # noqa: E402
from axcore.inference.lm_eval_model import register  # noqa: E402

TOLERANCE = 1e-4
DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "idea"], "label": 0},
    {"question": "Water is", "choices": ["wet", "dry and hot", "a number"], "label": 0},
    {"question": "One, two,", "choices": [" three", "four", "blue"], "label": 0},
    {"question": "Sky color: ", "choices": ["blue", "green", "loud"], "label": 1},
    {"question": "Fish live in", "choices": ["water", "trees", "the sky"], "label": 2},
    {"question": "Night follows", "choices": ["day", "lunch", "Tuesday"], "label": 0},
]
PROMPTS = [{"prompt": "The cat sat on", "target": "x"}, {"prompt": "Night follows day and", "target": "y"}]


def _tokenizer(path):
    """A byte-level BPE (the 256 bytes, `</s>`, a few merges from DOCS' words) saved for transformers and axcore."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["</s>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([d["question"] + " " + " ".join(d["choices"]) for d in DOCS] * 4, trainer)
    bpe.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 64}))
    return bpe.get_vocab_size()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF dir, imported run dir, tasks dir) of a tiny random Llama (2 layers, dim 32, GQA) with its tokenizer."""
    root = tmp_path_factory.mktemp("lmeval")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    vocab = _tokenizer(hf_dir)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-5, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3)
    model.eval().save_pretrained(hf_dir)
    axcore_hf.hf_to_axcore(hf_dir, root / "run", seq_len=32)
    tasks = root / "tasks"
    tasks.mkdir()
    _write_tasks(tasks, root / "cache")
    return hf_dir, root / "run", tasks, model


def _write_tasks(tasks, cache):
    """A 6-document multiple-choice task and a 2-document generation task (local JSONL, no download)."""
    (tasks / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in PROMPTS))
    common = "dataset_path: json\ntest_split: test\n"
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        f"  cache_dir: {cache}\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        f"doc_to_choice: '{{{{choices}}}}'\ndoc_to_target: '{{{{label}}}}'\nmetric_list:\n  - metric: acc\n")
    (tasks / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        f"  cache_dir: {cache}\noutput_type: generate_until\ndoc_to_text: '{{{{prompt}}}}'\n"
        f"doc_to_target: '{{{{target}}}}'\ngeneration_kwargs:\n  until: ['e']\n  max_gen_toks: 12\n"
        f"  do_sample: false\nmetric_list:\n  - metric: exact_match\n")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _evaluate(model, tasks, task="tiny_mc"):
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True,
                                   bootstrap_iters=0)


def _per_choice(results, task="tiny_mc"):
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return np.array([[r[0] for r in s["filtered_resps"]] for s in samples]), [s["acc"] for s in samples]


@pytest.fixture(scope="module")
def hf_results(tiny):
    """lm-eval's `hf` model (HFLM on CPU, float32) on tiny_mc, from the saved transformers directory."""
    from lm_eval.models.huggingface import HFLM

    hf_dir, _, tasks, _ = tiny
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        return _evaluate(HFLM(pretrained=str(hf_dir), device="cpu", batch_size=4, dtype="float32"), tasks)


def test_axcore_model_gives_the_hf_models_per_document_loglikelihoods(tiny, hf_results):
    _, run, tasks, _ = tiny
    ours_lls, ours_acc = _per_choice(_evaluate(register()(run=str(run), batch_size=4), tasks))
    theirs_lls, theirs_acc = _per_choice(hf_results)
    assert ours_lls.shape == (6, 3)
    assert np.abs(ours_lls - theirs_lls).max() < TOLERANCE, (ours_lls, theirs_lls)
    assert ours_acc == theirs_acc
    # The random model does not always prefer the first choice: the comparison sees differing rankings.
    assert len({int(np.argmax(row)) for row in theirs_lls}) > 1


def test_eval_command_runs_the_task_and_writes_its_accuracy(tiny, hf_results, tmp_path, capsys):
    _, run, tasks, _ = tiny
    out = tmp_path / "results.json"
    args = ["eval", str(run), "--tasks", "tiny_mc", "--include-path", str(tasks), "--output", str(out)]
    assert main([*args, "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    accuracy = json.loads(out.read_text())["results"]["tiny_mc"]["acc,none"]
    assert accuracy == hf_results["results"]["tiny_mc"]["acc,none"]
    row = next(line for line in printed.splitlines() if line.startswith("|tiny_mc"))
    assert float(row.split("|")[7]) == pytest.approx(accuracy, abs=1e-4)


def test_eval_command_refuses_unknown_tasks_and_a_missing_harness(tiny, monkeypatch, capsys):
    _, run, tasks, _ = tiny
    args = ["eval", str(run), "--tasks", "tiny_mcq", "--include-path", str(tasks)]
    import axcore.inference.lm_eval_tasks as lm_eval_tasks

    # Over the local tasks alone (lm-eval's 15,000 built-in task files take half a minute to index).
    monkeypatch.setattr(lm_eval_tasks, "task_manager", lambda names, path: TaskManager(
        include_path=str(path), include_defaults=False))
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Unknown lm-eval task 'tiny_mcq'" in err and "did you mean 'tiny_mc'" in err and "\n" not in err
    assert main(["eval", str(run), "--tasks", "tiny_mc", "--max-batches", "2"]) == 2
    assert "--max-batches sets the held-out loss" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # As if not installed: its import fails.
    assert main(["eval", str(run), "--tasks", "tiny_mc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'axcore[lm-eval]'" in err and "\n" not in err


def test_generate_until_is_transformers_greedy_generate_cut_at_the_stop(tiny, tmp_path):
    hf_dir, run, tasks, model = tiny
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = []
    for doc in PROMPTS:
        ids = torch.tensor([tokenizer.encode(doc["prompt"])])
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        texts.append(tokenizer.decode(new))
    # The stop string: a printable character inside the first continuation, so the cut is seen.
    stop = next(c for c in texts[0][2:] if c.isascii() and c.isprintable() and c != " ")
    (tmp_path / "tiny_gen.yaml").write_text((tasks / "tiny_gen.yaml").read_text().replace(
        "until: ['e']", f"until: [{json.dumps(stop)}]"))
    results = _evaluate(register()(run=str(run), batch_size=2), tmp_path, task="tiny_gen")
    samples = sorted(results["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    outputs = [sample["filtered_resps"][0] for sample in samples]
    assert outputs == [text.split("</s>")[0].split(stop)[0] for text in texts]
    assert 2 <= len(outputs[0]) < len(texts[0])  # Cut at the stop string, after some text.


def test_rolling_loglikelihood_and_empty_contexts_equal_the_hf_models(tiny):
    """By name with string model_args (as lm-eval builds models), windows of 8 tokens: several per text."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    hf_dir, run, _, _ = tiny
    register()
    ours = get_model("axcore").create_from_arg_string(f"run={run},max_length=8", {"batch_size": 3, "device": None})
    theirs = HFLM(pretrained=str(hf_dir), device="cpu", batch_size=3, dtype="float32", max_length=8)
    texts = [DOCS[0]["question"] + " mat, and more words", "Water is wet", "x"]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    assert len(ours.tok_encode(texts[0])) > 2 * 8
    ours_rolling, theirs_rolling = ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert np.abs(np.array(ours_rolling) - np.array(theirs_rolling)).max() < TOLERANCE, (ours_rolling, theirs_rolling)
    pairs = [Instance("loglikelihood", {}, ("", " blue sky"), 0), Instance("loglikelihood", {}, ("Water", " is"), 1)]
    ours_pairs, theirs_pairs = ours.loglikelihood(pairs), theirs.loglikelihood(pairs)
    assert [g for _, g in ours_pairs] == [g for _, g in theirs_pairs]
    assert np.abs(np.array([v for v, _ in ours_pairs]) - np.array([v for v, _ in theirs_pairs])).max() < TOLERANCE


def test_length_buckets_are_powers_of_two_within_the_limit():
    from axcore.inference.lm_eval_model import bucket_length

    assert [bucket_length(n, 2048) for n in (1, 16, 17, 33, 1000, 1025)] == [16, 16, 32, 64, 1024, 2048]
    assert [bucket_length(n, 40) for n in (17, 33, 40)] == [32, 40, 40]


def test_a_loaded_model_scores_with_its_full_forward(tiny):
    """`loaded=` (a model in memory): the sum of the continuation's log-softmax over the full forward's logits."""
    from lm_eval.api.instance import Instance

    import axcore
    from axcore.inference.lm_eval_model import LmEvalError
    from axcore.inference.run_loading import load_model

    _, run, _, _ = tiny
    loaded = load_model(run)
    lm = register()(loaded=loaded, batch_size=2)
    context, whole = lm.tok_encode("Fish live"), lm.tok_encode("Fish live in water")
    ids = np.array([whole])
    logits = np.asarray(axcore.functional(loaded.model, loaded.params, (ids,), None, False, method="logits")[0][0])
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    rows = range(len(context) - 1, ids.shape[1] - 1)
    expected = sum(logp[r, ids[0, r + 1]] for r in rows)
    greedy = all(logp[r].argmax() == ids[0, r + 1] for r in rows)
    (value, is_greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("Fish live", " in water"), 0)])
    assert abs(value - expected) < TOLERANCE and is_greedy == greedy
    with pytest.raises(LmEvalError, match="exactly one of run=RUN_DIR and loaded"):
        register()(run=str(run), loaded=loaded)


@pytest.mark.slow  # Compiles the engine's programs (about 20-30 s on 2 loaded cores).
def test_local_completions_over_http_gives_the_hf_models_per_document_results(tiny, hf_results):
    """lm-eval's `local-completions` model (its OpenAI completions client: token-id prompts, `echo`, `logprobs`
    1, `max_tokens` 1) against `axcore serve`'s app over the engine on 127.0.0.1, tokenizing with the saved HF
    tokenizer (nothing downloaded): each choice's log-likelihood within 1e-4 of lm-eval's `hf` model, the same
    greedy flags (from the prompt tokens' top-1) and the same accuracy per document."""
    pytest.importorskip("tenacity")  # lm-eval's `api` extra (the test extra installs lm-eval[api]).
    pytest.importorskip("fastapi")
    from live_server import LiveServer
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from axcore.engine import EngineConfig
    from axcore.inference import load_engine
    from axcore.serving import TextFrontend

    hf_dir, run, tasks, _ = tiny
    config = EngineConfig(block_size=16, num_blocks=32, max_seqs=4, max_tokens_per_step=32, batch_buckets=(4,),
                          token_buckets=(32,))
    engine = load_engine(str(run), config=config)
    with LiveServer(engine, TextFrontend(engine.tokenizer, None, vocab_size=engine.vocab_size)) as live:
        model = LocalCompletionsAPI(base_url=f"{live.url}/v1/completions", model=engine.name, tokenizer=str(hf_dir),
                                    tokenizer_backend="huggingface", tokenized_requests=True, batch_size=4,
                                    max_retries=1)
        results = _evaluate(model, tasks)
    engine.close()
    ours_lls, ours_acc = _per_choice(results)
    theirs_lls, theirs_acc = _per_choice(hf_results)
    assert ours_lls.shape == (6, 3)
    assert np.abs(ours_lls - theirs_lls).max() < TOLERANCE, (ours_lls, theirs_lls)
    assert ours_acc == theirs_acc

    def greedy(res):
        return [[bool(r[1]) for r in s["resps"][i]] for s in res["samples"]["tiny_mc"] for i in range(3)]

    assert greedy(results) == greedy(hf_results)
    assert engine.stats().kv_blocks_used == 0
