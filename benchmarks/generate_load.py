"""Loading for inference: `axcore generate` and `axcore eval` on a Hugging Face import, code against code.

    python -m benchmarks.generate_load --before /tmp/params_base [--rounds 3]
    python -m benchmarks.generate_load --smoke      # tiny model, this checkout only; numbers mean nothing

A Llama shaped like SmolLM-135M (hidden 576, 30 layers, 9 heads, 3 kv heads,
intermediate 1536, vocab 49152, tied embeddings; 134.5 M parameters) with RANDOM
weights is built by transformers and saved as safetensors, with a word-level
tokenizer.json over its whole vocabulary (nothing is downloaded). Each contender is a copy
of the axcore code: `after` is this checkout, `before` another tree (e.g. a
`git worktree` of HEAD) given with `--before`. Each contender's own converter imports
the model (`axcore convert hf-to-axcore`), and its own `axcore generate` then runs on its
own import, and so does its `axcore eval` (a 2,048-word text file, `--seq-len 128
--batch-size 4 --max-batches 4`), every command in a fresh process with `PYTHONPATH=ROOT:ROOT/plugins/*:ROOT/examples/*`
(the process reports the file of every `axcore*` package it imported, checked to lie
under ROOT) under `/usr/bin/time -v`. Measured per contender:

- `checkpoint_bytes`: the size on disk of the import's `checkpoints/`;
- `import_s`: wall seconds of the convert command;
- `generate_s`: wall seconds of the whole `axcore generate` command (interpreter start
  to exit; greedy, 24 new tokens after an 8-token prompt);
- `load_s`: seconds inside run loading (`run_loading.load_model_and_placement`: experiment,
  placement, restore; on code before the placement object `load_model_and_step`, which
  built a whole TrainStep); `restore_s`: seconds inside `restore_verified` (all attempts);
- `max_rss_bytes`: the command's peak resident memory (`Maximum resident set size`);
- `train_states`: how many times the command built the train state's shapes (a
  `jax.eval_shape` of `TrainStep._init_state`, the optimizer's `init` included); 0 means
  no learner and no optimizer state, not even abstract, was built;
- `live_bytes_after_load`, `live_arrays_after_load`: `jax.live_arrays()` when run loading
  returns (the parameters and nothing else when no optimizer state is allocated);
  `param_bytes`: the bytes of the loaded parameters.

`eval_*` keys hold the same for `axcore eval`.

Rounds alternate the contenders (before, after, before, ...); medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks.common import summarize, write_result

ROOT = pathlib.Path(__file__).resolve().parent.parent
# SmolLM-135M's shape (config.json of HuggingFaceTB/SmolLM-135M), written out here.
SMOLLM_135M = dict(
    vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True,
)
SMOKE_SHAPE = dict(SMOLLM_135M, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=96)
PROMPT, NEW_TOKENS = "w1 w2 w3 w4 w5 w6 w7 w8", 24
# `axcore eval` on a text file of EVAL_WORDS words: 4 batches of 4 rows of 128 tokens.
EVAL_WORDS, EVAL_ARGS = 2048, ["--seq-len", "128", "--batch-size", "4", "--max-batches", "4", "--json"]
_MEASURED = ("wall_s", "load_s", "restore_s", "max_rss_bytes", "train_states", "live_bytes_after_load",
             "live_arrays_after_load", "param_bytes")

# Runs one axcore command, timing run loading and restore_verified inside it and counting the train states
# built (jax.eval_shape of `_init_state`); the last stderr line is JSON. Patched on the modules before the
# commands import them (generate imports run loading at call time, eval's module when the command runs).
_WRAPPER = r"""
import gc, importlib, json, sys, time
import jax
import axcore, axcore.inference.run_loading as rl
spent = {"load_s": 0.0, "restore_s": 0.0, "train_states": 0}
def timing(name, fn, after=None):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
        if after is not None:
            after(out)
        return out
    return timed
def live(out):
    gc.collect()
    arrays = jax.live_arrays()
    spent["live_arrays_after_load"] = len(arrays)
    spent["live_bytes_after_load"] = sum(a.nbytes for a in arrays)
    spent["param_bytes"] = sum(a.nbytes for a in jax.tree.leaves(out[0].params))
eval_shape = jax.eval_shape
def counted(fn, *args, **kwargs):
    spent["train_states"] += getattr(fn, "__name__", "") == "_init_state"
    return eval_shape(fn, *args, **kwargs)
jax.eval_shape = counted
for name in ("axcore.inference.run_loading", "axcore.placement.placement"):  # The second only after the change.
    try:
        module = importlib.import_module(name)
    except ImportError:
        continue
    if hasattr(module, "restore_verified"):
        module.restore_verified = timing("restore_s", module.restore_verified)
loader = "load_model_and_placement" if hasattr(rl, "load_model_and_placement") else "load_model_and_step"
setattr(rl, loader, timing("load_s", getattr(rl, loader), live))
from axcore.cli import main
code = main(sys.argv[1:])
import axcore_hf
loaded = {n: m.__file__ for n, m in sys.modules.items() if n.split("_")[0] == "axcore" and "." not in n}
print(json.dumps({"axcore": axcore.__file__, "axcore_hf": axcore_hf.__file__, "modules": loaded, **spent}), file=sys.stderr)
sys.exit(code)
"""


def make_hf_model(directory: pathlib.Path, shape: dict) -> int:
    """Saves a random-weight LlamaForCausalLM of `shape` (safetensors) and a tokenizer.json; -> parameter count.

    The tokenizer is a word-level one over the words `w0 ... w<vocab-1>` (one per token id, split at
    whitespace), so any id the random model draws decodes; the import picks it up (plugin hf_tokenizer).
    """
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    model.save_pretrained(directory, safe_serialization=True)
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(shape["vocab_size"])}, "w0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(directory / "tokenizer.json"))
    return sum(p.numel() for p in model.parameters())


def _run(root: pathlib.Path, args: list[str], cwd: pathlib.Path) -> dict[str, Any]:
    """Runs `axcore ARGS` with `root`'s code under /usr/bin/time -v; -> wall, RSS and the wrapper's report.

    `cwd` must not hold an `axcore/` package: `python -c` puts the working directory first on sys.path.
    """
    # The core and every plugin of `root` (rope, swiglu, hf, the example, ...): a plugin must match its core.
    plugins = [*(root / "plugins").iterdir(), *(root / "examples").iterdir()]
    path = [str(root)] + sorted(str(d) for d in plugins if (d / "pyproject.toml").is_file())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    command = ["/usr/bin/time", "-v", sys.executable, "-c", _WRAPPER, *args]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"axcore {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = proc.stderr.splitlines()
    report = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    for name, file in report.pop("modules").items():  # axcore, axcore_hf, axcore_rope, ...
        if file is None or not pathlib.Path(file).resolve().is_relative_to(root.resolve()):
            raise RuntimeError(f"{name} came from {file}, not from {root}; the comparison would be void.")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return {"wall_s": wall, "max_rss_bytes": rss_kb * 1024, "stdout": proc.stdout, **report}


def _size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(smoke: bool = False, *, results_dir: pathlib.Path | None = None, before: pathlib.Path | None = None,
        rounds: int | None = None, work_dir: pathlib.Path | None = None) -> dict[str, Any]:
    rounds = rounds or (1 if smoke else 3)
    roots = {"before": pathlib.Path(before)} if before else {}
    roots["after"] = ROOT
    work = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="generate_load-"))
    hf_dir = work / ("hf-smoke" if smoke else "hf-135m")
    if not (hf_dir / "config.json").exists():
        count = make_hf_model(hf_dir, SMOKE_SHAPE if smoke else SMOLLM_135M)
    else:
        count = None
    contenders: dict[str, dict[str, Any]] = {}
    for name, root in roots.items():
        out = work / f"import-{name}"
        shutil.rmtree(out, ignore_errors=True)
        imported = _run(root, ["convert", "hf-to-axcore", str(hf_dir), str(out)], work)
        contenders[name] = {
            "root": str(root), "axcore": imported["axcore"], "axcore_hf": imported["axcore_hf"],
            "import_s": imported["wall_s"], "import_max_rss_bytes": imported["max_rss_bytes"],
            "checkpoint_bytes": _size(out / "checkpoints"), "runs": [],
        }
    text = work / "eval.txt"
    text.write_text(" ".join(f"w{(i * 7919) % 500}" for i in range(EVAL_WORDS)) + "\n", "utf-8")
    generate = ["generate", None, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    for _ in range(rounds):
        for name, root in roots.items():
            generate[1] = str(work / f"import-{name}")
            one = _run(root, generate, work)
            contenders[name]["runs"].append({k: one[k] for k in _MEASURED})
            contenders[name]["completion"] = one["stdout"].strip()
            one = _run(root, ["eval", str(work / f"import-{name}"), "--data", str(text), *EVAL_ARGS], work)
            contenders[name].setdefault("eval_runs", []).append({k: one[k] for k in _MEASURED})
            contenders[name]["eval_loss"] = json.loads(one["stdout"].strip().splitlines()[-1])["loss"]
    for entry in contenders.values():
        for key in _MEASURED:
            entry[key] = summarize([r[key] for r in entry["runs"]])
            entry[f"eval_{key}"] = summarize([r[key] for r in entry["eval_runs"]])
    result = {"smoke": smoke, "model": "smoke" if smoke else "SmolLM-135M shape, random weights",
              "parameters": count, "rounds": rounds, "new_tokens": NEW_TOKENS, "contenders": contenders}
    if "before" in contenders:  # Same weights, greedy: both must print the same text.
        result["same_completion"] = contenders["before"]["completion"] == contenders["after"]["completion"]
        result["same_eval_loss"] = contenders["before"]["eval_loss"] == contenders["after"]["eval_loss"]
    write_result("generate_load", result, results_dir=results_dir)
    if work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _table(result: dict[str, Any]) -> str:
    rows = ["| contender | command | whole command | load | restore | peak RSS | train states | live after load |",
            "|---|---|---|---|---|---|---|---|"]
    for name, c in result["contenders"].items():
        for command, p in (("generate", ""), ("eval", "eval_")):
            wall, rss = c[f"{p}wall_s"], c[f"{p}max_rss_bytes"]
            rows.append(
                f"| {name} | {command} | {wall['median']:.2f} s ({wall['p10']:.2f}-{wall['p90']:.2f}) | "
                f"{c[f'{p}load_s']['median']:.2f} s | {c[f'{p}restore_s']['median']:.2f} s | "
                f"{rss['median'] / 2**30:.3f} GiB ({rss['p10'] / 2**30:.3f}-{rss['p90'] / 2**30:.3f}) | "
                f"{c[f'{p}train_states']['median']:.0f} | {c[f'{p}live_bytes_after_load']['median'] / 1e6:.1f} MB in "
                f"{c[f'{p}live_arrays_after_load']['median']:.0f} arrays (params {c[f'{p}param_bytes']['median'] / 1e6:.1f}"
                f" MB) |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one round; numbers mean nothing")
    parser.add_argument("--before", type=pathlib.Path, default=None, help="root of the code to compare against")
    parser.add_argument("--rounds", type=int, default=None, help="generate runs per contender (default 3)")
    parser.add_argument("--work-dir", type=pathlib.Path, default=None, help="keep the model and imports here")
    parser.add_argument("--results-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    result = run(args.smoke, results_dir=args.results_dir, before=args.before, rounds=args.rounds, work_dir=args.work_dir)
    print(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
