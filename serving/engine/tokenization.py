"""Text in and out of the engine: the model directory's tokenizer, streaming detokenization with stop
strings, and chat prompts.

The tokenizers themselves are `pylon.data.tokenizer`'s (the ones training used), found in a model directory
as either Hugging Face tokenizer files or, for a Pylon export trained on bytes, `pylon_tokenizer.json`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Collection

from pylon.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer
from pylon.errors import PylonError
from pylon.serving.errors import InvalidRequest, shown

PYLON_TOKENIZER_FILE = "pylon_tokenizer.json"  # what `pylon export` writes (pylon.jobs.export.TOKENIZER_FILE)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def prompt_ids(tokenizer: Tokenizer, text: str, special: bool = False) -> list[int]:
    """The token ids of a text prompt as the engine computes them (the engine, the prefix-aware router and
    /tokenize all count a prompt with this one function). `special`: with the special tokens the tokenizer adds (a
    BOS: `SamplingParams.add_special_tokens`, a completion's default as vLLM's; a rendered chat has its own)."""
    encoded = tokenizer.encode(text, special=True) if special else tokenizer.encode(text)
    return encoded.tolist() if hasattr(encoded, "tolist") else [int(i) for i in encoded]


# Fill in the middle (OpenAI's completions `suffix`): a code model's own tokens around the code before the cursor, the
# code after it and the middle it writes, in the order its family was trained on: (prefix token, suffix token,
# middle token or None, order). "psm": prefix first; "spm": the suffix first (Codestral: [SUFFIX] suffix [PREFIX]
# prefix, and the model writes on).
FIM_FORMATS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "psm"),  # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "psm"),  # StarCoder, StarCoder2, Granite Code, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "psm"),  # DeepSeek-Coder (and V2)
    ("[PREFIX]", "[SUFFIX]", None, "spm"),  # Codestral
)


def fim_format(tokenizer: Tokenizer) -> tuple[list[int], str] | None:
    """The model's fill-in-the-middle tokens ([prefix, suffix, middle?] ids) and their order, or None where its
    tokenizer has none of FIM_FORMATS' among its added tokens (`added_vocab`, read once per tokenizer)."""
    vocab = added_vocab(tokenizer)
    for *names, order in FIM_FORMATS:
        ids = [vocab.get(name) for name in names if name is not None]
        if all(i is not None for i in ids):
            return [int(i) for i in ids], order
    return None


def fim_ids(tokenizer: Tokenizer, prefix: str, suffix: str, special: bool = True) -> list[int]:
    """The prompt of a completion with a `suffix`: the model's fill-in-the-middle tokens around `prefix` and `suffix`
    in its family's order (`fim_format`), after the special tokens the tokenizer starts a text with (a BOS) where
    `special`. InvalidRequest naming `suffix` for a model without such tokens."""
    found = fim_format(tokenizer)
    if found is None:
        names = ", ".join(f"{p} {s}" for p, s, _, _ in FIM_FORMATS)
        raise InvalidRequest(
            f"suffix: this model's tokenizer has no fill-in-the-middle tokens (one of: {names}); a code model "
            "trained to fill in the middle takes a suffix, this one takes the prompt alone",
            param="suffix",
        )
    ids, order = found
    before, after = prompt_ids(tokenizer, prefix), prompt_ids(tokenizer, suffix)
    lead: list[int] = []
    if special:  # what the tokenizer puts before a text (a BOS), once, before the whole prompt
        marked = prompt_ids(tokenizer, prefix, True)
        if before and marked[len(marked) - len(before) :] == before:
            lead = marked[: len(marked) - len(before)]
    if order == "spm":
        return [*lead, ids[1], *after, ids[0], *before]
    return [*lead, ids[0], *before, ids[1], *after, ids[2]]


def embedding_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The token ids of a text to embed: with the special tokens the tokenizer adds (a BOS; the EOS Qwen3-Embedding
    pools at), as vLLM and sentence-transformers tokenize an input to embed."""
    return tokenizer.encode(text, special=True).tolist()


def pair_ids(tokenizer: Tokenizer, first: str, second: str) -> list[int]:
    """The token ids of two texts as one sequence, a cross-encoder's input, with the special tokens the tokenizer
    puts around a pair (`encode_pair`), as sentence-transformers' CrossEncoder and vLLM's score API tokenize one."""
    return tokenizer.encode_pair(first, second).tolist()


def load_model_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of the local model directory `model_dir`.

    Hugging Face tokenizer files win when present. Otherwise `pylon_tokenizer.json` names the tokenizer the
    model was trained with: the byte tokenizer needs no files; any other kind needs its files copied in.
    """
    if any(os.path.exists(os.path.join(model_dir, name)) for name in HF_TOKENIZER_FILES):
        name = os.path.basename(os.path.normpath(model_dir))
        return HuggingFaceTokenizer(model_dir, name, None, where=f"model {model_dir}")
    identity_file = os.path.join(model_dir, PYLON_TOKENIZER_FILE)
    if not os.path.exists(identity_file):
        raise PylonError(
            f"model {model_dir}: has no tokenizer; expected Hugging Face tokenizer files "
            f"({', '.join(HF_TOKENIZER_FILES)}) or {PYLON_TOKENIZER_FILE} (what `pylon export` writes)"
        )
    try:
        with open(identity_file) as f:
            identity = json.load(f)
        if not isinstance(identity, dict):
            raise ValueError(f"a JSON object was expected, not {type(identity).__name__}")
    except (OSError, ValueError) as e:
        raise PylonError(
            f"model {model_dir}: {PYLON_TOKENIZER_FILE} cannot be read ({e}); export the model again "
            "(`pylon export`) or copy the file from the export"
        ) from None
    if identity.get("kind") == "byte":
        return ByteTokenizer()
    raise PylonError(
        f"model {model_dir}: was trained with the {identity.get('kind')} tokenizer "
        f"'{identity.get('name')}', whose files are not in the model directory; copy its "
        "tokenizer files (tokenizer.json, tokenizer_config.json) next to the model"
    )


def chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """At most how many characters of text one token of `tokenizer` stands for, where that is bounded: then a prompt
    of more than `max_model_len` times that many characters cannot fit, and the engine refuses it without
    tokenizing it (a 15 MB prompt took 21 s to tokenize with a byte-level BPE, in the engine's step loop, where every
    other request waited). Bounded for the byte tokenizer (one byte a token: 1) and for byte-level and byte-fallback
    BPE (GPT-2, Llama, Mistral, Qwen...: no token stands for more characters than its vocabulary string has, an
    added token's included); None (no bound) for anything whose unknown token may stand for a whole word or a run
    of characters (WordPiece, Unigram, BPE without byte fallback) or a tokenizer without a `tokenizers` backend."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    backend = getattr(getattr(tokenizer, "_tok", None), "backend_tokenizer", None) or getattr(tokenizer, "_tok", None)
    if backend is None or not hasattr(backend, "to_str") or not hasattr(backend, "get_vocab"):
        return None
    try:
        layout = json.loads(backend.to_str())
    except (ValueError, TypeError):
        return None
    model = layout.get("model") or {}
    parts = [layout.get("pre_tokenizer"), layout.get("decoder")]
    byte_level = any('"ByteLevel"' in json.dumps(p) for p in parts if p)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    return max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=0) or None


@functools.lru_cache(maxsize=8)
def special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids `skip_special_tokens` leaves out of the text: a Hugging Face tokenizer's added tokens marked special
    and its named special tokens (bos, eos, unk, pad...), as its own `decode(..., skip_special_tokens=True)` drops
    them; a `tokenizers` file's added tokens marked special. The byte tokenizer's are its ids past 255, which have no
    text anyway. Read once per tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return frozenset(range(256, tokenizer.vocab_size))
    ids = {i for i, token in _added_tokens(tokenizer).items() if getattr(token, "special", False)}
    hf = getattr(tokenizer, "_tok", None)
    ids.update(int(i) for i in getattr(hf, "all_special_ids", ()) or () if i is not None)
    return frozenset(ids)


def added_token_ids(tokenizer: Tokenizer, texts: Collection[str]) -> tuple[int, ...]:
    """The ids of the tokenizer's added tokens whose text is one of `texts` (a reply parser's markers), sorted."""
    vocab = added_vocab(tokenizer)
    return tuple(sorted({vocab[t] for t in texts if t in vocab}))


@functools.lru_cache(maxsize=8)
def added_vocab(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens' ids by their text (tags a model writes as one token: `<think>`, `<tool_call>`),
    read once per tokenizer (a replica has one; every constrained or tool-using request asks)."""
    return {str(token.content): i for i, token in _added_tokens(tokenizer).items()}


def _added_tokens(tokenizer: Tokenizer) -> dict[int, object]:
    """A Hugging Face tokenizer's or a `tokenizers` file's added tokens (`AddedToken`s) by id (Pylon's wrapper of one,
    or the library's object itself); none for bytes."""
    hf = getattr(tokenizer, "_tok", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None)
    if added is None and hasattr(hf, "get_added_tokens_decoder"):  # a bare `tokenizers.Tokenizer`
        added = hf.get_added_tokens_decoder()
    return {int(i): token for i, token in (added or {}).items()}


def bad_words_ids(tokenizer: Tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """`SamplingParams.bad_words` as the token sequences the sampler bans (vLLM's rule): each word (its leading
    whitespace stripped) as it tokenizes alone, and with a leading space where that gives a sequence as long that
    starts with another token (" world" as one token beside "world"): a word is banned at the start of the text and
    after a space alike. InvalidRequest for a word with a token past the model's vocabulary (a tokenizer larger than
    the model's embedding)."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        alone = prompt_ids(tokenizer, word.lstrip())
        spaced = prompt_ids(tokenizer, " " + word.lstrip())
        found = [alone]
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            found.append(spaced)
        for ids in found:
            if not ids:
                continue
            if max(ids) >= vocab_size:
                raise InvalidRequest(
                    f"bad_words.{i}: {shown(word)} has a token ({max(ids)}) past the model's vocabulary "
                    f"({vocab_size} tokens)",
                    param=f"bad_words.{i}",
                )
            out.append(ids)
    return out


class IncrementalDetokenizer:
    """Output token ids in, text deltas out, for streaming.

    Only complete text is emitted: a token that ends in the middle of a multi-byte UTF-8 character (the
    decoder then yields U+FFFD) is held until the character completes. Only that last character is held:
    replacement characters before it stand for bytes that are no UTF-8 (which a model early in training, or a
    random one, writes freely) and go out as they come, as a one-shot decode gives them, instead of holding the
    rest of the stream back until the request ends. Each step decodes a short window
    (from `_prefix`) rather than the whole output, and compares it with the same window without the new
    tokens, so tokenizers whose text depends on neighbours (sentencepiece's leading spaces) come out right.

    Stop strings end the text before their first occurrence (after it with `keep_stop`). While streaming, a tail of
    text that could still grow into a stop string is held back, so no client ever sees part of a stop string.

    `skip`: token ids that write no text (`SamplingParams.skip_special_tokens`: the special tokens, less those a
    reply's parser reads); they are left out of the decoded window as a one-shot decode that skips them leaves them
    out.
    """

    PROMPT_CONTEXT = 6  # prompt tokens decoded along with the first outputs, for context-dependent spacing
    MAX_HELD_TOKENS = 3  # through invalid bytes the window moves on to this many tokens from the end

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        *,
        keep_stop: bool = False,
        skip: Collection[int] = (),
    ):
        self._tokenizer = tokenizer
        self._skip = skip
        self._ids = list(prompt_token_ids[-self.PROMPT_CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)
        self._stop = list(stop)
        self._keep_stop = keep_stop  # the stop string found stays in the text (include_stop_str_in_output)
        # Streaming string matching (Knuth-Morris-Pratt), one state per stop string: how many of its first
        # characters the text ends with. Each new character moves every state in amortized constant time, so a
        # token costs the same however long the text and the stop strings are (checking every tail length against
        # every stop string cost 0.6 ms a token for 16 stop strings of 1,000 characters, in the engine's step).
        self._fallback = [_prefix_function(s) for s in self._stop]
        self._matched = [0] * len(self._stop)
        self.text = ""  # all output text so far, cut at a stop string once one is found
        self._sent = 0  # characters of `text` handed out already
        self._window_sent = 0  # characters of the open window's output already in `text` (see `add`)
        self.stopped = False  # a stop string was found

    def add(self, token_id: int, *, find_stop: bool = True) -> str:
        """Take one generated token; return the text that is now safe to emit. `find_stop` False: its text is not
        looked at for stop strings, then or later (a request's min_tokens)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        before = self._tokenizer.decode(self._ids[self._prefix : self._read])
        after = self._tokenizer.decode(self._ids[self._prefix :])
        # Clean text: all of it goes out, and the next window starts after these tokens (unless they decoded to
        # nothing yet, as a leading "▁" may: keep them as context).
        end, read_to, sent_past = len(after), len(self._ids) if len(after) > len(before) else None, 0
        if after.endswith("\ufffd"):
            # Only the last character can still change: bytes of a character still arriving decode to one U+FFFD
            # at the very end. Every character before it is final, replacement characters for invalid bytes too.
            end, read_to = len(after) - 1, None
            cut = len(self._ids) - self.MAX_HELD_TOKENS
            if cut > self._read:
                # Through a run of invalid bytes, keep the window short: move it past `cut` where decoding splits
                # cleanly there and text follows the cut (so everything before it is final and out).
                head, tail = (
                    self._tokenizer.decode(self._ids[self._prefix : cut]),
                    self._tokenizer.decode(self._ids[cut:]),
                )
                if tail and head + tail == after:
                    read_to, sent_past = cut, end - len(head)
        start = len(before) + self._window_sent
        if end > start:
            searched_up_to = len(self.text)
            self.text += after[start:end]
            if self._stop and find_stop:
                self._find_stop(searched_up_to)
        if read_to is not None and end >= start:
            self._prefix, self._read, self._window_sent = self._read, read_to, sent_past
        elif end > start:
            self._window_sent = end - len(before)
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The rest of the text, held-back tails included: call when the request finishes. Bytes of a
        character that will now never complete come out as U+FFFD, as a one-shot decode would give them."""
        if not self.stopped and self._read < len(self._ids):
            before = self._tokenizer.decode(self._ids[self._prefix : self._read])
            self.text += self._tokenizer.decode(self._ids[self._prefix :])[len(before) + self._window_sent :]
            self._prefix = self._read = len(self._ids)
            self._window_sent = 0
        return self._take(final=True)

    def _find_stop(self, start: int) -> None:
        """Feed `text[start:]` to the stop strings' matchers; at a whole stop string, cut the text where the first
        one found in it begins (of those ending in the new text, the one that starts earliest) and stop."""
        text, stops, fallback, matched = self.text, self._stop, self._fallback, self._matched
        first = cut = None
        for i in range(start, len(text)):
            c = text[i]
            for j, stop in enumerate(stops):
                k = matched[j]
                while k and stop[k] != c:
                    k = fallback[j][k - 1]
                if stop[k] == c:
                    k += 1
                    if k == len(stop):
                        begin = i + 1 - k
                        if first is None or begin < first:
                            first, cut = begin, i + 1
                        k = fallback[j][k - 1]
                matched[j] = k
        if first is not None:
            self.text = text[:cut] if self._keep_stop else text[:first]
            self.stopped = True

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._partial_stop_length()
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _partial_stop_length(self) -> int:
        """Length of the longest tail of `text` that is the start of a stop string (and shorter than it: a whole
        one has ended the text already): what the matchers hold."""
        return max(self._matched, default=0)


def _prefix_function(s: str) -> list[int]:
    """For each i, the length of the longest proper prefix of `s[:i + 1]` that is also its suffix (where a
    matcher for `s` falls back to when the next character does not continue the match)."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


class TokenTexts:
    """Each token id's own text and bytes, for the logprobs of the HTTP API (cached: a vocabulary's worth at most).

    The text is the tokenizer's decode of the token alone (`tokenizer.decode([id])`), as OpenAI and vLLM give it. A
    token that is not whole UTF-8 by itself (a byte-level BPE token holding part of a character, a byte-fallback
    `<0xE2>`, a byte of the byte tokenizer past ASCII) decodes to U+FFFD there; its `bytes` are then its raw bytes
    where the tokenizer says what they are (the byte tokenizer's id, a byte-level BPE token's characters through
    GPT-2's byte-to-unicode table, sentencepiece's `<0xNN>` pieces), else the UTF-8 of its text, as for every other
    token."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_decoder: dict[str, int] | None = None
        hf = getattr(tokenizer, "_tok", None)
        self._pieces = getattr(hf, "convert_ids_to_tokens", None)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "to_str"):
            try:
                layout = json.loads(backend.to_str())
            except (ValueError, TypeError):
                layout = {}
            if '"ByteLevel"' in json.dumps(layout.get("decoder") or {}):
                self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._raw_bytes(token_id))
        return raw

    def _raw_bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        if isinstance(self._tokenizer, ByteTokenizer):
            return bytes([token_id]) if 0 <= token_id < 256 else text.encode("utf-8")
        piece = self._pieces(token_id) if self._pieces is not None else None
        if isinstance(piece, str):
            if self._byte_decoder is not None and piece and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return text.encode("utf-8")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from bytes to the printable characters byte-level BPE writes them as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_preamble: str | None = None,
    template_kwargs: dict | None = None,
    images: bool = False,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    documents: list[dict] | None = None,
    chat_template: str | None = None,
) -> str:
    """The prompt text for a chat: the tokenizer's own chat template when it has one, else plain
    "role: content" lines ending with "assistant: " for the model to continue.

    `images`: the messages' image_url parts reach the template as {"type": "image"} parts among their text parts (as
    multimodal templates take them: Gemma 3's writes `<start_of_image>` for each, Mistral's `[IMG]`), for the model's
    processor to expand (pylon.serving.engine.images); without it an image part is refused naming it.

    `tools` (OpenAI's tool objects) go to a template that reads them (`tools=`, as Hugging Face templates take
    them); a template that never mentions tools, and the plain lines, get `tool_preamble` as (the start of) the
    system message instead. An assistant message's `tool_calls` reach a template as they are (arguments as
    objects: `pylon.serving.api.tools.template_messages`) and the plain lines as Hermes `<tool_call>` blocks.
    `template_kwargs`: more variables for the template (the request's chat_template_kwargs, checked by name).

    `add_generation_prompt`: the prompt ends with the assistant's header (the template's generation prompt; the plain
    lines' "assistant: "). `continue_final_message`: the last message is left open, the prompt ending with its
    content (Hugging Face's option of that name: a prefilled reply the model continues). `documents`: for a template
    that reads them (retrieval-augmented templates), as Hugging Face passes them. `chat_template`: a template of the
    request's own in place of the tokenizer's (rendered by Hugging Face's sandboxed Jinja, for any tokenizer)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", param="messages")
        plain.append(
            {
                "role": message["role"],
                "content": _content(message.get("content", ""), i, images),
                # what a model's own template may read (a tool result's call id, a participant's name, past calls,
                # an assistant turn's reasoning sent back: tools.template_messages)
                **{
                    k: message[k]
                    for k in ("name", "tool_call_id", "reasoning_content", "thinking")
                    if isinstance(message.get(k), str)
                },
                **({"tool_calls": message["tool_calls"]} if message.get("tool_calls") else {}),
            }
        )
    hf = getattr(tokenizer, "_tok", None) if isinstance(tokenizer, HuggingFaceTokenizer) else None
    template = chat_template or (getattr(hf, "chat_template", None) if hf is not None else None)
    if tools and tool_preamble and not (isinstance(template, str) and "tools" in template):
        if plain[0]["role"] == "system":
            plain[0] = {**plain[0], "content": f"{tool_preamble}\n\n{plain[0]['content']}"}
        else:
            plain.insert(0, {"role": "system", "content": tool_preamble})
        tools = None
    if images and not template:
        raise InvalidRequest(
            "messages: images need the model's chat template, and its tokenizer has none", param="messages"
        )
    if template:
        import jinja2

        options = dict(
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
        try:
            if hf is None:  # a request's template for a tokenizer without Hugging Face's (the byte tokenizer)
                from transformers.utils.chat_template_utils import render_jinja_template

                return render_jinja_template(conversations=[plain], chat_template=template, **options)[0][0]
            return hf.apply_chat_template(plain, tokenize=False, chat_template=chat_template, **options)
        except ValueError if continue_final_message else ():  # Hugging Face's: the content to continue not found
            raise InvalidRequest(
                "continue_final_message: the chat template does not write the last message's content as it is (it "
                "drops or rewrites part of it), so the reply cannot continue it; send the message without it",
                param=f"messages.{len(messages) - 1}",
            ) from None
        except jinja2.TemplateError as e:
            # A template's own refusal (many `raise_exception(...)` for roles out of turn, or a system message
            # they do not take) is about the messages: a 400 that says what it said, not a 500.
            if chat_template:
                raise InvalidRequest(f"chat_template: {type(e).__name__}: {e}", param="chat_template") from None
            raise InvalidRequest(f"messages: the model's chat template refused them: {e}", param="messages") from None
        except Exception as e:  # a request's own template fails however it fails: its 400
            if not chat_template:
                raise
            raise InvalidRequest(f"chat_template: it failed ({type(e).__name__}: {e})", param="chat_template") from None
    lines = "".join(f"{m['role']}: {m['content']}{_plain_calls(m)}\n" for m in plain)
    if continue_final_message:  # the last line left open: the reply continues its content
        return lines[:-1]
    return lines + ("assistant: " if add_generation_prompt else "")


def _plain_calls(message: dict) -> str:
    """An assistant's earlier tool calls in the plain chat lines, as the Hermes blocks it is told to write."""
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        out.append(
            "<tool_call>"
            + json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
            + "</tool_call>"
        )
    return "".join(out)


def _content(content, index: int, images: bool = False) -> str | list[dict]:
    # OpenAI allows a string or a list of parts; text parts join into one string. An assistant message that only calls
    # tools has none (null). With `images`, a message with image_url parts is a list of text and image parts.
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts: list[dict] = []
        for j, p in enumerate(content):
            if p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif p.get("type") == "image_url" and images:
                parts.append({"type": "image"})
            elif p.get("type") == "image_url":
                where = f"messages.{index}.content.{j}"
                raise InvalidRequest(f"{where}: this model takes no images; send text parts only", param=where)
            else:
                break
        else:
            return parts
    raise InvalidRequest(
        f"messages.{index}.content must be a string or a list of text (and image_url) parts", param=f"messages.{index}"
    )
