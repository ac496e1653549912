"""Function calling on /v1/chat/completions (orchestrator/tool_calls.py): the parsers, the plan a tool_choice makes,
the prompt a template with or without tools gets, and calls through the HTTP API with the official client, streamed
and not: a named function's arguments and "required"'s calls follow the functions' JSON Schemas on any model."""

from __future__ import annotations

import json

import openai
import pytest

from orchestrator import http_api, tool_calls
from orchestrator.tool_calls import (
    CallStream,
    ToolError,
    extract,
    held_back,
    parse_hermes,
    parse_llama3_json,
    plan_tools,
)
from specmesh.chat import ChatTemplate
from tests.test_http_api import MODEL, TEMPLATE, AppThread, http_stack, make_service, post

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS_TEMPLATE = ("{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}" + TEMPLATE)
MESSAGES = [{"role": "user", "content": "def weather(city):"}]


# ------------------------------------------------------------------------------------------ parsers
def test_hermes_calls_and_the_content_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_llama3_json_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}
    assert parse_llama3_json("Hello {not a call}") == ("Hello {not a call}", [])
    assert parse_llama3_json('{"name": 3}') == ('{"name": 3}', [])


def test_held_back_keeps_what_may_start_a_call():
    hermes = tool_calls.ToolPlan(parser="hermes")
    assert held_back(hermes, "Sure, <tool") == len("<tool")
    assert held_back(hermes, "Sure, <tool_call>{") == len("<tool_call>{")
    assert held_back(hermes, "Sure, x < y") == 0
    llama = tool_calls.ToolPlan(parser="llama3_json")
    assert held_back(llama, '{"na') == 4 and held_back(llama, "<|pyt") == 5 and held_back(llama, "Hi") == 0


# ------------------------------------------------------------------------------------------ plans
def test_plans_of_each_tool_choice():
    assert plan_tools(None, None, None, None) is None
    assert plan_tools([WEATHER], "none", None, None).tools == []
    auto = plan_tools([WEATHER], None, None, "hermes")
    assert auto.parser == "hermes" and auto.grammar is None and auto.tools[0]["function"]["name"] == "get_weather"
    named = plan_tools([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, None, None)
    assert named.named == "get_time" and named.parser is None
    assert json.loads(named.grammar[1]) == CLOCK["function"]["parameters"]
    required = plan_tools([WEATHER, CLOCK], "required", False, None)
    schema = json.loads(required.grammar[1])
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert "maxItems" not in json.loads(plan_tools([WEATHER], "required", None, None).grammar[1])


@pytest.mark.parametrize(("tools", "choice", "parser", "param", "says"), [
    ([WEATHER], None, None, "tool_choice", "--enable-auto-tool-choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "not among the tools"),
    ([WEATHER], "sometimes", "hermes", "tool_choice", "must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], "required", None, "tools", "letters"),
    ([{"type": "retrieval"}], "required", None, "tools", "must be"),
    ([WEATHER, WEATHER], "required", None, "tools", "unique"),
    (None, "required", None, "tool_choice", "needs tools"),
])
def test_malformed_tools_are_refused(tools, choice, parser, param, says):
    with pytest.raises(ToolError, match=says) as caught:
        plan_tools(tools, choice, None, parser)
    assert caught.value.param == param


def test_a_template_without_tools_is_taught_them_in_the_hermes_format():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    messages, variables = tool_calls.render_messages(history, [WEATHER], template_reads_tools=False)
    assert variables == {} and messages[0]["role"] == "system"
    assert messages[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    messages, variables = tool_calls.render_messages(history, [WEATHER], template_reads_tools=True)
    assert variables == {"tools": [WEATHER]} and messages == history
    assert ChatTemplate(TOOLS_TEMPLATE).reads("tools") and not ChatTemplate(TEMPLATE).reads("tools")


def test_call_streams_send_what_the_whole_output_holds():
    named = CallStream(plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None))
    deltas = [named.push(p) for p in ('{"city": ', '"Oslo", "unit"', ': "celsius"}')] + [named.push("", done=True)]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather" and "id" in deltas[0]["tool_calls"][0]
    streamed = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d)
    assert json.loads(streamed) == {"city": "Oslo", "unit": "celsius"} and named.calls
    auto = CallStream(plan_tools([WEATHER], "auto", None, "hermes"))
    pieces = ["Checking", " now. <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    deltas = [auto.push(p) for p in pieces] + [auto.push("", done=True)]
    assert "".join(d.get("content", "") for d in deltas).strip() == "Checking now."  # (a space streamed before it)
    assert deltas[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = CallStream(plan_tools([WEATHER], "auto", None, "hermes"))
    assert "".join(plain.push(p).get("content", "") for p in ["a <", "b"]) + plain.push("", True).get("content", "") \
        == "a <b" and not plain.calls


# ------------------------------------------------------------------------------------------ through the API
@pytest.fixture(scope="module")
def stack():
    yield from http_stack()


@pytest.fixture(scope="module", params=[TEMPLATE, TOOLS_TEMPLATE], ids=["template-without-tools", "with-tools"])
def client(request, stack):
    service = make_service(stack, default_proposer="fused")
    app = AppThread(http_api.build_app(service, ChatTemplate(request.param, {"eos_token": "<|endoftext|>"}),
                                       tool_parser="hermes"))
    yield openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0, timeout=120), app.url
    app.stop()


def _arguments_follow_the_schema(arguments: dict, function: dict) -> None:
    schema = function["parameters"]
    assert set(arguments) == set(schema["required"])
    for key, value in arguments.items():
        spec = schema["properties"][key]
        assert value in spec["enum"] if "enum" in spec else isinstance(value, str) and len(value) <= spec["maxLength"]


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    openai_client, _ = client
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                  tool_choice=choice, max_tokens=60, temperature=0)
    message = reply.choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content is None
    (call,) = message.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _arguments_follow_the_schema(json.loads(call.function.arguments), WEATHER["function"])
    assert reply.model_extra["specmesh"]["proposer"] == "fused"  # the server's default drafts constrained calls too
    streamed = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                     tool_choice=choice, max_tokens=60, temperature=0, stream=True)
    chunks = list(streamed)
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy: the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_required_makes_one_call_of_the_tools(client):
    openai_client, _ = client
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                                  temperature=0)
    message = reply.choices[0]
    assert message.finish_reason == "tool_calls"
    (call,) = message.message.tool_calls
    function = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]
    _arguments_follow_the_schema(json.loads(call.function.arguments), function)


def test_auto_and_none_answer_in_text_when_the_model_calls_nothing(client):
    openai_client, url = client
    for choice in ("auto", "none"):
        reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                      tool_choice=choice, max_tokens=8, temperature=0)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
    status, error = post(url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER],
                                                        "tool_choice": {"type": "function",
                                                                        "function": {"name": "nope"}}})
    assert status == 400 and error["error"]["param"] == "tool_choice"
    status, error = post(url + "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    assert status == 400 and "constrains the output already" in error["error"]["message"]


def test_auto_is_refused_without_a_parser(stack):
    app = AppThread(http_api.build_app(make_service(stack), ChatTemplate(TEMPLATE)))
    try:
        status, error = post(app.url + "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                                "tools": [WEATHER]})
        assert status == 400 and "--enable-auto-tool-choice" in error["error"]["message"]
    finally:
        app.stop()


def test_extract_of_a_required_output_cut_short_is_its_text():
    plan = plan_tools([WEATHER], "required", None, None)
    assert extract(plan, '[{"name": "get_wea') == ('[{"name": "get_wea', [])
