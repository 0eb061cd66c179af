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
    Magistral). Its calls get ids of 9 letters and digits, the only ids Mistral's chat templates take back.
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
    if MISTRAL_CALLS in text:
        content, _, body = text.partition(MISTRAL_CALLS)
        calls = _mistral(body, plan)
        return ((content.strip() or None), calls) if calls is not None else (text, [])
    calls = _llama_json(text, plan)
    if calls is not None:
        return None, calls
    return text, []


def _hermes(text: str, plan: ToolPlan) -> list[dict] | None:
    bodies = HERMES_BLOCK.findall(text)
    if not bodies or text.count(OPEN) != len(bodies):
        return None
    calls = []
    for body in bodies:
        call = _call(body, plan, arguments_key="arguments")
        if call is None:
            return None
        calls.append(call)
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
        found = [at for at in (self.held.find(OPEN), self.held.find(MISTRAL_CALLS)) if at >= 0]
        if found:
            out, self.held = self.held[: min(found)], self.held[min(found) :]
        else:  # a tail that could still grow into "<tool_call>" or "[TOOL_CALLS]"
            keep = max(tag_prefix(self.held, OPEN), tag_prefix(self.held, MISTRAL_CALLS))
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent += out
        return out

    def _may_be_json(self, text: str) -> bool:
        if not text:
            return True  # nothing but whitespace yet
        return text[0] in "{[" or PYTHON_TAG.startswith(text[: len(PYTHON_TAG)]) or text.startswith(PYTHON_TAG)

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
