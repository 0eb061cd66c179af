"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): what the model is told, what it may say, and
how its text becomes `tool_calls`.

The model is told the tools by its own chat template (`tools=`, as Hugging Face templates take them); a template that
never mentions tools, or a model without a template, gets them in a system preamble in the Hermes format below.

Formats read from the model's output (docs/http.md, "Tool calls"):
  - Hermes / Qwen 2.5 / Qwen 3: one or more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with
    optional text before them (the reply's `content`);
  - Llama 3.1-3.3 JSON: the whole reply one object `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), or a JSON list of them;
  - Mistral: after optional text (the `content`), `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects
    (Mistral 7B v0.3, Nemo), or one or more `[TOOL_CALLS]name[ARGS]{...}` (tokenizers v11+: Mistral Small 3.1+,
    Magistral). Its calls get ids of 9 letters and digits, the only ids Mistral's chat templates take back;
  - Qwen3-Coder: `<tool_call>` blocks of XML, `<function=NAME><parameter=KEY>value</parameter>...</function>`;
  - GLM-4.5 / 4.6: `<tool_call>` blocks of `NAME` then `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs
    (these two formats' values are text, read as JSON where the function's schema does not make them strings);
  - DeepSeek-V3 / R1 / V3.1: after optional text, `<｜tool▁calls▁begin｜>` and `<｜tool▁call▁begin｜>` ...
    `<｜tool▁call▁end｜>` per call (V3's and R1's `function<｜tool▁sep｜>NAME` and a ```json fence; V3.1's
    `NAME<｜tool▁sep｜>{...}`);
  - Kimi K2: after optional text, `<|tool_calls_section_begin|>` and per call `<|tool_call_begin|>functions.NAME:N
    <|tool_call_argument_begin|>{...}<|tool_call_end|>`, the call's id `functions.NAME:N` as written (its template's);
  - Llama 4 pythonic: the whole reply `[name(key=value, ...), ...]` with literal arguments (optionally between
    `<|python_start|>` and `<|python_end|>`).
With `tool_choice` "required" or a named function the output is constrained (`engine/guided.py`) to Hermes blocks
whose arguments follow each function's `parameters` schema, one block unless `parallel_tool_calls`; on chat,
after the model's reasoning and in its own tokens, or as harmony's call for a harmony model (`reply_guide`). With
"auto" the model writes what it likes; a call that does not parse, or names no declared function, comes back as
text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pylon.serving.api.reasoning import tag_prefix
from pylon.serving.engine.guided import check_json_schema
from pylon.serving.errors import InvalidRequest, shown

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# DeepSeek-V3, R1 and V3.1's markers (tokens of their tokenizers, decoded as text), and Kimi K2's
DEEPSEEK_CALLS, DEEPSEEK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# Llama 4's pythonic calls, `[name(arg=value, ...), ...]`, optionally between these
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# Inside a <tool_call> block: Qwen3-Coder's XML (`<function=NAME><parameter=KEY>value</parameter></function>`) and
# GLM-4.5's (`NAME` then `<arg_key>KEY</arg_key><arg_value>value</arg_value>` pairs)
QWEN_XML_FUNCTION = re.compile(r"^<function=([^>\n]+)>(.*?)</function>$", re.DOTALL)
QWEN_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
GLM_KEY = "<arg_key>"  # GLM-4.5's argument tags (its chat template writes them)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# Every marker `parse` reads: a tokenizer that has one as a special token keeps it in a reply's text where the request
# has tools (SamplingParams.keep_special_ids), whatever skip_special_tokens says
MARKERS = (
    OPEN,
    CLOSE,
    PYTHON_TAG,
    MISTRAL_CALLS,
    MISTRAL_ARGS,
    DEEPSEEK_CALLS,
    DEEPSEEK_END,
    DEEPSEEK_CALL,
    DEEPSEEK_SEP,
    DEEPSEEK_CALL_END,
    KIMI_CALLS,
    KIMI_END,
    KIMI_CALL,
    KIMI_ARGS,
    KIMI_CALL_END,
    PYTHON_START,
    PYTHON_END,
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
# A call's JSON as models write it: compact, or with one space after `:` and `,` (json.dumps's and chat templates'
# `tojson`); never padded further, which a weak model would do forever.
ARGUMENT_SPACING = {"whitespace_pattern": "[ ]?"}


@dataclass
class ToolPlan:
    """A request's tools and what it lets the model do with them."""

    functions: dict[str, dict[str, Any]]  # name -> {"name", "description"?, "parameters"}
    tools: list[dict[str, Any]]  # as the request gave them (for the chat template)
    choice: str  # "auto", "required", or the one function's name
    parallel: bool = True
    constrained: bool = field(init=False)

    def __post_init__(self) -> None:
        self.constrained = self.choice != "auto"

    def guide(self) -> dict | None:
        """The engine's grammar (a `SamplingParams.guide`) when the choice constrains the output: Hermes blocks of
        the allowed calls, the tags as text (`reply_guide` writes them as the model's own tokens where it has them)."""
        if not self.constrained:
            return None
        rules = self.hermes_rules(json.dumps(OPEN), json.dumps(CLOSE))
        return {"type": "lark", "grammar": f"start: calls\n{rules}", "param": "tools"}

    def allowed(self) -> list[str]:
        """The functions the output may call: all of them ("required"), or the named one."""
        return list(self.functions) if self.choice == "required" else [self.choice]

    def call_schema(self, names: list[str]) -> dict:
        """The JSON Schema of a Hermes call's body, `{"name": ..., "arguments": {...}}`, of one of `names`, each
        function's arguments held to its `parameters`."""
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": self.functions[name]["parameters"]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name in names
            ],
            "x-guidance": ARGUMENT_SPACING,
        }

    def hermes_rules(self, open_: str, close: str) -> str:
        """Lark rules whose `calls` is one Hermes block of an allowed call (one or more with `parallel`), `open_` and
        `close` the grammar's symbols for `<tool_call>` and `</tool_call>`; a newline or space may pad the body as
        Hermes-trained models write it (`<tool_call>\\n{...}\\n</tool_call>`), and separate the blocks."""
        calls = "call (CALL_GAP? call)*" if self.parallel else "call"
        return (
            f"calls: {calls}\n"
            f"call: {open_} CALL_GAP? body CALL_GAP? {close}\n"
            f"body: %json {json.dumps(self.call_schema(self.allowed()))}\n"
            "CALL_GAP: /[ \\n]{1,2}/\n"
        )

    def preamble(self) -> str:
        """The system text that tells a model without a tool-aware template what it may call, and how."""
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions.values())
        return (
            "You may call one or more functions to answer. The functions, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n"
            f'To call one, answer with {OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE}.'
        )


def plan_of(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's `ToolPlan`, or None when no tool may be called (no tools, or tool_choice "none"). Raises
    InvalidRequest naming the field at fault."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise InvalidRequest(f"tool_choice must be a string or an object (got {shown(tool_choice)})", "tool_choice")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest(f"tool_choice {shown(tool_choice)} needs tools", param="tool_choice")
        return None
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(
                f'{where}: a tool is {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                param=where,
            )
        fn = tool["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise InvalidRequest(f"{where}.function: unknown field {sorted(unknown)[0]!r}", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(
                f"{where}.function.name must be 1-64 letters, digits, _ or - (got {shown(name)})",
                param=f"{where}.function.name",
            )
        if name in functions:
            raise InvalidRequest(f"{where}.function.name: {name!r} is declared twice", param=f"{where}.function.name")
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidRequest(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            where = f"{where}.function.parameters"
            raise InvalidRequest(f"{where} must be a JSON Schema object", param=where)
        check_json_schema(parameters, f"{where}.function.parameters")
        functions[name] = {
            "name": name,
            **({"description": fn["description"]} if "description" in fn else {}),
            "parameters": parameters,
        }
    if tool_choice in (None, "auto"):
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}', param="tool_choice"
            )
        if name not in functions:
            raise InvalidRequest(
                f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(functions)})",
                param="tool_choice.function.name",
            )
        choice = name
    else:
        raise InvalidRequest(
            f'tool_choice must be "none", "auto", "required" or a named function (got {shown(tool_choice)})',
            param="tool_choice",
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolPlan(functions, list(tools), choice, parallel)


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """The reply's `content` and `tool_calls` (OpenAI's shape) from the model's text. Text that holds no well-formed
    call of a declared function is all content, with no calls."""
    calls = _hermes(text, plan)
    if calls is not None:
        content = HERMES_BLOCK.sub("", text).strip()
        return (content or None), calls
    for marker, read in ((MISTRAL_CALLS, _mistral), (DEEPSEEK_CALLS, _deepseek), (KIMI_CALLS, _kimi)):
        if marker in text:
            content, _, body = text.partition(marker)
            calls = read(body, plan)
            return ((content.strip() or None), calls) if calls is not None else (text, [])
    calls = _llama_json(text, plan)
    if calls is None:
        calls = _pythonic(text, plan)
    if calls is not None:
        return None, calls
    return text, []


def _hermes(text: str, plan: ToolPlan) -> list[dict] | None:
    bodies = HERMES_BLOCK.findall(text)
    if not bodies or text.count(OPEN) != len(bodies):
        return None
    calls = []
    for body in bodies:
        call = _call(body if body.startswith("{") else _tagged(body, plan), plan, arguments_key="arguments")
        if call is None:
            return None
        calls.append(call)
    return calls if plan.parallel or len(calls) == 1 else None


def _tagged(body: str, plan: ToolPlan) -> dict | None:
    """A <tool_call> block's body in Qwen3-Coder's XML or GLM-4.5's argument tags, as {"name", "arguments"}: each
    value text, read as JSON where the function's schema does not make it a string (vLLM's qwen3_coder and glm45
    parsers' rule)."""
    found = QWEN_XML_FUNCTION.match(body)
    if found:
        name = found.group(1).strip()
        pairs = [(k.strip(), _unpadded(v)) for k, v in QWEN_XML_PARAMETER.findall(found.group(2))]
    else:
        name, _, rest = body.partition("\n")
        name = name.strip()
        pairs = [(k.strip(), v) for k, v in GLM_ARGUMENT.findall(rest)]
        if GLM_ARGUMENT.sub("", rest).strip():
            return None  # text beside the tags: not this format
    function = plan.functions.get(name)
    if function is None:
        return None
    properties = function["parameters"].get("properties") or {}
    return {"name": name, "arguments": {k: _typed(v, properties.get(k)) for k, v in pairs}}


def _unpadded(value: str) -> str:
    """A Qwen3-Coder value without the newline it is written between (`<parameter=k>\\nvalue\\n</parameter>`)."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: dict | None):
    """A tagged argument's text as its schema types it: a string where the schema says string (or says nothing of
    its type); otherwise the JSON it is (a number, boolean, object, list), else the text itself."""
    kinds = (schema or {}).get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if kinds == [None] or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _deepseek(body: str, plan: ToolPlan) -> list[dict] | None:
    """DeepSeek's calls, from what follows `<｜tool▁calls▁begin｜>`: each `<｜tool▁call▁begin｜>` ...
    `<｜tool▁call▁end｜>`, V3's and R1's `function<｜tool▁sep｜>NAME` then the arguments in a ```json fence,
    V3.1's `NAME<｜tool▁sep｜>` then the arguments."""
    body = body.split(DEEPSEEK_END)[0]
    items = []
    for part in body.split(DEEPSEEK_CALL)[1:]:
        call, ended, _ = part.partition(DEEPSEEK_CALL_END)
        head, sep, rest = call.partition(DEEPSEEK_SEP)
        if not ended or not sep:
            return None
        if head.strip() == "function" and "```" in rest:  # V3, R1: type, name, fenced JSON
            name, _, fenced = rest.partition("\n")
            arguments = fenced.strip().removeprefix("```json").removesuffix("```").strip()
        else:  # V3.1
            name, arguments = head, rest
        try:
            items.append({"name": name.strip(), "arguments": json.loads(arguments)})
        except ValueError:
            return None
    calls = [_call(item, plan, arguments_key="arguments") for item in items]
    if not calls or None in calls:
        return None
    return calls if plan.parallel or len(calls) == 1 else None


def _kimi(body: str, plan: ToolPlan) -> list[dict] | None:
    """Kimi K2's calls: `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`
    each, the id `functions.NAME:INDEX` as written (the only ids its chat template takes back)."""
    body = body.split(KIMI_END)[0]
    calls = []
    for part in body.split(KIMI_CALL)[1:]:
        call, ended, _ = part.partition(KIMI_CALL_END)
        id_, sep, arguments = call.partition(KIMI_ARGS)
        name = id_.strip().removeprefix("functions.").rpartition(":")[0]
        if not ended or not sep or not name:
            return None
        try:
            found = _call({"name": name, "arguments": json.loads(arguments)}, plan, arguments_key="arguments")
        except ValueError:
            return None
        if found is None:
            return None
        found["id"] = id_.strip()
        calls.append(found)
    if not calls:
        return None
    return calls if plan.parallel or len(calls) == 1 else None


def _pythonic(text: str, plan: ToolPlan) -> list[dict] | None:
    """Llama 4's pythonic calls: the whole reply a Python list of calls, `[get_weather(city="Paris"), ...]` (between
    `<|python_start|>` and `<|python_end|>` where the decoded text keeps them), each argument a literal."""
    import ast

    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    items = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (ValueError, SyntaxError):
            return None
        if len(arguments) != len(node.keywords):
            return None  # a **kwargs
        items.append({"name": node.func.id, "arguments": arguments})
    calls = [_call(item, plan, arguments_key="arguments") for item in items]
    if None in calls:
        return None
    return calls if plan.parallel or len(calls) == 1 else None


def _llama_json(text: str, plan: ToolPlan) -> list[dict] | None:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        key = "parameters" if isinstance(item, dict) and "parameters" in item else "arguments"
        call = _call(item, plan, arguments_key=key)
        if call is None:
            return None
        calls.append(call)
    return calls if calls and (plan.parallel or len(calls) == 1) else None


def _mistral(body: str, plan: ToolPlan) -> list[dict] | None:
    """Mistral's calls, from what follows the first `[TOOL_CALLS]`: a JSON list (or object) of calls, or
    `name[ARGS]{...}` segments, each after a `[TOOL_CALLS]` of its own."""
    if body.lstrip().startswith(("[", "{")):
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
    else:
        items = []
        for segment in body.split(MISTRAL_CALLS):
            name, found, arguments = segment.partition(MISTRAL_ARGS)
            try:
                items.append({"name": name.strip(), "arguments": json.loads(arguments)} if found else None)
            except ValueError:
                return None
    calls = [_call(item, plan, arguments_key="arguments", id_=_mistral_id()) for item in items]
    if not calls or None in calls:
        return None
    return calls if plan.parallel or len(calls) == 1 else None


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]


def _call(body: str | dict | None, plan: ToolPlan, *, arguments_key: str, id_: str | None = None) -> dict | None:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or set(body) != {"name", arguments_key}:
        return None
    name, arguments = body["name"], body[arguments_key]
    if name not in plan.functions or not isinstance(arguments, dict):
        return None
    if plan.choice not in ("auto", "required") and name != plan.choice:
        return None
    return {
        "id": id_ or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


# Where a call may start, mid-reply: text from the first of these on is held back while streaming.
CALL_MARKERS = (OPEN, MISTRAL_CALLS, DEEPSEEK_CALLS, KIMI_CALLS)


class ToolStream:
    """Streaming with tools: text that cannot be the start of a call streams as content at once; from a possible
    call on (`<tool_call>`, `[TOOL_CALLS]`, or a reply that opens with `{`, `[` or `<|python_tag|>`), text is held
    until the end, where `finish` parses it into calls, or gives it back as content if it holds none."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent = ""  # content already streamed
        self.held = ""

    def feed(self, text: str) -> str:
        """The part of `text` (with what was held) that can go out as content now."""
        if self.plan.constrained:
            self.held += text
            return ""
        self.held += text
        if not self.sent and self._may_be_json(self.held.lstrip()):
            return ""  # the reply may be a Llama-style JSON call: hold it all
        found = [at for at in (self.held.find(marker) for marker in CALL_MARKERS) if at >= 0]
        if found:
            out, self.held = self.held[: min(found)], self.held[min(found) :]
        else:  # a tail that could still grow into a marker ("<tool_call>", "[TOOL_CALLS]", ...)
            keep = max(tag_prefix(self.held, marker) for marker in CALL_MARKERS)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += out
        return out

    def _may_be_json(self, text: str) -> bool:
        if not text:
            return True  # nothing but whitespace yet
        return text[0] in "{[" or any(
            tag.startswith(text[: len(tag)]) or text.startswith(tag) for tag in (PYTHON_TAG, PYTHON_START)
        )

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, calls) at the end of the reply."""
        content, calls = parse(self.sent + self.held, self.plan)
        if not calls:
            rest, self.held = self.held, ""
            return rest, []
        # Calls found: content not yet sent is what the parse left outside the calls, past what went out already.
        content = content or ""
        rest = content[len(self.sent.strip()) :] if content.startswith(self.sent.strip()) else ""
        self.held = ""
        return rest, calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's `tool_calls` with `arguments` as objects (Hugging Face
    templates write them with `tojson`; a string would be written quoted), and its reasoning sent back (as
    `reasoning_content` or vLLM's `reasoning`) under both names templates read it by: `reasoning_content` (Qwen3's)
    and `thinking` (gpt-oss's, which writes it back on the analysis channel of a turn that called tools)."""
    out = []
    for message in messages:
        thought = message.get("reasoning_content") or message.get("reasoning")
        if thought:
            message = {k: v for k, v in message.items() if k != "reasoning"}
            message.update(reasoning_content=thought, thinking=thought)
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**call, "function": fn})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


def check_tool_calls(messages: list) -> None:
    """An assistant message's `tool_calls` are OpenAI's shape: InvalidRequest naming the one that is not."""
    for i, message in enumerate(messages):
        calls = message.tool_calls or []
        for j, call in enumerate(calls):
            where = f"messages.{i}.tool_calls.{j}"
            fn = call.get("function") if isinstance(call, dict) else None
            if (
                not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", ""), (str, dict))
            ):
                raise InvalidRequest(
                    f'{where}: a tool call is {{"id": ..., "type": "function", "function": {{"name": ..., '
                    f'"arguments": "<JSON>"}}}}',
                    param=where,
                )
        if calls and message.role != "assistant":
            raise InvalidRequest(f"messages.{i}: only assistant messages carry tool_calls", param=f"messages.{i}")
