"""The grammar a constrained chat reply is held to, in the model's own format: a model that reasons first
(`http.reasoning_parser`, or a harmony model's analysis channel) still reasons, and only its answer is held to the
request's JSON schema or tool calls; tags the model has as tokens of their own (`<think>`, `<tool_call>`, harmony's
markers) are those tokens in the grammar, not their spelling.

A request's own guide (`response_format`, or a required or named `tool_choice`: `protocol`, `tools.ToolPlan.guide`)
is written for any model: JSON, or Hermes blocks, from the reply's first token. Held to it as it is, a reasoning
model is made to answer without its reasoning (Qwen3, DeepSeek-R1 and gpt-oss all start with it), and a model whose
tags are tokens of their own is made to spell them out character by character, neither of which it was trained to
do. `for_reply` rewrites the guide for the model being served (one Lark grammar, llguidance's syntax, `<[id]>` a
token by its id):

  - qwen3 (the model opens its block itself; Qwen3 with thinking off writes none):
      `start: (think GAP?)? answer`, `think: <think> THOUGHT </think>`;
  - deepseek_r1 (the chat template opened the block): `start: <think>? THOUGHT </think> GAP? answer`;
  - harmony (gpt-oss): any analysis messages and commentary preambles, then the answer as harmony writes it: a
    message on the `final` channel (`response_format`), or a call of an allowed function on the `commentary` channel
    (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, the recipient before or
    after the channel, `<|constrain|>json` optional); one call a reply, as harmony ends a reply at `<|call|>`;
  - any other model: the request's guide, with its tags as the model's tokens; a required or named tool_choice's calls
    in the model's own markers where its tokenizer has DeepSeek's, Kimi K2's or Mistral's, or its chat template writes
    Qwen3-Coder's or GLM-4.5's argument tags or Llama's `{"name", "parameters"}` JSON (`_native_calls`), else as
    Hermes blocks.
The answer is `%json` of the schema (compact, as OpenAI's structured outputs are), one of structured_outputs' choices,
or the Hermes calls (`tools.ToolPlan.hermes_rules`); a regex or a grammar of the request's own (structured_outputs)
holds the reply from its first token, reasoning model or not. The reasoning is free text: the model thinks as long
as it likes within max_tokens, as under vLLM's reasoning parsers; a reply cut short before its answer has reasoning
only.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pylon.serving.api import tools as tool_calls
from pylon.serving.api.reasoning import END, START
from pylon.serving.engine.guided import JSON_OPTIONS, choice_rule
from pylon.serving.engine.tokenization import added_vocab

if TYPE_CHECKING:
    from pylon.serving.api.harmony import HarmonyTokens

THOUGHT = "THOUGHT: /(?s:.*)/\n"  # free text: a terminal, so that the Earley parser takes it as one lexeme
GAP = "GAP: /[ \\t\\r\\n]{1,4}/\n"  # between the reasoning and the answer (Qwen3 writes "\n\n")


def for_reply(
    guide: dict | None,
    plan: tool_calls.ToolPlan | None,
    tokenizer,
    *,
    parser: str | None = None,
    harmony: HarmonyTokens | None = None,
) -> dict | None:
    """The engine's guide for a chat reply of this model: `guide` (the request's: None, a JSON one, or its tool plan's
    Hermes grammar), with reasoning first where the model reasons (`parser`: http.reasoning_parser; `harmony`: the
    model's harmony tokens) and tags as the model's own tokens (`tokenizer`)."""
    if guide is None:
        return None
    calls = plan is not None and plan.constrained
    if not calls and guide.get("type") not in ("json_object", "json_schema") and "choices" not in guide:
        return guide  # a regex or a grammar of the request's own: held from the reply's first token
    param = guide.get("param") or ("tools" if calls else "response_format")
    if harmony is not None:
        return {"type": "lark", "grammar": _harmony(guide, plan if calls else None, harmony), "param": param}
    if calls:
        answer = _native_calls(plan, tokenizer) or plan.hermes_rules(
            _tag(tokenizer, tool_calls.OPEN), _tag(tokenizer, tool_calls.CLOSE)
        )
        top = "calls"
    elif parser is None:
        return guide  # JSON from the first token: the engine compiles the schema itself
    else:
        answer, top = f"answer: {_body(guide)}\n", "answer"
    if parser is None:
        start = f"start: {top}\n"
    else:
        start = _thinking(tokenizer, parser, top)
    return {"type": "lark", "grammar": start + answer, "param": param}


def _native_calls(plan: tool_calls.ToolPlan, tokenizer) -> str | None:
    """Lark rules whose `calls` are the allowed calls in the model's own markers, where its tokenizer has them as
    tokens: DeepSeek's (V3's and R1's `function<｜tool▁sep｜>NAME` and a ```json fence where its chat template writes
    one, V3.1's `NAME<｜tool▁sep｜>{...}` otherwise) or Kimi K2's (`functions.NAME:N<|tool_call_argument_begin|>{...}`);
    None for any other model (Hermes blocks, then)."""
    deepseek = [_token_id(tokenizer, t) for t in (tool_calls.DEEPSEEK_CALLS, tool_calls.DEEPSEEK_END)]
    deepseek += [_token_id(tokenizer, t) for t in (tool_calls.DEEPSEEK_CALL, tool_calls.DEEPSEEK_SEP)]
    deepseek += [_token_id(tokenizer, tool_calls.DEEPSEEK_CALL_END)]
    kimi = [_token_id(tokenizer, t) for t in (tool_calls.KIMI_CALLS, tool_calls.KIMI_END, tool_calls.KIMI_CALL)]
    kimi += [_token_id(tokenizer, t) for t in (tool_calls.KIMI_ARGS, tool_calls.KIMI_CALL_END)]
    if None not in deepseek:
        begin, end, call, sep, call_end = (f"<[{t}]>" for t in deepseek)
        fenced = "```json" in (_chat_template(tokenizer) or "")
    elif None not in kimi:
        begin, end, call, args, call_end = (f"<[{t}]>" for t in kimi)
    elif _token_id(tokenizer, tool_calls.MISTRAL_CALLS) is not None:
        return _mistral_calls(plan, tokenizer)
    else:
        template = _chat_template(tokenizer) or ""
        if tool_calls.GLM_KEY in template:
            return _tagged_calls(plan, tokenizer, glm=True)
        if "<function=" in template and "<parameter=" in template:
            return _tagged_calls(plan, tokenizer, glm=False)
        if '"parameters": ' in template and '{"name": "' in template:
            return _llama_calls(plan)
        return None
    names = plan.allowed()
    repeat = " (NL? call)*" if plan.parallel else ""  # (DeepSeek writes a newline between its calls)
    lines = [f"calls: {begin} call{repeat} {end}", "call: " + " | ".join(f"call{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        schema = {**plan.functions[name]["parameters"], "x-guidance": tool_calls.ARGUMENT_SPACING}
        if None not in deepseek and fenced:
            head = f'{call} "function" {sep} {json.dumps(name + chr(10) + "```json" + chr(10))}'
            lines.append(f"call{i}: {head} args{i} {json.dumps(chr(10) + '```')} {call_end}")
        elif None not in deepseek:
            lines.append(f"call{i}: {call} {json.dumps(name)} {sep} args{i} {call_end}")
        else:
            lines.append(f"call{i}: {call} {json.dumps('functions.' + name + ':')} INDEX {args} args{i} {call_end}")
        lines.append(f"args{i}: %json {json.dumps(schema)}")
    lines.append("NL: /\\n/")
    if None in deepseek:
        lines.append("INDEX: /[0-9]{1,3}/")
    return "\n".join(lines) + "\n"


def _mistral_calls(plan: tool_calls.ToolPlan, tokenizer) -> str:
    """Lark rules whose `calls` are the allowed calls as Mistral's tokenizers write them: `[TOOL_CALLS]name[ARGS]{...}`
    per call where `[ARGS]` is a token of its own (tokenizers v11+: Mistral Small 3.1 and later, Devstral, Magistral),
    else `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral 7B v0.3, Nemo): what `tools.parse` reads
    back (`_mistral`)."""
    calls, args = _token_id(tokenizer, tool_calls.MISTRAL_CALLS), _token_id(tokenizer, tool_calls.MISTRAL_ARGS)
    names = plan.allowed()
    if args is None:
        schema = plan.call_schema(names)
        spacing = schema.pop("x-guidance")
        listed = {"type": "array", "items": schema, "minItems": 1, "x-guidance": spacing}
        if not plan.parallel:
            listed["maxItems"] = 1
        return f"calls: <[{calls}]> list\nlist: %json {json.dumps(listed)}\n"
    lines = [
        f"calls: call{' call*' if plan.parallel else ''}",
        "call: " + " | ".join(f"call{i}" for i in range(len(names))),
    ]
    for i, name in enumerate(names):
        schema = {**plan.functions[name]["parameters"], "x-guidance": tool_calls.ARGUMENT_SPACING}
        lines.append(f"call{i}: <[{calls}]> {json.dumps(name)} <[{args}]> args{i}")
        lines.append(f"args{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def _llama_calls(plan: tool_calls.ToolPlan) -> str:
    """Lark rules whose `calls` are the allowed calls as Llama 3.1-3.3's and Llama 4's chat templates write them: the
    reply one JSON object `{"name": ..., "parameters": {...}}` (with `parallel`, or a JSON list of them), what
    `tools.parse` reads back (`_llama_json`)."""
    body = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": plan.functions[name]["parameters"]},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in plan.allowed()
        ],
        "x-guidance": tool_calls.ARGUMENT_SPACING,
    }
    calls = 'calls: call | "[" call (", " call)* "]"' if plan.parallel else "calls: call"
    return f"{calls}\ncall: %json {json.dumps(body)}\n"


def _tagged_calls(plan: tool_calls.ToolPlan, tokenizer, *, glm: bool) -> str:
    """Lark rules whose `calls` are the allowed calls as Qwen3-Coder's chat template writes them (`<tool_call>`, then
    `<function=NAME>` and a `<parameter=KEY>` block per argument, each value between newlines) or GLM-4.5's
    (`<tool_call>NAME`, then `<arg_key>KEY</arg_key>` and `<arg_value>VALUE</arg_value>` per argument), tags as the
    model's tokens where it has them. Each argument of the function's `properties` appears once, in their order,
    the required ones always; a value is text where its schema types it as a string (or not at all), held to its enum
    or its minLength and maxLength, and otherwise JSON of its schema: what `tools.parse` reads back (`_typed`)."""
    open_, close = _tag(tokenizer, tool_calls.OPEN), _tag(tokenizer, tool_calls.CLOSE)
    names = plan.allowed()
    repeat = " (NL call)*" if plan.parallel else ""
    lines = [f"calls: call{repeat}", "call: " + " | ".join(f"call{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        schema = plan.functions[name]["parameters"]
        required = set(schema.get("required") or ())
        parts = []
        for k, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            rule = f"p{i}_{k}"
            if glm:
                head = f"{_tag(tokenizer, tool_calls.GLM_KEY)} {json.dumps(key)} {_tag(tokenizer, '</arg_key>')}"
                head += f' "\\n" {_tag(tokenizer, "<arg_value>")}'
                value = _tagged_value(f"v{i}_{k}", sub if isinstance(sub, dict) else {}, "</arg_value>", tokenizer)
            else:
                head = json.dumps(f"<parameter={key}>\n")
                value = _tagged_value(f"v{i}_{k}", sub if isinstance(sub, dict) else {}, "\n</parameter>", tokenizer)
            lines.append(f'{rule}: {head} {value[0]} "\\n"')
            lines.extend(value[1])
            parts.append(rule if key in required else f"{rule}?")
        body = " ".join(parts)
        if glm:
            lines.append(f"call{i}: {open_} {json.dumps(name + chr(10))} {body} {close}")
        else:
            head = json.dumps(f"\n<function={name}>\n")
            lines.append(f'call{i}: {open_} {head} {body} "</function>\\n" {close}')
    lines.append("NL: /\\n/")
    return "\n".join(lines) + "\n"


def _tagged_value(rule: str, schema: dict, end: str, tokenizer) -> tuple[str, list[str]]:
    """An argument's value and the tag `end` after it, as grammar symbols, and the rules they need: text (a string, or
    no type: its enum's strings, or any text within its minLength and maxLength) or JSON of its schema."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    end_id = _token_id(tokenizer, end)
    closing = f"<[{end_id}]>" if end_id is not None else json.dumps(end)
    if kinds != [None] and "string" not in kinds:
        return f"{rule} {closing}", [
            f"{rule}: %json {json.dumps({**schema, 'x-guidance': tool_calls.ARGUMENT_SPACING})}"
        ]
    enum = schema.get("enum")
    if enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(json.dumps(e) for e in enum) + f") {closing}", []
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    text = f"(?s:.{{{low},{'' if high is None else int(high)}}})"
    if end_id is not None:  # the tag is a token: the text is a terminal the token ends
        return f"{rule.upper()} {closing}", [f"{rule.upper()}: /{text}/"]
    spelled = end.replace("\n", "\\n").replace("/", "\\/")  # the text then its tag, ended by the tag's first spelling
    return rule, [f"{rule}[lazy]: /{text}{spelled}/"]


def _chat_template(tokenizer) -> str | None:
    inner = getattr(tokenizer, "_tok", tokenizer)
    template = getattr(inner, "chat_template", None)
    return template if isinstance(template, str) else None


def _thinking(tokenizer, parser: str, top: str) -> str:
    """The start rule and reasoning block of a `<think>` model, under `parser`'s rule, before the rule `top`."""
    opening, closing = _token_id(tokenizer, START), _token_id(tokenizer, END)
    if opening is not None and closing is not None:  # tokens of their own: free text cannot hold them
        if parser == "qwen3":
            return f"start: (think GAP?)? {top}\nthink: <[{opening}]> THOUGHT <[{closing}]>\n{THOUGHT}{GAP}"
        return f"start: <[{opening}]>? THOUGHT <[{closing}]> GAP? {top}\n{THOUGHT}{GAP}"
    # Text tags: the block is one lazy lexeme, ended by the first closing tag.
    if parser == "qwen3":
        return f"start: (think GAP?)? {top}\nthink[lazy]: /<think>(?s:.*)<\\/think>/\n{GAP}"
    return f"start: think GAP? {top}\nthink[lazy]: /(<think>)?(?s:.*)<\\/think>/\n{GAP}"


def _harmony(guide: dict, plan: tool_calls.ToolPlan | None, tokens: HarmonyTokens) -> str:
    """A harmony reply: leading analysis and preamble messages, then the final answer or one call."""
    ch, msg, end, start = (f"<[{t}]>" for t in (tokens.channel, tokens.message, tokens.end, tokens.start))
    lines = [
        "start: lead* answer",
        f'lead: {ch} ("analysis" | "commentary") {msg} TEXT {end} {start} "assistant"',
        "TEXT: /(?s:.*)/",
    ]
    if plan is None:
        lines.append(f'answer: {ch} "final" {msg} body <[{tokens.return_}]>')
        lines.append(f"body: {_body(guide)}")
    else:
        constrain = f'(" " <[{tokens.constrain}]> "json")?'
        names = plan.allowed()
        lines.append("answer: " + " | ".join(f"call{i}" for i in range(len(names))))
        for i, name in enumerate(names):
            to = json.dumps(f" to=functions.{name}")
            # `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`, or the recipient first:
            # ` to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>`
            lines.append(
                f'call{i}: ({ch} "commentary" {to} {constrain} | {to} {ch} "commentary" {constrain}) '
                f"{msg} args{i} <[{tokens.call}]>"
            )
            schema = {**plan.functions[name]["parameters"], "x-guidance": tool_calls.ARGUMENT_SPACING}
            lines.append(f"args{i}: %json {json.dumps(schema)}")
    return "\n".join(lines) + "\n"


def _body(guide: dict) -> str:
    """The grammar of a json_object or json_schema guide's answer (`%json` of its schema, with the engine's JSON
    options), or of a choice's (structured_outputs.choice: one of its strings)."""
    if "choices" in guide:
        return choice_rule(guide["choices"])
    schema = guide.get("schema") if guide.get("type") == "json_schema" else {"type": "object"}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"


def _tag(tokenizer, text: str) -> str:
    """`text` as a grammar symbol: the model's token for it (or its spelling) where it has one, else the string."""
    found = _token_id(tokenizer, text)
    return json.dumps(text) if found is None else f"(<[{found}]> | {json.dumps(text)})"


def _token_id(tokenizer, text: str) -> int | None:
    """The id of the tokenizer's added token `text` (a tag the model was trained to write as one token), or None."""
    return added_vocab(tokenizer).get(text)
