"""Chat records -> documents with assistant-only loss masks (axcore/data/chat.py).

The expected tokens and mask are built independently: the conversation is written out by
hand as a list of (text, weighted) segments that follow the template, each segment is
tokenized on its own (plain UTF-8 bytes, or the `tokenizers` library directly), and the
mask is each segment's flag repeated over its tokens. Segment boundaries are pre-token
boundaries (special tokens, newlines before letters), so the concatenated ids equal
tokenizing the whole text once. transformers' `apply_chat_template` is the reference for
the rendered text of the BPE case.
"""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from axcore.data import ByteTokenizer, ChatFiles, DataError, InputConfig, Packing
from axcore.data.chat import DEFAULT_TEMPLATE, ChatTemplate, TrainOn, end_of_turn, render_chat

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where is the fox?"},
    {"role": "assistant", "content": "Over the lazy dog, naïve café 🚀."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "It jumps."},
]
WHERE = "'chat.jsonl' line 3"

# Llama 3 (8B Instruct)'s chat template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML (Qwen-style), with a newline after each end marker.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]


def _segments(header, end, after_end="", bos="", conversation=CONVERSATION):
    """A conversation as (text, weighted) segments: role headers and non-assistant turns 0, replies + end marker 1."""
    out = [(bos, False)]
    for m in conversation:
        out.append((header(m["role"]), False))
        out.append((m["content"] + end, m["role"] == "assistant"))
        out.append((after_end, False))
    return [(text, weighted) for text, weighted in out if text]


def _expected(segments, encode):
    ids = [encode(text) for text, _ in segments]
    mask = [np.full(len(i), weighted, np.uint8) for i, (_, weighted) in zip(ids, segments)]
    return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


def _byte_ids(text):
    return list(text.encode("utf-8"))


def _runs(mask):
    """[start, end) of each maximal run of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_bytes_tokenizer_default_template_masks_exactly_the_replies():
    tok = ByteTokenizer()
    template = ChatTemplate.for_tokenizer(tok)
    assert template.source == DEFAULT_TEMPLATE
    doc = render_chat(CONVERSATION, tok, template, where=WHERE)
    segments = _segments(lambda role: f"<|{role}|>\n", "<|end|>", after_end="\n")
    tokens, mask = _expected(segments, _byte_ids)
    assert doc["tokens"].dtype == np.int32 and doc["loss_mask"].dtype == np.uint8
    assert doc["tokens"].tolist() == tokens.tolist()
    assert doc["loss_mask"].tolist() == mask.tolist()
    # Read back: the weighted runs are exactly the two replies with their end markers, nothing else.
    runs = [bytes(doc["tokens"][a:b].astype(np.uint8)).decode() for a, b in _runs(doc["loss_mask"])]
    assert runs == ["Over the lazy dog, naïve café 🚀.<|end|>", "It jumps.<|end|>"]
    everything = render_chat(CONVERSATION, tok, template, train_on="all", where=WHERE)
    assert everything["tokens"].tolist() == tokens.tolist() and everything["loss_mask"].tolist() == [1] * len(tokens)
    assert render_chat(CONVERSATION, tok, template, train_on=TrainOn.ALL, where=WHERE)["loss_mask"].all()


def test_byte_offsets_are_each_bytes_character():
    text = "aé🚀 x\n€"
    expected = [(c, c + 1) for c, ch in enumerate(text) for _ in ch.encode("utf-8")]
    ids, offsets = ByteTokenizer().encode_with_offsets(text)
    assert ids.tolist() == ByteTokenizer().encode(text).tolist()
    assert offsets.dtype == np.int64 and [tuple(o) for o in offsets.tolist()] == expected
    ids, offsets = ByteTokenizer().encode_with_offsets("", document=True)
    assert ids.shape == (0,) and offsets.shape == (0, 2)


def _bpe_dir(path, template=None, jinja=None, **config):
    """A byte-level BPE tokenizer.json (trained here; nothing downloaded) with chat special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for m in CONVERSATION] * 30 + ["system user assistant"] * 30, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    settings = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", **config}
    if template is not None:
        settings["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("axcore_tokenizers").HFTokenizer


def _hf_tokenizer(hf, path, **settings):
    return hf(hf.default_config().set(path=str(path), **settings))


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_bpe_tokenizer_template_masks_exactly_the_replies(tmp_path, hf, style):
    source = LLAMA3_TEMPLATE if style == "llama3" else CHATML_TEMPLATE
    directory = _bpe_dir(tmp_path / style, template=source)
    tok = _hf_tokenizer(hf, directory, add_bos=style == "llama3")  # Llama 3's template writes BOS itself.
    template = ChatTemplate.for_tokenizer(tok)
    assert template.source == source
    doc = render_chat(CONVERSATION, tok, template, where=WHERE)
    if style == "llama3":
        segments = _segments(lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
                             bos="<|begin_of_text|>")
        end = "<|eot_id|>"
    else:
        segments = _segments(lambda role: f"<|im_start|>{role}\n", "<|im_end|>", after_end="\n")
        end = "<|im_end|>"
    library = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokens, mask = _expected(segments, lambda text: library.encode(text, add_special_tokens=False).ids)
    assert doc["tokens"].tolist() == tokens.tolist()  # One BOS only, although add_bos is set under Llama 3.
    assert doc["loss_mask"].tolist() == mask.tolist()
    # The weighted runs decode to the replies plus end marker; no header, system or user token is weighted.
    runs = [library.decode(doc["tokens"][a:b].tolist(), skip_special_tokens=False) for a, b in _runs(doc["loss_mask"])]
    assert runs == [m["content"] + end for m in CONVERSATION if m["role"] == "assistant"]
    header_ids = {library.token_to_id(t) for t in SPECIALS} - {library.token_to_id(end)}
    assert not header_ids & set(doc["tokens"][doc["loss_mask"] == 1].tolist())
    # The rendered text is what transformers' apply_chat_template renders from the same directory.
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    text = reference.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == "".join(t for t, _ in segments)
    assert library.encode(text, add_special_tokens=False).ids == tokens.tolist()


def test_bos_and_eos_follow_the_tokenizers_document_settings(tmp_path, hf):
    directory = _bpe_dir(tmp_path / "tok", template=CHATML_TEMPLATE)
    plain = render_chat(CONVERSATION, _hf_tokenizer(hf, directory), ChatTemplate(CHATML_TEMPLATE), where=WHERE)
    tok = _hf_tokenizer(hf, directory, add_bos=True, add_eos=True)
    doc = render_chat(CONVERSATION, tok, ChatTemplate(CHATML_TEMPLATE), where=WHERE)
    # As encode_documents: BOS first, EOS last; neither carries weight (the model stops at <|im_end|>).
    assert doc["tokens"].tolist() == [tok.bos_id, *plain["tokens"].tolist(), tok.eos_id]
    assert doc["loss_mask"].tolist() == [0, *plain["loss_mask"].tolist(), 0]
    text = ChatTemplate(CHATML_TEMPLATE).render(CONVERSATION)
    assert tok.encode_documents([text])[0].tolist() == doc["tokens"].tolist()
    # A template that writes BOS and EOS itself (Llama 2 style) gets each once; its EOS ends the last reply.
    own = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                       "{{ eos_token }}{% endif %}{% endfor %}")
    doc = render_chat(CONVERSATION, tok, own, where=WHERE)
    assert doc["tokens"].tolist().count(tok.bos_id) == 1 and doc["tokens"][0] == tok.bos_id
    assert doc["tokens"].tolist().count(tok.eos_id) == 2 and doc["tokens"][-1] == tok.eos_id
    assert doc["tokens"][-2] != tok.eos_id and doc["loss_mask"][-1] == 1 and doc["loss_mask"][0] == 0


def test_template_sources_explicit_file_then_tokenizer_then_default(tmp_path, hf):
    override = tmp_path / "mine.jinja"
    override.write_text(CHATML_TEMPLATE)
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA3_TEMPLATE}]
    tok = _hf_tokenizer(hf, _bpe_dir(tmp_path / "named", template=named))
    assert ChatTemplate.for_tokenizer(tok).source == LLAMA3_TEMPLATE
    assert ChatTemplate.for_tokenizer(tok, override).source == CHATML_TEMPLATE
    assert ChatTemplate.for_tokenizer(tok, path=str(override)).source == CHATML_TEMPLATE
    jinja = _hf_tokenizer(hf, _bpe_dir(tmp_path / "jinja", template=LLAMA3_TEMPLATE, jinja=CHATML_TEMPLATE))
    assert ChatTemplate.for_tokenizer(jinja).source == CHATML_TEMPLATE  # chat_template.jinja wins, as in transformers.
    assert ChatTemplate.for_tokenizer(_hf_tokenizer(hf, _bpe_dir(tmp_path / "none"))).source == DEFAULT_TEMPLATE
    with pytest.raises(DataError, match=r"chat_template\.path: cannot read chat template '.*missing.jinja'"):
        ChatTemplate.for_tokenizer(tok, tmp_path / "missing.jinja", field="chat_template.path")


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "robot", "content": "hi"}], r"message 0 has unknown role 'robot'; use one of system, user"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}], r"message 1 \(assistant\) has no \"content\""),
        ([{"role": "user", "content": ["hi"]}], r"message 0 \(user\) has content of type list"),
        ([{"content": "hi"}], r"message 0 has no \"role\""),
        (["hi"], r"message 0 is str 'hi', not an object"),
        ([], r"a chat record must be a non-empty list"),
    ],
)
def test_malformed_messages_are_one_line_errors_naming_the_record(messages, message):
    with pytest.raises(DataError, match=message) as info:
        render_chat(messages, ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE), where=WHERE)
    assert str(info.value).startswith(WHERE + ": ") and "\n" not in str(info.value)


def test_bad_templates_are_errors_naming_the_template():
    with pytest.raises(DataError, match=r"chat template 'x.jinja': jinja2 syntax error at template line 1"):
        ChatTemplate("{% for m in messages %}", name="'x.jinja'")
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Must start with user') }}{% endif %}"
                          "{% for m in messages %}{{ m['content'] }}{% endfor %}", name="'strict.jinja'")
    with pytest.raises(DataError, match=rf"^{WHERE}: chat template 'strict.jinja' failed on this conversation: Must start"):
        render_chat(CONVERSATION, ByteTokenizer(), strict, where=WHERE)
    # Renders the last reply differently from earlier ones: prefixes are not prefixes, so replies cannot be located.
    last_differs = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}|{% endfor %}",
                                name="'odd.jinja'")
    with pytest.raises(DataError, match=r"'odd.jinja' does not render message 2 \(assistant\) as a continuation"):
        render_chat(CONVERSATION, ByteTokenizer(), last_differs, where=WHERE)
    # ... but it can still train on everything.
    assert render_chat(CONVERSATION, ByteTokenizer(), last_differs, train_on="all", where=WHERE)["loss_mask"].all()
    typed = ChatTemplate("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", name="'typed.jinja'")
    with pytest.raises(DataError, match=rf"^{WHERE}: chat template 'typed.jinja' failed on this conversation"):
        render_chat(CONVERSATION, ByteTokenizer(), typed, where=WHERE)


def test_tool_turns_carry_no_weight_and_prompts_without_replies_are_refused():
    tok, template = ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "calc"},
                {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4."}]
    doc = render_chat(messages, tok, template, where=WHERE)
    runs = [bytes(doc["tokens"][a:b].astype(np.uint8)).decode() for a, b in _runs(doc["loss_mask"])]
    assert runs == ["calc<|end|>", "4.<|end|>"]
    # Nothing would train on a conversation without a reply: refused, naming the record (train_on: all takes it).
    with pytest.raises(DataError, match=r"^'chat.jsonl' line 3: the conversation has no assistant message"):
        render_chat(messages[:1], tok, template, where=WHERE)
    prompt_only = render_chat(messages[:1], tok, template, train_on="all", where=WHERE)
    assert len(prompt_only["tokens"]) == len("<|user|>\n2+2?<|end|>\n") and prompt_only["loss_mask"].all()


def test_a_token_straddling_the_reply_start_carries_weight():
    # Template without a separator: the generation prompt "A:" runs straight into the reply, and a
    # tokenizer whose tokens are 2 characters then has a token "::"-like straddler; emulate it with offsets.
    class Pairs(ByteTokenizer):
        """Tokens of two characters (ids: the first character's byte), spans [2k, 2k + 2)."""

        def encode_with_offsets(self, text, *, document=False):
            starts = np.arange(0, len(text), 2)
            return (np.asarray([ord(text[s]) for s in starts], np.int32),
                    np.stack([starts, np.minimum(starts + 2, len(text))], axis=1))

    template = ChatTemplate("{% for m in messages %}{{ m['role'][0] + ':' + m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}a:{% endif %}")
    doc = render_chat([{"role": "user", "content": "xyz"}, {"role": "assistant", "content": "Hello"}], Pairs(), template,
                      where=WHERE)
    # Text "u:xyza:Hello": tokens "u:", "xy", "za", ":H", "el", "lo"; the reply is characters 7..12.
    assert doc["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]


def test_packed_chat_batches_weight_exactly_the_reply_targets(tmp_path):
    """Through the `chat` source and the packing pipeline: target_weights[j] is the mask of target_labels[j]."""
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in (CONVERSATION, short)))
    expected = {}
    for conversation in (CONVERSATION, short):
        tokens, mask = _expected(_segments(lambda role: f"<|{role}|>\n", "<|end|>", "\n", conversation=conversation),
                                 _byte_ids)
        expected[tuple(tokens[:-1].tolist())] = (tokens, mask)
    source = ChatFiles.default_config().set(paths=[str(path)], eval_fraction=0.0)
    config = InputConfig().set(source=source, batch_size=1, seq_len=512, shuffle=False, packing=Packing.FIRST_FIT,
                               prefetch=0)
    pipeline = config.make_pipeline("train", ByteTokenizer())
    try:
        batch = {k: v[0] for k, v in next(pipeline).items()}
    finally:
        pipeline.close()
    seen = set()
    for segment in sorted(set(batch["segment_ids"].tolist()) - {0}):  # TRAIN repeats: a conversation may recur.
        rows = batch["segment_ids"] == segment
        key = tuple(batch["input_ids"][rows].tolist())
        tokens, mask = expected[key]
        assert batch["target_labels"][rows].tolist() == tokens[1:].tolist()
        assert batch["target_weights"][rows].tolist() == mask[1:].astype(np.float32).tolist()
        seen.add(key)
    assert seen == set(expected) and not batch["target_weights"][batch["segment_ids"] == 0].any()


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("source, marker", [(DEFAULT_TEMPLATE, "<|end|>"), (LLAMA3_TEMPLATE, "<|eot_id|>"),
                                            (CHATML_TEMPLATE, "<|im_end|>"), (MISTRAL_TEMPLATE, "</s>")])
def test_end_of_turn_is_what_the_template_writes_after_a_reply(source, marker):
    class Specials(ByteTokenizer):
        special_tokens = {"bos_token": "<s>", "eos_token": "</s>"}

    assert end_of_turn(ChatTemplate(source), Specials()) == marker
