"""`axcore generate RUN_OR_CKPT --prompt TEXT ...` (or `--chat TEXT ...`): text from a run's checkpoint.

The prompts (`--prompt`, `--prompt-file` with one per line, `--prompts-file` with one
`{"prompt": ...}` JSON object per line) are encoded with the run's tokenizer and run on
the inference engine (`axcore.engine.Engine`: continuous batching over a paged KV cache,
`axcore.engine.offline`) under the run's mesh. Generation stops at `--max-new-tokens`,
at a stop token (the tokenizer's end-of-sequence id where it has one, unless
`--no-eos-stop`, and every `--stop-token`) or, for the printed text, at a `--stop`
string. The sampling flags are the engine's `SamplingParams`; the draws are seeded by
`--seed` and each prompt's rank. Results go to stdout (text, or one JSON object per
prompt with `--json`) or, with `--output FILE`, to FILE as JSON lines; on long batches a
progress line on stderr (a terminal) counts the finished prompts.

With `--chat TEXT` (a user message; repeatable, each its own conversation, after
`--system TEXT` if given) or `--chat-file FILE` (chat JSONL, `{"messages": [...]}` per
line, each conversation continued) the prompt is the chat template rendered with
`add_generation_prompt=True` (`axcore.data.chat.render_prompt`: the string transformers'
`apply_chat_template` gives), generation also stops at the template's end-of-turn token
(`end_of_turn`: `<|eot_id|>`, `<|im_end|>`, ...), and only the reply is printed, without
that marker. The template is the one the run trained with (a chat source's `template`
file, else the tokenizer's, else the built-in default), or `--chat-template FILE`; a run
not trained on chat data whose tokenizer has no template is refused (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from axcore.cli.common import one_run
from axcore.errors import AxcoreError


class GenerateError(AxcoreError):
    """Bad `axcore generate` arguments (prompts, sampling settings, token ids)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (`axcore generate --help`)."""
    parser.add_argument("run", metavar="RUN_OR_CKPT", help="run directory, its checkpoints/ or one step's directory")
    # More paths (a shell glob matching several runs): refused by the CLI with one line naming them.
    parser.add_argument("more_runs", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="text to continue (repeatable: one batch)")
    parser.add_argument("--prompt-file", metavar="FILE", help="one prompt per line (added to --prompt)")
    parser.add_argument("--prompts-file", metavar="FILE", help='JSONL, {"prompt": TEXT} per line (added to --prompt)')
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus: most likely tokens up to P (default 1)")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P",
                        help="drop tokens below P times the most likely one's probability (default 0: none)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                        help="divide the logits of tokens already seen by R (default 1: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X from the logits of tokens already generated (default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X per earlier occurrence from a generated token's logit (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling draws (default 0)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="text that ends a continuation, not printed (repeatable)")
    parser.add_argument("--stop-token", type=int, action="append", default=[], metavar="ID", help="token id that ends a sequence (repeatable)")
    parser.add_argument("--no-eos-stop", action="store_true", help="do not stop at the tokenizer's end-of-sequence token")
    parser.add_argument("--step", type=int, metavar="S", help="checkpoint step (default: the latest committed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a value of the run's config, e.g. --set mesh.mesh_shape=[-1]")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    parser.add_argument("--output", metavar="FILE", help="write the JSON objects of --json to FILE (JSONL), not stdout")
    chat = parser.add_argument_group("chat", "prompt with the chat template; print the reply only")
    chat.add_argument("--chat", action="append", default=[], metavar="TEXT",
                      help="a user message (repeatable: one conversation each, one batch)")
    chat.add_argument("--chat-file", metavar="FILE", help='chat JSONL, {"messages": [...]} per line: each continued')
    chat.add_argument("--system", metavar="TEXT", help="a system message before each --chat message")
    chat.add_argument("--chat-template", metavar="FILE", help="jinja2 template (default: the run's)")


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"Cannot read --prompt-file '{args.prompt_file}': {e}.") from None
    if args.prompts_file:  # DataError naming the file and line: not a JSON object, no string "prompt".
        from axcore.data.readers import iter_text_documents

        prompts += [text for _, text in iter_text_documents(args.prompts_file, "jsonl", "prompt")]
    if not prompts:
        raise GenerateError("Give at least one non-empty --prompt TEXT (or --prompt-file FILE).")
    return prompts


def _conversations(args: argparse.Namespace) -> list[tuple[str, list[dict]]]:
    """`(where, messages)` of each --chat message and --chat-file record; [] when neither is given."""
    if (args.chat or args.chat_file) and (args.prompt or args.prompt_file or args.prompts_file):
        raise GenerateError("Give either --prompt/--prompt-file or --chat/--chat-file, not both.")
    if args.system is not None and not args.chat:
        raise GenerateError("--system goes with --chat TEXT (a --chat-file record carries its own system message).")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    conversations = [(f"--chat {i + 1}", [*system, {"role": "user", "content": text}]) for i, text in enumerate(args.chat)]
    if args.chat_file:
        from axcore.data.readers import iter_chat_records

        conversations += list(iter_chat_records(args.chat_file))
    return conversations


def chat_template(args: argparse.Namespace, experiment, tokenizer):
    """The template the run trained with (its chat source's), else the tokenizer's; GenerateError if it has none."""
    from axcore.data.chat import ChatTemplate

    if args.chat_template is not None:
        return ChatTemplate.from_file(args.chat_template, field="--chat-template")
    from axcore.data.sources import ChatFiles

    for _, _, source, where in experiment.config.input.components():
        if isinstance(source, ChatFiles.Config):  # As the run's chat data was rendered.
            return ChatTemplate.for_tokenizer(tokenizer, source.template, field=f"{where}.template")
    if tokenizer.chat_template is None:
        raise GenerateError(
            f"The tokenizer of run {args.run} ({type(tokenizer).__name__}) has no chat template and the run was not "
            f"trained on chat data; give --chat-template FILE, or use --prompt for plain text."
        )
    return ChatTemplate.for_tokenizer(tokenizer)


def _reply(tokenizer, tokens, stops: list[int], marker: str) -> tuple[str, bool]:
    """`(reply text, ended)`: `tokens` decoded without the stop token that ended them, cut at `marker`."""
    ended = len(tokens) > 0 and int(tokens[-1]) in stops
    text = tokenizer.decode(tokens[:-1] if ended else tokens)
    if marker and marker in text:  # An end marker of several tokens: found in the text.
        return text[: text.index(marker)], True
    return text, ended


def _marker_stop(tokenizer, marker: str) -> list[int]:
    """The end marker's token id when it is one token (none of the ids the tokenizer adds, e.g. BOS), else []."""
    import numpy as np

    if not marker:
        return []
    ids, offsets = tokenizer.encode_with_offsets(marker)
    offsets = np.asarray(offsets).reshape(-1, 2)
    ids = [int(i) for i, (a, b) in zip(np.asarray(ids).reshape(-1), offsets) if b > a]
    return ids if len(ids) == 1 else []


def _write_outputs(args, conversations, prompts, outputs, tokenizer, stops: list[int], marker: str) -> None:
    """Writes each prompt's continuation (a chat: its reply), as text or one JSON object a line (`--json`),
    to stdout, or the JSON objects to `--output` FILE.

    `outputs[i]` is the generated token ids (int array `[n_i]`) of `prompts[i]`; with
    `conversations`, `conversations[i]` is its `(where, messages)`. The text ends before
    the first `--stop` string.
    """
    from axcore.inference.lm_eval_model import cut_at_stops

    lines = []
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        if conversations:
            reply, ended = _reply(tokenizer, tokens, stops, marker)
            reply = cut_at_stops(reply, args.stop)
            if args.json or args.output:
                lines.append(json.dumps({"messages": conversations[i][1], "prompt": prompt, "reply": reply,
                                         "tokens": tokens.tolist(), "ended": ended}))
            else:
                lines.append(reply)
            continue
        text = cut_at_stops(tokenizer.decode(tokens), args.stop)
        if args.json or args.output:
            lines.append(json.dumps({"prompt": prompt, "completion": text, "tokens": tokens.tolist()}))
        else:
            lines.append(prompt + text)
    if args.output is None:
        for line in lines:
            print(line)
        return
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
    except OSError as e:
        raise GenerateError(f"Cannot write --output '{args.output}': {e}.") from None


class Progress:
    """`generate: K/N prompts finished (S s)` on `stream`, rewritten in place after each step that finished
    a prompt; shown only where `stream` is a terminal and the batch holds more than one prompt."""

    def __init__(self, stream, total: int):
        self.stream, self.started = stream, time.perf_counter()
        isatty = getattr(stream, "isatty", None)
        self.shown = total > 1 and isatty is not None and isatty()
        self.written = False

    def __call__(self, finished: int, total: int) -> None:
        if self.shown:
            width = 30
            bar = "#" * (width * finished // total) + "." * (width - width * finished // total)
            elapsed = time.perf_counter() - self.started
            self.stream.write(f"\rgenerate: [{bar}] {finished}/{total} prompts finished ({elapsed:.1f} s)")
            self.stream.flush()
            self.written = True

    def close(self) -> None:
        """Ends the progress line (a newline, where one was written)."""
        if self.written:
            self.stream.write("\n")
            self.stream.flush()


def _check_sampling(args: argparse.Namespace):
    """The engine's `SamplingParams` of the flags (the draws seeded by the engine: `--seed`, each prompt's
    rank); GenerateError naming the flag of a bad one."""
    import math

    from axcore.engine.requests import SamplingParams, SamplingParamsError

    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise GenerateError(f"Bad sampling setting: temperature must be a finite number >= 0, got {args.temperature}.")
    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"Bad sampling setting: top_k must be >= 1 (or None for all tokens), got {args.top_k}.")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"Bad sampling setting: top_p must be in (0, 1], got {args.top_p}.")
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or 0,
                              top_p=args.top_p, min_p=args.min_p, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                              stop=tuple(args.stop), ignore_eos=args.no_eos_stop)
    except SamplingParamsError as e:
        raise GenerateError(f"Bad sampling setting: --{e.field.replace('_', '-')} {e.problem}.") from None


def _encode(args, conversations, prompts, template, tokenizer, vocab: int) -> tuple[list, list, list[int], str]:
    """`(prompts, encoded, stops, marker)`: the prompt texts (a chat's rendered template), their token ids, the
    stop tokens (`--stop-token`, the tokenizer's EOS unless `--no-eos-stop`, a chat's one-token end marker)
    and a chat's end-of-turn marker ("" for plain prompts)."""
    import numpy as np

    bad = [t for t in args.stop_token if not 0 <= t < vocab]
    if bad:
        raise GenerateError(f"--stop-token {bad[0]} is outside the model's vocabulary 0..{vocab - 1}.")
    stops = list(args.stop_token)
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and not args.no_eos_stop:
        stops.append(int(eos))
    marker = ""
    if conversations:
        from axcore.data.chat import end_of_turn, render_prompt

        rendered = [render_prompt(messages, tokenizer, template, where=where) for where, messages in conversations]
        prompts = [text for text, _ in rendered]
        encoded = [np.asarray(ids) for _, ids in rendered]
        marker = end_of_turn(template, tokenizer)
        stops += _marker_stop(tokenizer, marker)
    else:
        encoded = [np.asarray(tokenizer.encode(p)) for p in prompts]
    empty = [p for p, ids in zip(prompts, encoded) if len(ids) == 0]
    if empty:
        raise GenerateError(f"Prompt {empty[0]!r} encodes to no tokens; give a non-empty prompt.")
    return prompts, encoded, stops, marker


def _generate(args, loaded, placement, encoded, sampling, stops: list[int]) -> list:
    """The new token ids of each prompt (int32 `[n_i]`), from an engine on the loaded parameters run under
    the run's placement; stops at `stops` (the tokenizer's EOS is the engine's own stop unless `--no-eos-stop`)."""
    import dataclasses

    import numpy as np

    from axcore.engine.engine import Engine
    from axcore.engine.offline import offline_config, run_requests
    from axcore.engine.requests import GenerationRequest

    tokenizer = placement.tokenizer
    eos = getattr(tokenizer, "eos_id", None)
    eos_ids = () if eos is None else (int(eos),)
    sampling = dataclasses.replace(sampling, stop_token_ids=tuple(stops))
    config = offline_config(loaded.model, [len(ids) for ids in encoded], args.max_new_tokens, seed=args.seed)
    requests = [GenerationRequest(f"prompt-{i}", ids.tolist(), sampling) for i, ids in enumerate(encoded)]
    progress = Progress(sys.stderr, len(requests))
    with placement.op_environment():
        engine = Engine(loaded.model, loaded.params, tokenizer, config=config, eos_token_ids=eos_ids)
        try:
            outputs = run_requests(engine, requests, progress)
        finally:
            progress.close()
    return [np.asarray(out.choices[0].token_ids, np.int32) for out in outputs]


def run(args: argparse.Namespace) -> int:
    """Loads the run, generates, prints each prompt with its continuation; returns 0."""
    args.run = one_run(args)
    from axcore.inference.run_loading import load_model_and_placement

    conversations = _conversations(args)
    prompts = [] if conversations else _prompts(args)
    sampling = _check_sampling(args)
    if args.output is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise GenerateError(f"--output '{args.output}': its directory does not exist; create it or name another file.")
    template = None
    if conversations:  # The chat template (or its refusal) from the saved config, before the slow restore.
        from axcore.inference.run_loading import load_run_experiment

        experiment, _ = load_run_experiment(args.run, args.overrides, objects=args.objects)
        template = chat_template(args, experiment, experiment.config.tokenizer.instantiate())
    loaded, placement = load_model_and_placement(args.run, step=args.step, overrides=args.overrides,
                                                 objects=args.objects)
    tokenizer = placement.tokenizer
    vocab = loaded.experiment.config.model.vocab_size
    prompts, encoded, stops, marker = _encode(args, conversations, prompts, template, tokenizer, vocab)
    limit = loaded.model.max_cache_len()
    longest = max(len(ids) for ids in encoded)
    need = longest + args.max_new_tokens
    if limit is not None and need > limit:
        raise GenerateError(
            f"The longest prompt ({longest} tokens) plus --max-new-tokens "
            f"{args.max_new_tokens} needs {need} positions, but the model has {limit} (its learned position "
            f"embedding's max_len); shorten the prompt or generate fewer tokens."
        )
    started = time.perf_counter()
    outputs = _generate(args, loaded, placement, encoded, sampling, stops)
    elapsed = time.perf_counter() - started
    _write_outputs(args, conversations, prompts, outputs, tokenizer, stops, marker)
    total = sum(len(t) for t in outputs)
    sys.stdout.flush()
    print(
        f"Generated {total} tokens for {len(prompts)} prompt(s) from step {loaded.step} of {loaded.source} "
        f"in {elapsed:.2f} s (compile included).",
        file=sys.stderr,
    )
    if args.output:
        print(f"Wrote {len(prompts)} result(s) to {args.output}.", file=sys.stderr)
    return 0
