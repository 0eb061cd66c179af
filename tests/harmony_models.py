"""A tiny tokenizer that speaks OpenAI's harmony format (the chat format of gpt-oss), for the tests of
`pylon.serving.api.harmony`: a byte-level BPE trained on a little text, with harmony's special tokens and a chat
template of our own that lays out a chat as gpt-oss's does (a system message, a developer message with the
instructions and the functions, the turns, the assistant's calls on the commentary channel). Built offline, in
well under a second; its ids fit under the test models' vocabulary (image_models.VOCAB)."""

from __future__ import annotations

from pathlib import Path

HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
SPECIALS = ["<|endoftext|>", *HARMONY_SPECIALS]
TEXT = (
    "<|start|>assistant<|channel|>analysis commentary final to=functions.get_weather json "
    "The user asks about the weather in Tokyo; call the tool. The answer is 4. Thinking about the question... "
    '{"location": "Tokyo", "unit": "celsius"} {"city": "Paris"} You are a helpful assistant. Reasoning: medium '
    "Valid channels: analysis, commentary, final. namespace functions type => any; developer user system "
) * 3

# Our own template (not gpt-oss's): the same layout, written small. Reasoning of an assistant turn is kept only for
# a turn that called tools after the last user message (the model reads its own chain of thought back while it
# works through tool results); earlier turns keep their answers and calls only.
HARMONY_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1, instructions='') -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
  {%- if m.role in ['system', 'developer'] and m.content -%}
    {%- set ns.instructions = ns.instructions ~ ('\n\n' if ns.instructions else '') ~ m.content -%}
  {%- endif -%}
{%- endfor -%}
{{- '<|start|>system<|message|>You are a helpful assistant.\nReasoning: ' ~ (reasoning_effort or 'medium') ~ '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final.<|end|>' -}}
{%- if ns.instructions or tools -%}
  {{- '<|start|>developer<|message|>' -}}
  {%- if ns.instructions -%}
    {{- '# Instructions\n\n' ~ ns.instructions ~ ('\n\n' if tools else '') -}}
  {%- endif -%}
  {%- if tools -%}
    {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
    {%- for tool in tools -%}
      {%- set fn = tool.function if tool.function is defined else tool -%}
      {{- '// ' ~ (fn.description or '') ~ '\ntype ' ~ fn.name ~ ' = (_: ' ~ ((fn.parameters or {}) | tojson) -}}
      {{- ') => any;\n\n' -}}
    {%- endfor -%}
    {{- '} // namespace functions' -}}
  {%- endif -%}
  {{- '<|end|>' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
<|start|>user<|message|>{{ m.content }}<|end|>
  {%- elif m.role == 'assistant' -%}
    {%- if m.reasoning_content and m.tool_calls and loop.index0 > ns.last_user -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
    {%- endif -%}
    {%- if m.content -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
    {%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
<|start|>assistant<|channel|>commentary to=functions.{{ fn.name }} <|constrain|>json<|message|>
      {%- if fn.arguments is string -%}{{ fn.arguments }}{%- else -%}{{ fn.arguments | tojson }}{%- endif -%}
<|call|>
    {%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- set found = namespace(name=m.name or '') -%}
    {%- if not found.name -%}
      {%- for earlier in messages -%}
        {%- for call in earlier.tool_calls or [] -%}
          {%- if call.id is defined and call.id == m.tool_call_id -%}{%- set found.name = call.function.name -%}{%- endif -%}
        {%- endfor -%}
      {%- endfor -%}
    {%- endif -%}
<|start|>functions.{{ found.name or 'tool' }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""


def bpe_tokenizer(specials: list[str], template: str | None = None, text: str = TEXT, **tokens):
    """A `PreTrainedTokenizerFast`: byte-level BPE trained on `text`, with `specials` as its special tokens (ids
    0, 1, ... in order) and the named tokens (`eos_token=...`) among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=310, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **tokens)


def harmony_tokenizer(directory: Path):
    """The harmony tokenizer, saved in `directory` (tokenizer.json, tokenizer_config.json, chat_template.jinja) as a
    checkpoint ships it; returns the `PreTrainedTokenizerFast`."""
    tok = bpe_tokenizer(SPECIALS, HARMONY_TEMPLATE, eos_token="<|return|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    tok.save_pretrained(directory)
    return tok


def harmony_ids(tokenizer, text_with_specials: str) -> list[int]:
    """The ids of a text written with harmony's tokens in it (`<|channel|>final<|message|>...`), each of them one
    token: what a model would generate. `tokenizer`: a `PreTrainedTokenizerFast` or the serving wrapper of one."""
    tok = getattr(tokenizer, "_tok", tokenizer)
    return list(tok.encode(text_with_specials, add_special_tokens=False))


class HarmonyModel:
    """A tiny GPT-OSS checkpoint (with the harmony tokenizer) built to write given harmony replies: each of `replies`
    (texts with harmony's tokens in them, `<|channel|>final<|message|>Hi<|return|>`) is the model's greedy reply to
    any chat, the one `bias(reply)` picks through `logit_bias`.

    Every layer's attention and experts write nothing to the residual (their output projections zero), so the final
    hidden state is the last token's embedding; the lm_head scores each token by the embeddings of the tokens it
    follows in some reply (the prompt's last token, `assistant`, followed by each reply's first token). A token that
    several replies follow with different successors (`<|channel|>` with `analysis`, `final`, `commentary`) scores them
    exactly alike: the request's logit_bias on its own successor there decides. Its attention (sinks, windows) and
    experts are checked elsewhere (tests/unit/serving/engine/test_model_families.py); here the replies are the point:
    the server reads them by channel. generation_config.json ends a generation at `<|return|>` or `<|call|>`."""

    def __init__(
        self, directory: Path, replies: list[str], words: list[str] = (), vocab: int = 320, scale: float = 4.0
    ):
        """`words`: pieces of the replies made tokens of their own (added tokens, matched whole), so that no token
        repeats within a reply with another successor (the tiny BPE splits words into letters)."""
        import json

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        tok = harmony_tokenizer(directory)
        tok.add_tokens(list(words))
        tok.save_pretrained(directory)
        self.tokenizer, self.directory = tok, directory
        self.replies = {r: harmony_ids(tok, r) for r in replies}
        prompt_end = harmony_ids(tok, "<|start|>assistant")[-1]
        self.successors: dict[int, list[int]] = {}
        for ids in self.replies.values():
            for a, b in zip([prompt_end, *ids], ids):
                if b not in self.successors.setdefault(a, []):
                    self.successors[a].append(b)
        config = AutoConfig.for_model(
            "gpt_oss",
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=64,
            head_dim=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
            tie_word_embeddings=False,
            eos_token_id=[tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")],
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.self_attn.o_proj.bias.zero_()
                layer.mlp.experts.down_proj.zero_()
                layer.mlp.experts.down_proj_bias.zero_()
            model.model.norm.weight.fill_(1.0)
            unit = torch.nn.functional.normalize(model.model.embed_tokens.weight, dim=-1)
            head = torch.zeros(vocab, 128)
            for a, nexts in self.successors.items():
                for b in nexts:
                    head[b] += scale * unit[a]
            model.lm_head.weight.copy_(head)
        model.save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        self.eos = config.eos_token_id
        (directory / "generation_config.json").write_text(
            json.dumps({"eos_token_id": self.eos, "pad_token_id": config.pad_token_id})
        )
        self.model = model

    def bias(self, reply: str) -> dict[str, int]:
        """The logit_bias (OpenAI's: token id as a string, +10) that makes `reply` the greedy one: its successor at
        each token that several replies continue otherwise."""
        ids = self.replies[reply]
        prompt_end = harmony_ids(self.tokenizer, "<|start|>assistant")[-1]
        picks = {b for a, b in zip([prompt_end, *ids], ids) if len(self.successors[a]) > 1}
        return {str(t): 10 for t in sorted(picks)}

    def greedy(self, prompt_ids: list[int], reply: str, max_tokens: int) -> list[int]:
        """transformers' greedy continuation of `prompt_ids` under `bias(reply)`, up to an eos or `max_tokens`."""
        import torch

        bias = torch.zeros(self.model.config.vocab_size)
        for t, b in self.bias(reply).items():
            bias[int(t)] = b
        ids, out = list(prompt_ids), []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1] + bias
                token = int(logits.argmax())
                out.append(token)
                ids.append(token)
                if token in self.eos:
                    break
        return out
