"""Function calling on /v1/chat/completions: OpenAI's ``tools`` / ``tool_choice`` over any chat model.

A request's tools reach the model through its chat template (the ``tools`` variable, as transformers passes it),
or, for a template that never reads ``tools`` (SmolLM2's, most small models'), through a system message in the
Hermes format that names them and says how to call one; earlier turns' ``tool_calls`` and ``tool`` messages are
written in that format too (``render_messages``). What comes back depends on ``tool_choice``:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to that
  function's ``parameters`` JSON Schema (the grammar machinery structured output uses) and becomes that call's
  ``arguments``;
- ``"required"``: constrained to a JSON array of one call (``parallel_tool_calls``: one or more) of the tools,
  each ``{"name": ..., "parameters": {...}}`` with the function's schema, parsed into ``tool_calls``;
- ``"auto"`` (the default when tools are given; vLLM's ``--enable-auto-tool-choice``): free text, parsed by the
  ``--tool-call-parser`` (``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks;
  ``llama3_json``: a JSON object ``{"name": ..., "parameters": ...}``, optionally after ``<|python_tag|>``) into
  ``tool_calls`` and the content around them;
- ``"none"``: no tools offered, plain content.

A response with calls has ``finish_reason`` ``"tool_calls"``. Constrained calls are drafted by the request's
proposer, the server's default unless it names one: measured on SmolLM2-135M (benchmarks/results/tool_calls.md),
``fused`` (which copies the tools' names and the prompt's words) beat the ``grammar`` proposer (the tokens the
schema forces, then ``copy``): τ 2.44 against 1.47.
Written here: OpenAI's shapes and the two parsers are small, and no library shared by the engine does them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")
DEFAULT_PARSER = "hermes"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
ANY_OBJECT = {"type": "object"}


class ToolError(ValueError):
    """A request's tools or tool_choice are malformed (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools: the tools offered to the template (none for ``"none"``), the grammar its output
    follows (None: free text), how the output becomes calls (``named``: the function; ``required``: a JSON array;
    ``parser``: auto's parser)."""

    tools: list[dict] = field(default_factory=list)
    grammar: tuple[str, str] | None = None
    named: str | None = None
    required: bool = False
    parser: str | None = None


def plan_tools(tools: Sequence[Mapping] | None, tool_choice: Any, parallel: bool | None,
               auto_parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools); ToolError for malformed tools or a tool_choice that cannot be
    served (``auto_parser`` None: the server was not started with --enable-auto-tool-choice)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tool names must be unique", "tools")
    offered = [{"type": "function", "function": f} for f in functions]
    if tool_choice == "none":
        return ToolPlan()
    if tool_choice is None or tool_choice == "auto":
        if auto_parser is None:
            raise ToolError('"auto" tool choice needs the server started with --enable-auto-tool-choice (and '
                            '--tool-call-parser); tool_choice "required" or a named function work without it',
                            "tool_choice")
        return ToolPlan(offered, parser=auto_parser)
    if tool_choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                             "parameters": f.get("parameters") or ANY_OBJECT},
                            "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}
        schema = {"type": "array", "items": calls, "minItems": 1, **({} if parallel is not False else {"maxItems": 1})}
        return ToolPlan(offered, ("json_schema", json.dumps(schema)), required=True)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                            "tool_choice")
        parameters = functions[names.index(name)].get("parameters") or ANY_OBJECT
        return ToolPlan(offered, ("json_schema", json.dumps(parameters)), named=name)
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                    '...}}', "tool_choice")


def _function(tool: Mapping, index: int) -> dict:
    """A tool's ``function`` checked: a name (letters, digits, _ and -, as OpenAI's), an optional description and
    a parameters JSON Schema object."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise ToolError(f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ToolError(f"tools[{index}].function.name must be 1-64 letters, digits, _ or -", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ToolError(f"tools[{index}].function.parameters must be a JSON Schema object", "tools")
    return {k: v for k, v in function.items() if k in ("name", "description", "parameters") and v is not None}


# ------------------------------------------------------------------------------------------ the prompt
def render_messages(messages: Sequence[Mapping], tools: Sequence[Mapping], template_reads_tools: bool
                    ) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for the chat template: ``tools`` as a variable when the template reads
    it; otherwise a system message naming the tools in the Hermes format, and earlier calls and their results
    written as text (``<tool_call>`` in the assistant's turn, ``<tool_response>`` in a user turn)."""
    if template_reads_tools:
        return [dict(m) for m in messages], ({"tools": list(tools)} if tools else {})
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if message.get("role") == "assistant" and calls:
            text = "\n".join(f"{HERMES_OPEN}\n{json.dumps(_call_json(c))}\n</tool_call>" for c in calls)
            message["content"] = ((message.get("content") or "") + ("\n" if message.get("content") else "") + text)
        elif message.get("role") == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
        out.append(message)
    if tools:
        listed = "\n".join(json.dumps(t["function"]) for t in tools)
        system = ("You can call functions. Their signatures, as JSON Schemas, are within <tools></tools>:\n"
                  f"<tools>\n{listed}\n</tools>\nTo call one, reply with a JSON object of its name and arguments "
                  'within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                  "<args-json-object>}\n</tool_call>")
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content or ""


def _call_json(call: Mapping) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


# ------------------------------------------------------------------------------------------ the output
def new_call(name: str, arguments: str) -> dict:
    """One entry of ``message.tool_calls``: ``arguments`` a JSON text."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def extract(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output under ``plan``."""
    if plan.named is not None:
        return None, [new_call(plan.named, text.strip())]
    if plan.required:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:  # cut short (max_tokens): the text as it is
            return text, []
        return None, [new_call(c["name"], json.dumps(c.get("parameters", {}))) for c in calls]
    if plan.parser == "hermes":
        return parse_hermes(text)
    if plan.parser == "llama3_json":
        return parse_llama3_json(text)
    return text, []


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen, SmolLM3): the calls, and
    the text outside them as content (None when there is none). A block that is not such an object stays text."""
    calls, kept, last = [], [], 0
    for match in HERMES_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(new_call(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """Llama 3's JSON calls: the output (after an optional ``<|python_tag|>``) is ``{"name": ..., "parameters":
    {...}}``, or several separated by ``;``; anything else is content."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        arguments = obj.get("parameters", obj.get("arguments", {}))
        calls.append(new_call(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return None, calls


def held_back(plan: ToolPlan, text: str) -> int:
    """Streaming with auto's parser: how many characters at the end of ``text`` (the content so far) might be
    the start of a call, so are not sent as content yet. Hermes: from an opening ``<tool_call>`` (or a partial one
    at the end) on; llama3_json: everything once the output starts with ``{`` or ``<|python_tag|>``."""
    if plan.parser == "hermes":
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return len(text) - at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if HERMES_OPEN.startswith(text[-k:]):
                return k
        return 0
    if plan.parser == "llama3_json":
        start = text.lstrip()
        if start.startswith("{") or PYTHON_TAG.startswith(start[: len(PYTHON_TAG)]) and start:
            return len(text)
    return 0


class CallStream:
    """One streamed choice's deltas under a ToolPlan: ``push`` each piece of text as it comes (``done`` with the
    last), get the delta to send. A named function's arguments stream as they come; a required call's JSON array is
    sent whole at the end; with auto's parser, content streams until something may be a call (``held_back``),
    and the calls go out at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything pushed
        self.sent = 0  # characters of it sent as content (auto) or arguments (named)
        self.calls: list[dict] = []

    def push(self, piece: str, done: bool = False) -> dict:
        self.text += piece
        plan = self.plan
        if plan.named is not None:  # every piece is arguments; the first delta names the call
            entry: dict = {"index": 0, "function": {}}
            if not self.calls:
                self.calls = [new_call(plan.named, "")]
                entry.update(id=self.calls[0]["id"], type="function")
                entry["function"]["name"] = plan.named
            new, self.sent = self.text[self.sent :], len(self.text)
            self.calls[0]["function"]["arguments"] += new
            entry["function"]["arguments"] = new
            return {"tool_calls": [entry]} if new or "id" in entry else {}
        if plan.required:  # one JSON array: parsed at the end
            if not done:
                return {}
            content, self.calls = extract(plan, self.text)
            return self._calls_delta(content)
        if plan.parser is None:  # tool_choice "none": content
            return self._content(len(self.text))
        if not done:  # auto: content up to what may start a call
            return self._content(len(self.text) - held_back(plan, self.text))
        content, self.calls = extract(plan, self.text)
        if not self.calls:
            return self._content(len(self.text))
        before = self.text[: self.text.find(HERMES_OPEN)] if HERMES_OPEN in self.text else ""
        return self._calls_delta(before[self.sent :].rstrip() or None)

    def _content(self, upto: int) -> dict:
        new, self.sent = self.text[self.sent : max(upto, self.sent)], max(upto, self.sent)
        return {"content": new} if new else {}

    def _calls_delta(self, content: str | None) -> dict:
        delta: dict = {"content": content} if content else {}
        if self.calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self.calls)]
        return delta
