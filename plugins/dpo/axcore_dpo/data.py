"""The `preference` data source: JSONL preference records as (chosen, rejected) document pairs.

Each line is an object with a `prompt` (a list of chat messages, or a string: one user
message), a `chosen` and a `rejected` reply (strings: the assistant's content, or lists of
messages that follow the prompt). The source yields two documents per record, in this
order: the prompt plus the chosen reply, then the prompt plus the rejected reply, each
rendered with the chat template exactly as the `chat` source renders a conversation
(`axcore.data.chat.render_chat`, `train_on: assistant`). Their `loss_mask` is then cut to
what follows the two documents' longest common token prefix: the prompt carries no
weight, and neither do reply tokens both share (their log-probabilities are equal under
any model, so they cancel in DPO's margin anyway).

For the `dpo` objective's paired rows set `input.packing: none` (one document per row),
`input.shuffle: false`, `input.long_documents: error`, one data shard and
`eval_fraction: 0` (the held-out rule picks single documents; the plugin refuses other
settings when `trainer.objective` is dpo), hence `trainer.eval_every: 0`; an even
`input.batch_size` keeps each pair in one batch.

Refused with a DataError naming the file and line: a record whose chosen and rejected
replies are identical, a missing or mistyped field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from axcore.data import ByteTokenizer, ChatFiles, DataError
from axcore.data.chat import ChatTemplate, render_chat


class PreferenceError(DataError):
    """A preference record that cannot be trained on (names the file and line)."""


def _messages(value: Any, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise PreferenceError(f"{where} must be a string or a non-empty list of {{\"role\", \"content\"}} messages.")


def iter_preference_records(path: str, fields: tuple[str, str, str]) -> Iterator[tuple[str, tuple[list, list, list]]]:
    """Yields `(location, (prompt, chosen, rejected))` message lists for each line of a preference JSONL file."""
    prompt_key, chosen_key, rejected_key = fields
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            at = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceError(f"{at}: not JSON ({e.msg}).") from None
            if not isinstance(record, dict) or any(k not in record for k in fields):
                raise PreferenceError(f"{at}: a preference record needs the fields {', '.join(fields)}.")
            prompt = _messages(record[prompt_key], "user", f"{at}: field '{prompt_key}'")
            chosen = _messages(record[chosen_key], "assistant", f"{at}: field '{chosen_key}'")
            rejected = _messages(record[rejected_key], "assistant", f"{at}: field '{rejected_key}'")
            if chosen == rejected:
                raise PreferenceError(
                    f"{at}: '{chosen_key}' and '{rejected_key}' are identical, so the pair prefers nothing; "
                    f"remove the record or fix one reply."
                )
            yield at, (prompt, chosen, rejected)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


class PreferenceFiles(ChatFiles):
    """Preference JSONL (prompt, chosen, rejected) as chosen/rejected document pairs (module docstring)."""

    class Config(ChatFiles.Config):
        """Configures PreferenceFiles (`field` and `train_on` of the chat source are not used)."""

        # The field holding the prompt (messages, or a string: one user message).
        prompt_field: str = "prompt"
        # The field holding the preferred reply (a string, or the messages after the prompt).
        chosen_field: str = "chosen"
        # The field holding the dispreferred reply.
        rejected_field: str = "rejected"
        # No held-out split: the rule holds out single documents, which would break a pair (the dpo plugin
        # refuses another value); hold out preference records with a second source file instead.
        eval_fraction: float = 0.0

    def raw_documents(self) -> Iterator[tuple[str, Any]]:
        cfg = self._config
        for path in self.files():
            for at, record in iter_preference_records(path, (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field)):
                yield f"{at} chosen", (record, 0)
                yield f"{at} rejected", (record, 1)

    def to_document(self, location: str, raw: Any) -> dict[str, Any]:
        (prompt, chosen, rejected), which = raw
        tokenizer = self._tokenizer if self._tokenizer is not None else ByteTokenizer()
        if self._template is None:
            self._template = ChatTemplate.for_tokenizer(tokenizer, self._config.template, field=f"{self.where}.template")
        pair = [render_chat(prompt + reply, tokenizer, self._template, train_on="assistant", where=location)
                for reply in (chosen, rejected)]
        shared = common_prefix(pair[0]["tokens"], pair[1]["tokens"])
        if shared == len(pair[0]["tokens"]) == len(pair[1]["tokens"]):
            raise PreferenceError(f"{location}: the chosen and rejected replies tokenize identically; fix one reply.")
        document = pair[which]
        mask = document["loss_mask"].copy()
        mask[:shared] = 0
        return {"tokens": document["tokens"], "loss_mask": mask, "location": location}

    def describe(self) -> str:
        return "preference files " + ", ".join(f"'{p}'" for p in self._config.paths[:2])


__all__ = ["PreferenceError", "PreferenceFiles", "common_prefix"]
