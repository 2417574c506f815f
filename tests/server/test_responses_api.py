"""POST /v1/responses (OpenAI's Responses API) through the official `openai` client, streamed and
not, against a real server: the answer equals /v1/chat/completions on the equivalent messages
(greedy), the typed events add up to the non-streamed response, tools round-trip, stored
responses continue with previous_response_id; then the store itself and the 400/404s.

The server runs --reasoning-parser deepseek_r1: requests that want a message use THINKING_OFF
(a template closing the reasoning section in the prompt); without it the whole answer of the
random model is reasoning, which is the reasoning item's test.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import MODEL_NAME
from test_errors import check_error
from test_tool_calling import HERMES_TEXT, THINKING_OFF, WEATHER, random_pieces

from kvtide.reasoning import get_reasoning_parser
from kvtide.server.openai.chat_completions.assembly import ChoiceAssembler
from kvtide.server.openai.chat_completions.tool_call_streams import AutoToolStream
from kvtide.server.openai.chat_completions.tools import AUTO_NEEDS_FLAGS
from kvtide.server.openai.responses.output_items import OutputItems
from kvtide.server.openai.responses.store import ResponseStore
from kvtide.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": WEATHER}}]
OFF = {"chat_template": THINKING_OFF}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def chat_answer(client, messages, max_tokens, **kwargs):
    """The same conversation through /v1/chat/completions (greedy): the ground truth."""
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          temperature=0.0, extra_body=OFF, **kwargs)


def output_text(response) -> str:
    return "".join(part.text for item in response.output if item.type == "message" for part in item.content)


def raw_events(client, **kwargs) -> list:
    return list(client.responses.create(stream=True, **kwargs))


def rebuild(events) -> dict:
    """What a client assembles from the events: the text of each kind and each call's arguments,
    checked against the *.done events on the way."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    texts: dict[str, str] = {}
    calls: dict[str, str] = {}
    for event in events:
        if event.type == "response.output_text.delta":
            texts[event.item_id] = texts.get(event.item_id, "") + event.delta
        elif event.type == "response.reasoning_text.delta":
            texts[event.item_id] = texts.get(event.item_id, "") + event.delta
        elif event.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert event.text == texts.get(event.item_id, "")
        elif event.type == "response.function_call_arguments.delta":
            calls[event.item_id] = calls.get(event.item_id, "") + event.delta
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == calls.get(event.item_id, "")
    final = events[-1].response
    return {"types": [item.type for item in final.output], "texts": texts, "calls": calls, "final": final}


def items_of(response) -> list:
    """Output items without their random ids."""
    result = []
    for item in response.output:
        if item.type == "function_call":
            result.append(("function_call", item.name, item.arguments, item.status))
        else:
            result.append((item.type, "".join(part.text for part in item.content), item.status))
    return result


# ---- unit: the store ---------------------------------------------------------------------------
def test_store_is_a_bounded_lru():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(3):
        assert store.put(f"r{i}", {"id": f"r{i}"}, [{"content": "x"}])
    assert store.get("r0") is not None  # r0 is now the most recent
    store.put("r3", {"id": "r3"}, [])
    assert store.get("r1") is None and {"r0", "r2", "r3"} == {k for k in ("r0", "r1", "r2", "r3") if store.get(k)}
    assert store.put("big", {"id": "big"}, [{"content": "y" * 9_960}])
    assert len(store) == 1 and store.get("big") is not None and store.num_bytes <= 10_000
    assert not store.put("huge", {"id": "huge"}, [{"content": "z" * 20_000}]) and store.get("huge") is None
    assert store.delete("big") and not store.delete("big") and store.num_bytes == 0


def built_items(pieces: list[str], status: str = "completed") -> tuple[list, list]:
    """Output items (without ids) and events of a reasoning + text + hermes-calls answer fed in pieces."""
    assembler = ChoiceAssembler(get_reasoning_parser("deepseek_r1")(None),
                                AutoToolStream(get_tool_parser("hermes")(None)))
    items = OutputItems()
    events = [e for piece in pieces for e in items.feed(assembler.feed(piece))]
    events += items.feed(assembler.finish()) + items.finish(status)
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items.items], events


def test_output_items_do_not_depend_on_the_split():
    text = "Hmm, the weather.</think>" + HERMES_TEXT
    whole, _ = built_items([text])
    assert [item["type"] for item in whole] == ["reasoning", "message", "function_call", "function_call"]
    assert whole[0]["content"][0]["text"] == "Hmm, the weather." and whole[1]["content"][0]["text"] == "Let me look."
    assert [(c["name"], c["arguments"]) for c in whole[2:]] == [("get_weather", '{"city": "Paris", "days": 2}'),
                                                                ("get_time", '{"zone": "utc"}')]
    assert all(item["status"] == "completed" for item in whole)
    for seed in range(10):
        items, events = built_items(random_pieces(text, seed))
        assert items == whole, seed
        # Every item is added, then done, in output order; the done events carry the whole item.
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert added == [e["output_index"] for e in done] == list(range(4))
        assert [{k: v for k, v in e["item"].items() if k not in ("id", "call_id")} for e in done] == whole


def test_a_cut_answer_marks_its_last_item_incomplete():
    items, _ = built_items(["Hmm", "</think>Partial"], status="incomplete")
    assert [(item["type"], item["status"]) for item in items] == [("reasoning", "completed"),
                                                                  ("message", "incomplete")]
    assert built_items([], status="completed")[0] == [  # nothing at all: one empty message
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}]


# ---- end to end --------------------------------------------------------------------------------
def test_text_equals_chat_and_the_stream_adds_up(tools_client):
    kwargs = dict(model=MODEL_NAME, instructions="Be brief.", input="Tell me about Paris.", max_output_tokens=12,
                  temperature=0.0, extra_body=OFF)
    response = tools_client.responses.create(**kwargs)
    chat = chat_answer(tools_client, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Tell me about Paris."}], 12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert output_text(response) == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"

    events = raw_events(tools_client, **kwargs)
    got = rebuild(events)
    assert [e.type for e in events[2:5]] == ["response.output_item.added", "response.content_part.added",
                                             "response.output_text.delta"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.incomplete"]
    assert list(got["texts"].values()) == [output_text(response)]
    assert items_of(got["final"]) == items_of(response)
    # The client's own accumulator checks the event order as it reads them (OpenAI ends a cut
    # answer with response.incomplete, which it passes on).
    with tools_client.responses.stream(**kwargs) as stream:
        last = list(stream)[-1]
    assert last.type == "response.incomplete" and items_of(last.response) == items_of(response)


def test_completed_answer_and_stream_helper(tools_client):
    kwargs = dict(model=MODEL_NAME, input="Hi", max_output_tokens=200, temperature=0.0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
                  extra_body=OFF)
    response = tools_client.responses.create(**kwargs)
    assert response.status == "completed" and response.incomplete_details is None
    jsonschema.validate(json.loads(output_text(response)), ANSWER)
    assert response.text.format.type == "json_schema"
    events = raw_events(tools_client, **kwargs)
    assert events[-1].type == "response.completed"
    assert items_of(rebuild(events)["final"]) == items_of(response)
    with tools_client.responses.stream(**kwargs) as stream:
        assert items_of(stream.get_final_response()) == items_of(response)


def test_reasoning_item(tools_client):
    kwargs = dict(model=MODEL_NAME, input="Think about it.", max_output_tokens=10, temperature=0.0)
    response = tools_client.responses.create(**kwargs)
    chat = tools_client.chat.completions.create(model=MODEL_NAME, max_tokens=10, temperature=0.0,
                                                messages=[{"role": "user", "content": "Think about it."}])
    [item] = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_")
    assert item.content[0].text == chat.choices[0].message.reasoning_content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 10
    events = raw_events(tools_client, **kwargs)
    assert "response.reasoning_text.delta" in {e.type for e in events}
    assert items_of(rebuild(events)["final"]) == items_of(response)


def test_tool_call_round_trip(tools_client):
    user = {"role": "user", "content": "What is the weather in Paris?"}
    first = tools_client.responses.create(model=MODEL_NAME, input=[user], tools=TOOLS, max_output_tokens=100,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0.0, extra_body=OFF)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with tools_client.responses.stream(model=MODEL_NAME, input=[user], tools=TOOLS, max_output_tokens=100,
                                       tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0,
                                       extra_body=OFF) as stream:
        assert items_of(stream.get_final_response()) == items_of(first)
    # The call goes back with its result; the answer equals chat's on the same conversation.
    follow_up = [user, *[item.model_dump(exclude_none=True) for item in first.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = tools_client.responses.create(model=MODEL_NAME, input=follow_up, tools=TOOLS, tool_choice="none",
                                           max_output_tokens=8, temperature=0.0, store=False, extra_body=OFF)
    chat = chat_answer(tools_client, [
        user, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], 8, tools=CHAT_TOOLS,
        tool_choice="none")
    assert output_text(second) == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_required_tool_calls_stream_adds_up(tools_client):
    kwargs = dict(model=MODEL_NAME, input="Weather?", tools=TOOLS, tool_choice="required", max_output_tokens=150,

                  temperature=1.0, extra_body={**OFF, "seed": 4})
    response = tools_client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    events = raw_events(tools_client, **kwargs)
    got = rebuild(events)
    assert items_of(got["final"]) == items_of(response)
    assert list(got["calls"].values()) == [c.arguments for c in calls]
    with tools_client.responses.stream(**kwargs) as stream:
        last = list(stream)[-1]
    assert items_of(last.response) == items_of(response)


def test_previous_response_id_continues_the_conversation(tools_client):
    first = tools_client.responses.create(model=MODEL_NAME, input="Hello!", max_output_tokens=6, temperature=0.0,
                                          instructions="Only for the first turn.", extra_body=OFF)
    assert first.store is True
    second = tools_client.responses.create(model=MODEL_NAME, input="And then?", previous_response_id=first.id,
                                           max_output_tokens=6, temperature=0.0, extra_body=OFF)
    assert second.previous_response_id == first.id
    chat = chat_answer(tools_client, [{"role": "user", "content": "Hello!"},
                                      {"role": "assistant", "content": output_text(first)},
                                      {"role": "user", "content": "And then?"}], 6)
    assert output_text(second) == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # Streamed answers are stored too, and chain on.
    events = raw_events(tools_client, model=MODEL_NAME, input="Go on.", previous_response_id=second.id,
                        max_output_tokens=4, temperature=0.0, extra_body=OFF)
    third = tools_client.responses.retrieve(events[-1].response.id)
    assert items_of(third) == items_of(events[-1].response)

    assert tools_client.responses.retrieve(first.id).model_dump() == first.model_dump()
    tools_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        tools_client.responses.create(model=MODEL_NAME, input="x", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    unstored = tools_client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        tools_client.responses.retrieve(unstored.id)


def test_storage_can_be_disabled(openai_client):
    client = openai_client  # the `server` fixture runs with --disable-response-storage
    response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=response.id)


def _item(**fields):
    return {"model": MODEL_NAME, "max_output_tokens": 4, **fields}


BAD = [
    ("unknown item type", _item(input=[{"type": "item_reference", "id": "x"}]), 400, "input"),
    ("image part", _item(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
     "input"),
    ("unknown role", _item(input=[{"role": "robot", "content": "hi"}]), 400, "input"),
    ("empty input", _item(input=[]), 400, "input"),
    ("function_call_output without call_id", _item(input=[{"type": "function_call_output", "output": "x"}]), 400,
     "input"),
    ("no input", {"model": MODEL_NAME}, 400, "input"),
    ("web search tool", _item(input="x", tools=[{"type": "web_search"}]), 400, "tools"),
    ("tool choice of an unknown tool", _item(input="x", tools=TOOLS, tool_choice={"type": "function", "name": "g"}),
     400, "tool_choice"),
    ("auto without the server's parser is fine here, a bad schema is not",
     _item(input="x", text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "objectx"}}}), 400,
     "text.format"),
    ("json_schema without schema", _item(input="x", text={"format": {"type": "json_schema", "name": "s"}}), 400,
     "text.format"),
    ("too many output tokens", _item(input="x", max_output_tokens=100_000), 400, "max_output_tokens"),
    ("background", _item(input="x", background=True), 400, "background"),
    ("unknown previous response", _item(input="x", previous_response_id="resp_nope"), 404, "previous_response_id"),
    ("unknown model", _item(input="x", model="nope"), 404, "model"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(tools_server, name, body, status, param):
    with tools_server.client() as client:
        check_error(client.post("/v1/responses", json=body), status, param)


def test_unknown_ids_are_404(tools_server):
    with tools_server.client() as client:
        check_error(client.get("/v1/responses/resp_nope"), 404)
        check_error(client.delete("/v1/responses/resp_nope"), 404)


def test_tools_without_a_choice_need_the_servers_parser(openai_client):
    # As on chat: tools alone mean tool_choice "auto", which needs --tool-call-parser; named works.
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL_NAME, input="x", tools=TOOLS, max_output_tokens=4)
    assert info.value.body["param"] == "tool_choice" and info.value.body["message"] == AUTO_NEEDS_FLAGS
    response = openai_client.responses.create(model=MODEL_NAME, input="x", tools=TOOLS, max_output_tokens=60,
                                              tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in response.output] == ["function_call"]
