"""pylon.serving's text side: finding a model directory's tokenizer, streaming detokenization (whole UTF-8
characters only, stop strings never leaked), and chat prompts (the tokenizer's template or the default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pylon.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.tokenization import IncrementalDetokenizer, apply_chat_template, load_model_tokenizer
from pylon.serving.errors import InvalidRequest

TEXT = "héllo 🦊 wörld, ça va?\n"
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, ça va? " * 20], trainer)
    path = tmp_path_factory.mktemp("hf-tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", chat_template=TEMPLATE).save_pretrained(str(path))
    return path


def stream(tokenizer, ids: list[int], stop=(), prompt=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, list(prompt), list(stop))
    deltas = []
    for i in ids:
        deltas.append(detok.add(i))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, detok


def test_streamed_bytes_come_out_as_whole_characters() -> None:
    tok = ByteTokenizer()
    deltas, _ = stream(tok, tok.encode(TEXT).tolist(), prompt=tok.encode("prompt ").tolist())
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    fox = [d for d in deltas if "🦊" in d]
    assert fox == ["🦊"] and deltas[deltas.index("🦊") - 3 : deltas.index("🦊")] == ["", "", ""]  # 4 bytes, 1 char


def test_an_unfinished_character_comes_out_as_a_replacement_at_the_end() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("ok🦊").tolist()[:-1] + [256]  # eos mid-character: decodes to nothing
    deltas, _ = stream(tok, ids)
    assert deltas[:2] == ["o", "k"] and "".join(deltas) == "ok\ufffd"


def test_stop_strings_end_the_text_and_no_part_of_them_is_ever_streamed() -> None:
    tok = ByteTokenizer()
    deltas, detok = stream(tok, tok.encode(TEXT).tolist(), stop=["zzz", "wör"])
    assert "".join(deltas) == "héllo 🦊 " and detok.stopped
    assert not any("w" in d for d in deltas)  # held back from the moment it could start "wör"


def test_a_held_back_tail_that_is_no_stop_is_released() -> None:
    tok = ByteTokenizer()
    deltas, detok = stream(tok, tok.encode("xaay").tolist(), stop=["ab"])
    assert deltas == ["x", "", "a", "ay", ""] and not detok.stopped
    deltas, _ = stream(tok, tok.encode("xa").tolist(), stop=["ab"])
    assert deltas == ["x", "", "a"]  # finishing flushes it


def test_a_stop_string_found_late_is_cut_where_it_starts() -> None:
    tok = ByteTokenizer()
    deltas, detok = stream(tok, tok.encode("one. two. three").tolist(), stop=[". t"])
    assert "".join(deltas) == "one" and detok.text == "one"


def test_bpe_tokens_stream_like_a_whole_decode(hf_dir: Path) -> None:
    tok = load_model_tokenizer(str(hf_dir))
    assert isinstance(tok, HuggingFaceTokenizer)
    ids = tok.encode(TEXT).tolist()
    deltas, _ = stream(tok, ids, prompt=tok.encode("hello").tolist())
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_model_directory_tokenizers(tmp_path: Path, hf_dir: Path) -> None:
    (tmp_path / "pylon_tokenizer.json").write_text(json.dumps(ByteTokenizer().info.model_dump(mode="json")))
    assert isinstance(load_model_tokenizer(str(tmp_path)), ByteTokenizer)
    (tmp_path / "pylon_tokenizer.json").write_text(
        json.dumps(
            {
                "kind": "tokenizers",
                "name": "stdlib-bpe.json",
                "vocab_size": 400,
                "eos_id": 0,
                "pad_id": 1,
                "sha256": "0" * 64,
            }
        )
    )
    with pytest.raises(PylonError, match="tokenizers tokenizer 'stdlib-bpe.json'.*copy its tokenizer files"):
        load_model_tokenizer(str(tmp_path))
    (tmp_path / "pylon_tokenizer.json").unlink()
    with pytest.raises(PylonError, match="has no tokenizer"):
        load_model_tokenizer(str(tmp_path))


def test_chat_prompts(hf_dir: Path) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]},
    ]
    assert apply_chat_template(ByteTokenizer(), messages) == "system: be brief\nuser: hi!\nassistant: "
    assert apply_chat_template(load_model_tokenizer(str(hf_dir)), messages) == (
        "<|system|>be brief\n<|user|>hi!\n<|assistant|>"
    )
    for bad in ([], [{"content": "no role"}], "hi"):
        with pytest.raises(InvalidRequest) as e:
            apply_chat_template(ByteTokenizer(), bad)
        assert e.value.param == "messages"
    for content in (3, [{"type": "input_audio"}], ["hi"]):  # a bad content names its message
        with pytest.raises(InvalidRequest) as e:
            apply_chat_template(
                ByteTokenizer(), [{"role": "system", "content": "x"}, {"role": "user", "content": content}]
            )
        assert e.value.param == "messages.1" and "text (and image_url) parts" in str(e.value)
    # An image part, where the model takes none, names the part; where it does, it reaches the template as an image.
    image = [{"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": "data:..."}}]
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(ByteTokenizer(), [{"role": "user", "content": image}])
    assert e.value.param == "messages.0.content.1" and "takes no images" in str(e.value)
    with pytest.raises(InvalidRequest, match="chat template"):  # the plain lines have no place for an image
        apply_chat_template(ByteTokenizer(), [{"role": "user", "content": image}], images=True)


def _with_chat_template(hf_dir: Path, copy: Path, template: str):
    """The tokenizer of a copy of `hf_dir` whose chat template is `template`."""
    import shutil

    shutil.copytree(hf_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    return load_model_tokenizer(str(copy))


def test_a_chat_template_that_refuses_the_messages_is_an_invalid_request(hf_dir: Path, tmp_path: Path) -> None:
    """Many models' templates `raise_exception` for messages they do not take (roles out of turn, a system
    message): that is the request's fault, a 400 with the template's words, never a 500."""
    tok = _with_chat_template(
        hf_dir,
        tmp_path / "strict",
        (
            "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
            "{% endif %}[{{ m.role }}] {{ m.content }}{% endfor %}"
        ),
    )
    assert apply_chat_template(tok, [{"role": "user", "content": "hi"}]) == "[user] hi"
    with pytest.raises(InvalidRequest) as e:
        apply_chat_template(tok, [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
    assert e.value.param == "messages" and "roles must alternate user/assistant" in str(e.value)


def test_a_chat_template_sees_a_tool_results_call_id_and_a_name(hf_dir: Path, tmp_path: Path) -> None:
    """Templates of tool-trained models read `tool_call_id` on a tool message (and some `name`): they reach it."""
    tok = _with_chat_template(
        hf_dir,
        tmp_path / "tools",
        (
            "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}"
            "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}] {{ m.content }}\n{% endfor %}"
        ),
    )
    messages = [
        {"role": "user", "content": "2+2?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "4", "tool_call_id": "call_7"},
    ]
    assert apply_chat_template(tok, messages) == ("[user:ann] 2+2?\n[assistant] \n[tool#call_7] 4\n")
    assert apply_chat_template(ByteTokenizer(), messages) == "user: 2+2?\nassistant: \ntool: 4\nassistant: "


def test_invalid_bytes_come_out_as_they_come() -> None:
    # A random or barely trained byte model writes bytes that are no UTF-8 at all: holding them until the end
    # (as for a character still arriving) would stream nothing for the rest of the request.
    tok = ByteTokenizer()
    ids = [0xE9] * 12 + list(b"ok") + [0xF0, 0x9F, 0xA6, 0x8A] + [0x80] * 5 + list("é".encode())
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == bytes(ids).decode("utf-8", errors="replace")  # the same as one decode of it all
    streamed = deltas[:-1]  # before flush()
    assert "".join(streamed[:12]) == "\ufffd" * 11  # each lead byte is final once the next one breaks it
    assert "🦊" in streamed and "é" in "".join(streamed)  # whole characters still come out whole


def test_tokens_without_text_inside_a_character_do_not_break_it() -> None:
    # Special ids decode to nothing, so a character's bytes may be many tokens apart (failed once on a fresh
    # clone: "턝" streamed as two replacement characters when the byte model put ids >= 256 inside it).
    tok = ByteTokenizer()
    ids = [0x41, 0xED, 256, 257, 256, 256, 0x84, 257, 257, 257, 257, 0x9D, 0x42]
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "A턝B" == tok.decode(ids)
    assert "턝" in deltas


@pytest.mark.parametrize("seed", range(40))
def test_any_byte_stream_streams_as_its_one_shot_decode(seed: int) -> None:
    import random

    rng = random.Random(seed)
    tok = ByteTokenizer()
    alphabet = list(b"ab ") + [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 0x80, 0xED, 256, 257]
    ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 80))]
    detok = IncrementalDetokenizer(tok, tok.encode("p").tolist(), [])
    out = ""
    for n, i in enumerate(ids, 1):
        out += detok.add(i)
        # At every step: all of the one-shot decode so far, but a last character that may still be arriving.
        whole = tok.decode(ids[:n])
        assert out == (whole[:-1] if whole.endswith("\ufffd") else whole), (ids[:n], out)
    assert out + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_stream_as_their_definition_says(seed: int) -> None:
    """The streaming matchers against the definition, recomputed from the whole text after every token: the text is
    cut where the earliest occurrence of any stop string begins, and until then everything is out except the longest
    tail that is the start of some stop string. Random texts and stop strings over small alphabets, where partial
    matches are frequent and overlap (one stop inside another, repeats like "aab" in "aaab")."""
    import random

    rng = random.Random(seed)
    tok = ByteTokenizer()
    for _ in range(300):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        detok = IncrementalDetokenizer(tok, [], stops)
        out = ""
        for n, char in enumerate(text, 1):
            out += detok.add(tok.encode(char).tolist()[0])
            seen = text[:n]
            hits = [seen.find(s) for s in stops if s in seen]
            if hits:
                assert detok.stopped and out == detok.text == seen[: min(hits)], (seen, stops)
                break
            held = next(
                (
                    k
                    for k in range(min(max(map(len, stops)) - 1, n), 0, -1)
                    if any(s.startswith(seen[-k:]) for s in stops)
                ),
                0,
            )
            assert not detok.stopped and out == seen[: n - held], (seen, stops, out)
        if not detok.stopped:
            assert out + detok.flush() == text


def test_stop_conditions_are_bounded() -> None:
    """Every token is checked against every stop string in the engine's step, for every request: a request may not
    make that arbitrarily long."""
    from pylon.serving.engine.sampling import MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

    SamplingParams(stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    for fields, says in (
        ({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS} stop strings"),
        ({"stop": "x" * (MAX_STOP_LENGTH + 1)}, f"at most {MAX_STOP_LENGTH} characters"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, f"at most {MAX_STOP_TOKEN_IDS}"),
    ):
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**fields)
        assert e.value.param == next(iter(fields)) and says in str(e.value)


def test_chars_per_token_bound_holds_where_it_is_given(hf_dir: Path, tmp_path: Path) -> None:
    """What the engine refuses prompts on before tokenizing them: a bound no token exceeds, for the byte tokenizer
    and byte-level BPE; none for WordPiece, whose [UNK] may stand for a whole word."""
    from tokenizers import trainers as tr

    from pylon.data.tokenizer import TokenizersFileTokenizer
    from pylon.serving.engine.tokenization import chars_per_token_bound

    assert chars_per_token_bound(ByteTokenizer()) == 1
    tok = load_model_tokenizer(str(hf_dir))
    bound = chars_per_token_bound(tok)
    assert bound is not None and bound >= 2
    assert all(len(tok.decode([i])) <= bound for i in range(tok.vocab_size))
    for text in (TEXT, "hello world, ça va? " * 30, "</s>" * 10):
        assert len(tok.encode(text)) * bound >= len(text)
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(
        ["hello world " * 20], tr.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"])
    )
    wordpiece.save(str(tmp_path / "wp.json"))
    wp = TokenizersFileTokenizer(str(tmp_path / "wp.json"), "wp", "0", where="test")
    assert len(wp.encode("zzzzzzzzzzzzzzzzzzzzzzzz")) == 1  # one [UNK] for the whole word
    assert chars_per_token_bound(wp) is None


def test_chat_template_kwargs_reach_the_template_and_reserved_names_are_refused(hf_dir: Path, tmp_path: Path) -> None:
    """A request's chat_template_kwargs are the template's variables (Qwen3's enable_thinking: false writes an
    empty think block into the prompt); names that are the template call's own arguments are a 400 naming them."""
    from pylon.serving.api import protocol

    tok = _with_chat_template(
        hf_dir,
        tmp_path / "thinking",
        (
            "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant] "
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
        ),
    )
    messages = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(tok, messages) == "[user] hi[assistant] "
    assert apply_chat_template(tok, messages, template_kwargs={"enable_thinking": False}) == (
        "[user] hi[assistant] <think>\n\n</think>\n\n"
    )
    body = {"model": "m", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    request = protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode())
    assert request.render(tok).endswith("<think>\n\n</think>\n\n")
    for name in ("tokenize", "add_generation_prompt", "messages", "conversation", "bad-name", "_private"):
        bad = {**body, "chat_template_kwargs": {name: True}}
        with pytest.raises(InvalidRequest) as e:
            protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(bad).encode())
        assert e.value.param == f"chat_template_kwargs.{name}", (name, e.value)


def test_special_tokens_write_no_text_but_the_markers_a_parser_reads(tmp_path: Path) -> None:
    """skip_special_tokens (vLLM's default): a streamed decode that skips the tokenizer's special tokens is its own
    one-shot `decode(..., skip_special_tokens=True)`, over random ids, special ones among them; non-special added
    tokens (Qwen's `<think>`) stay. A tool marker that is a special token (Mistral's `[TOOL_CALLS]`) is kept where
    the reply is parsed for calls (`keep_special_ids`), and the call then parses."""
    import random

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from pylon.serving.api import tools
    from pylon.serving.engine.tokenization import added_token_ids, special_token_ids

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(['hello world {"name": "f", "arguments": {}} ' * 20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>")
    fast.add_tokens([AddedToken("<think>", special=False)])
    fast.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[INST]"]})
    fast.save_pretrained(str(tmp_path))
    wrapped = load_model_tokenizer(str(tmp_path))
    special = special_token_ids(wrapped)
    ids_of = fast.convert_tokens_to_ids
    assert (
        special == {ids_of(t) for t in ("</s>", "<s>", "[TOOL_CALLS]", "[INST]")} and ids_of("<think>") not in special
    )
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.choice([*special, ids_of("<think>"), *range(300)]) for _ in range(40)]
        detok = IncrementalDetokenizer(wrapped, [], [], skip=special)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        assert text == fast.decode(ids, skip_special_tokens=True)
        assert "".join(stream(wrapped, ids)[0]) == fast.decode(ids)  # nothing skipped: every token's text
    reply = fast.encode('[INST][TOOL_CALLS][{"name": "f", "arguments": {}}]</s>', add_special_tokens=False)
    kept = added_token_ids(wrapped, tools.MARKERS)
    assert kept == (ids_of("[TOOL_CALLS]"),)
    detok = IncrementalDetokenizer(wrapped, [], [], skip=special - set(kept))
    text = "".join(detok.add(i) for i in reply) + detok.flush()
    assert text == '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    plan = tools.plan_of(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], None, None
    )
    content, calls = tools.parse(text, plan)
    assert [c["function"]["name"] for c in calls] == ["f"] and not content


def test_a_chat_can_end_without_a_generation_prompt_or_continue_its_last_message(hf_dir: Path) -> None:
    """vLLM's add_generation_prompt and continue_final_message, through the model's template (Hugging Face's options
    of those names) and the plain lines."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    hf = load_model_tokenizer(str(hf_dir))
    assert apply_chat_template(hf, chat[:1], add_generation_prompt=False) == "<|user|>hi\n"
    assert apply_chat_template(hf, chat, add_generation_prompt=False, continue_final_message=True) == (
        "<|user|>hi\n<|assistant|>The answer is"
    )
    byte = ByteTokenizer()
    assert apply_chat_template(byte, chat[:1], add_generation_prompt=False) == "user: hi\n"
    assert apply_chat_template(byte, chat, add_generation_prompt=False, continue_final_message=True) == (
        "user: hi\nassistant: The answer is"
    )
