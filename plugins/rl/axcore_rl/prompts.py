"""Prompt files: JSONL with a prompt and an answer field, read as samples or as the `prompts` data source.

`load_prompts(path)` returns a file's samples (dicts with `prompt`, `answer` and the
line's other fields); a bad line is one PromptFileError naming `file:line`.
`prompt_encoder(tokenizer, chat=...)` encodes a prompt as the model is fed it: with
`chat` the user turn rendered with the chat template and a generation prompt (what
`axcore generate --chat` feeds), else the text as is.

`PromptFiles` (registered as the data source `prompts`, the input of an `rl` experiment
under `axcore train`) yields each prompt as a document: its encoded tokens, loss mask 0
(nothing in it is a target). With `repeat` = G every prompt is `repeat` consecutive
documents, so that with `input.packing: none` and `input.shuffle: false` (one document
per row, in source order) each group of G rows of a batch is one prompt: the rows its G
completions replace. The prompts are taken in one order shuffled with `seed` (the same
order every epoch), or in file order without `shuffle`. `sample(tokens)` gives back the
sample whose encoded prompt is `tokens` (the rewards read its fields); two lines whose
prompts encode alike but differ in another field are refused, naming both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import numpy as np

from axcore import AxcoreError
from axcore.config import Positive
from axcore.data import ByteTokenizer, DataError
from axcore.data.chat import ChatTemplate, render_prompt
from axcore.data.readers import expand_paths
from axcore.data.sources import RandomAccessSource
from axcore.data.tokenizer import Tokenizer


class PromptFileError(AxcoreError):
    """A prompt file line that cannot be used (names the file and line, and what to fix)."""


def iter_prompt_records(path: str, prompt_field: str, answer_field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yields `(file:line, sample)` for each non-blank line of a JSONL prompt file (module docstring)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{number}: not JSON ({e.msg}).") from None
            if not isinstance(record, dict) or not all(isinstance(record.get(k), str)
                                                       for k in (prompt_field, answer_field)):
                raise PromptFileError(f"{path}:{number}: needs string fields '{prompt_field}' and '{answer_field}'.")
            yield f"{path}:{number}", {**record, "prompt": record[prompt_field], "answer": record[answer_field]}


def load_prompts(path: str, *, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict[str, Any]]:
    """The samples of a JSONL prompt file: each line's object, with string fields `prompt_field` and
    `answer_field` copied to "prompt" and "answer". Raises PromptFileError naming `path:line`."""
    samples = [sample for _, sample in iter_prompt_records(path, prompt_field, answer_field)]
    if not samples:
        raise PromptFileError(f"{path}: no prompts; give at least one JSON line.")
    return samples


def prompt_encoder(tokenizer: Tokenizer, *, chat: bool, template: str | None = None) -> Callable[[str], list[int]]:
    """`encode(prompt text) -> token ids`: the chat-templated user turn with a generation prompt, or the raw text."""
    if not chat:
        return lambda text: [int(t) for t in tokenizer.encode(text)]
    chat_template = ChatTemplate.for_tokenizer(tokenizer, template)
    return lambda text: [int(t) for t in render_prompt([{"role": "user", "content": text}], tokenizer, chat_template,
                                                         where="prompt")[1]]


class PromptFiles(RandomAccessSource):
    """JSONL prompt files as prompt documents, each `repeat` times in a row (module docstring)."""

    class Config(RandomAccessSource.Config):
        """Configures PromptFiles."""

        # JSONL prompt files, directories or globs (one object per line).
        paths: list[str] = []
        # The field holding the prompt text.
        prompt_field: str = "prompt"
        # The field holding the expected answer (the rewards read it as sample["answer"]).
        answer_field: str = "answer"
        # True: each prompt is a user turn rendered with the chat template and a generation prompt; False: raw text.
        chat: bool = True
        # A jinja2 chat template file; None: the tokenizer's, else axcore's default.
        template: str | None = None
        # Consecutive documents per prompt (the rl plugin sets it to rl.group_size).
        repeat: Annotated[int, Positive] = 1
        # Whether the prompts are taken in an order shuffled with `seed` (the same every epoch); False: file order.
        shuffle: bool = True
        # Seed of that order.
        seed: int = 0
        # No held-out split (the rl plugin refuses another value): rows of one prompt must stay together.
        eval_fraction: float = 0.0

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._records: list[tuple[str, dict[str, Any], tuple[int, ...]]] | None = None
        self._by_tokens: dict[tuple[int, ...], tuple[str, dict[str, Any]]] = {}
        self._order: np.ndarray | None = None

    def files(self) -> list[str]:
        """The files `paths` names (DataError naming `<where>.paths[i]`)."""
        if not self._config.paths:
            raise DataError(f"{self.where}.paths is empty; list at least one JSONL prompt file.")
        return expand_paths(self._config.paths, f"{self.where}.paths", suffixes=(".jsonl",))

    def _check(self) -> None:
        self.files()

    def _read(self) -> list[tuple[str, dict[str, Any], tuple[int, ...]]]:
        if self._records is not None:
            return self._records
        cfg = self._config
        encode = prompt_encoder(self._tokenizer or ByteTokenizer(), chat=cfg.chat, template=cfg.template)
        records = []
        for path in self.files():
            for at, sample in iter_prompt_records(path, cfg.prompt_field, cfg.answer_field):
                tokens = tuple(encode(sample["prompt"]))
                seen = self._by_tokens.setdefault(tokens, (at, sample))
                if seen[1] != sample:
                    raise PromptFileError(f"{at}: its prompt encodes like that of {seen[0]}, but the lines differ "
                                          f"(e.g. in '{cfg.answer_field}'); remove one or make the prompts differ.")
                records.append((at, sample, tokens))
        if not records:
            raise PromptFileError(f"{self.where}.paths: no prompts in {', '.join(self.files())}; give JSON lines.")
        self._records = records
        order = np.arange(len(records))
        self._order = np.random.default_rng(cfg.seed).permutation(order) if cfg.shuffle else order
        return records

    def num_documents(self) -> int:
        return len(self._read()) * self._config.repeat

    def document(self, index: int) -> dict[str, Any]:
        records = self._read()
        at, _, tokens = records[int(self._order[index // self._config.repeat])]
        return {"tokens": np.asarray(tokens, np.int32), "loss_mask": np.zeros(len(tokens), np.uint8), "location": at}

    def sample(self, tokens: tuple[int, ...]) -> dict[str, Any]:
        """The sample whose encoded prompt is `tokens`; PromptFileError if none is."""
        self._read()
        if tokens not in self._by_tokens:
            raise PromptFileError(f"{self.where}: no prompt of {', '.join(self._config.paths)} encodes to the "
                                  f"{len(tokens)} tokens of a batch row; rows must come from this source unchanged.")
        return self._by_tokens[tokens][1]

    def describe(self) -> str:
        return "prompt files " + ", ".join(f"'{p}'" for p in self._config.paths[:2])


__all__ = ["PromptFileError", "PromptFiles", "iter_prompt_records", "load_prompts", "prompt_encoder"]
