"""`axcore generate RUN_OR_CKPT --prompt TEXT ...` (or `--chat TEXT ...`): text from a run's checkpoint.

The prompts are encoded with the run's tokenizer and continued together in one batch
(`axcore.generation.Generator`, KV-cache decoding) under the run's mesh. Generation
stops at `--max-new-tokens` or at a stop token: the tokenizer's end-of-sequence id
(where it has one, unless `--no-eos-stop`) and every `--stop-token`.

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
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus: most likely tokens up to P (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling draws (default 0)")
    parser.add_argument("--stop-token", type=int, action="append", default=[], metavar="ID", help="token id that ends a sequence (repeatable)")
    parser.add_argument("--no-eos-stop", action="store_true", help="do not stop at the tokenizer's end-of-sequence token")
    parser.add_argument("--step", type=int, metavar="S", help="checkpoint step (default: the latest committed)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                        help="override a value of the run's config, e.g. --set mesh.mesh_shape=[-1]")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
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
    if not prompts:
        raise GenerateError("Give at least one non-empty --prompt TEXT (or --prompt-file FILE).")
    return prompts


def _conversations(args: argparse.Namespace) -> list[tuple[str, list[dict]]]:
    """`(where, messages)` of each --chat message and --chat-file record; [] when neither is given."""
    if (args.chat or args.chat_file) and (args.prompt or args.prompt_file):
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


def _print_outputs(args, conversations, prompts, outputs, tokenizer, stops: list[int], marker: str) -> None:
    """Prints each prompt's continuation (a chat: its reply), as text or one JSON object a line (`--json`).

    `outputs[i]` is the generated token ids (int array `[n_i]`) of `prompts[i]`; with
    `conversations`, `conversations[i]` is its `(where, messages)`.
    """
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        if conversations:
            reply, ended = _reply(tokenizer, tokens, stops, marker)
            if args.json:
                print(json.dumps({"messages": conversations[i][1], "prompt": prompt, "reply": reply,
                                  "tokens": tokens.tolist(), "ended": ended}))
            else:
                print(reply)
            continue
        text = tokenizer.decode(tokens)
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": tokens.tolist()}))
        else:
            print(prompt + text)


def run(args: argparse.Namespace) -> int:
    """Loads the run, generates, prints each prompt with its continuation; returns 0."""
    args.run = one_run(args)
    import jax
    import numpy as np

    from axcore.generation import Generator, Sampling
    from axcore.inference.run_loading import load_model_and_placement

    conversations = _conversations(args)
    prompts = [] if conversations else _prompts(args)
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise GenerateError(f"Bad sampling setting: {e}") from None
    template = None
    if conversations:  # The chat template (or its refusal) from the saved config, before the slow restore.
        from axcore.inference.run_loading import load_run_experiment

        experiment, _ = load_run_experiment(args.run, args.overrides, objects=args.objects)
        template = chat_template(args, experiment, experiment.config.tokenizer.instantiate())
    loaded, placement = load_model_and_placement(args.run, step=args.step, overrides=args.overrides,
                                                 objects=args.objects)
    tokenizer = placement.tokenizer
    vocab = loaded.experiment.config.model.vocab_size
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
        encoded = [ids for _, ids in rendered]
        marker = end_of_turn(template, tokenizer)
        stops += _marker_stop(tokenizer, marker)
    else:
        encoded = [np.asarray(tokenizer.encode(p)) for p in prompts]
    empty = [p for p, ids in zip(prompts, encoded) if len(ids) == 0]
    if empty:
        raise GenerateError(f"Prompt {empty[0]!r} encodes to no tokens; give a non-empty prompt.")
    generator = Generator(loaded.model, max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=stops)
    limit = loaded.model.max_cache_len()
    need = generator.positions_needed(max(len(ids) for ids in encoded))
    if limit is not None and need > limit:
        raise GenerateError(
            f"The longest prompt ({max(len(ids) for ids in encoded)} tokens) plus --max-new-tokens "
            f"{args.max_new_tokens} needs {need} positions, but the model has {limit} (its learned position "
            f"embedding's max_len); shorten the prompt or generate fewer tokens."
        )
    started = time.perf_counter()
    with placement.op_environment():
        outputs = generator(loaded.params, encoded, jax.random.key(args.seed))
    elapsed = time.perf_counter() - started
    _print_outputs(args, conversations, prompts, outputs, tokenizer, stops, marker)
    total = sum(len(t) for t in outputs)
    sys.stdout.flush()
    print(
        f"Generated {total} tokens for {len(prompts)} prompt(s) from step {loaded.step} of {loaded.source} "
        f"in {elapsed:.2f} s (compile included).",
        file=sys.stderr,
    )
    return 0
