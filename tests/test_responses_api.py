"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client: the same answer as the
chat completion it stands for (reasoning, text, function calls, adapters, images, JSON schema), whole and
streamed as typed events, and clear 400s for what hylora does not keep or run."""

from __future__ import annotations

import base64
import json
import time

import httpx
import jsonschema
import openai
import pytest

from hylora.server.responses import ResponsesRequest
from tests.scripted_model import write_scripted_model
from tests.server_helpers import running_server

CALL_TAGS = ("<function=find_relic>", "<parameter=site>", "</parameter>", "</function>")
# thinking (the template opens <think>), an answer, then a call
SCRIPT = ["\n", "The", " relic", " is", " bronze", "</think>", " jade", ".", "<tool_call>", *CALL_TAGS[:2], "t",
          "omb", *CALL_TAGS[2:], "</tool_call>", "<|im_end|>"]  # fmt: skip
FIND_RELIC = {
    "type": "function",
    "name": "find_relic",
    "description": "Where a relic was found",
    "parameters": {"type": "object", "properties": {"site": {"type": "string"}}, "required": ["site"]},
}
ASK = "Where was the relic found?"


def _client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scripted(demo_dir, demo_cache_dir, tmp_path_factory):
    model = write_scripted_model(demo_dir, tmp_path_factory.mktemp("scripted") / "m", SCRIPT, CALL_TAGS)
    args = [str(model), "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", "--served-model-name",
            "scripted", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
            "qwen3_coder"]  # fmt: skip
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield _client(handle)


@pytest.fixture(scope="module")
def demo(demo_cache_dir, tmp_path_factory):
    args = ["--demo", "--max-model-len", "512", "--dtype", "float32", "--device", "cpu"]
    with running_server(args, demo_cache_dir, tmp_path_factory.mktemp("logs") / "server.log") as handle:
        yield _client(handle)


def _shape(output) -> list[tuple]:
    """Output items without their ids: (type, text or call)."""
    shape = []
    for item in output:
        if item.type == "message":
            shape.append(("message", "".join(part.text for part in item.content)))
        elif item.type == "reasoning":
            shape.append(("reasoning", "".join(part.text for part in item.content or [])))
        else:
            shape.append((item.type, item.name, json.loads(item.arguments)))
    return shape


def test_reasoning_text_and_function_call_as_output_items(scripted):
    chat = scripted.chat.completions.create(model="scripted", messages=[{"role": "user", "content": ASK}],
                                            tools=[{"type": "function", "function": {k: v for k, v in FIND_RELIC.items()
                                                                                      if k != "type"}}])  # fmt: skip
    response = scripted.responses.create(model="scripted", input=ASK, tools=[FIND_RELIC])
    assert response.status == "completed" and response.model == "scripted"
    assert _shape(response.output) == [("reasoning", "The relic is bronze"), ("message", " jade."),
                                       ("function_call", "find_relic", {"site": "tomb"})]  # fmt: skip
    assert response.output_text == chat.choices[0].message.content == " jade."
    call = response.output[2]
    assert call.call_id.startswith("call_") and call.status == "completed"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_the_stream_is_typed_events_that_add_up_to_the_response(scripted):
    whole = scripted.responses.create(model="scripted", input=ASK, tools=[FIND_RELIC])
    events = list(scripted.responses.create(model="scripted", input=ASK, tools=[FIND_RELIC], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert _shape(final.output) == _shape(whole.output) and final.usage.output_tokens == whole.usage.output_tokens
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert (reasoning, text, json.loads(arguments)) == ("The relic is bronze", " jade.", {"site": "tomb"})
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [d.type for d in done] == ["reasoning", "message", "function_call"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]
    assert done[1].content[0].text == " jade." and json.loads(done[2].arguments) == {"site": "tomb"}


def test_instructions_with_unicode_line_separators_stay_on_their_event_lines(demo):
    """The stream's first events echo the instructions; U+2028 / U+2029 / U+0085 in them end a line for
    Python's str.splitlines (httpx's iter_lines): escaped, every data line is whole JSON."""
    instructions = "Answer\u2028briefly\u2029and\x85plainly"
    body = {"model": "relic", "input": "Hi", "instructions": instructions, "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{demo.base_url}responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[len("data: ") :]) for line in data]
    assert events[0]["response"]["instructions"] == instructions
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_max_output_tokens_ends_incomplete_and_history_items_render(scripted):
    cut = scripted.responses.create(model="scripted", input=ASK, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    streamed = list(scripted.responses.create(model="scripted", input=ASK, max_output_tokens=3, stream=True))
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.usage.output_tokens == 3
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "find_relic", "arguments": '{"site": "tomb"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "north chamber"},
        {"role": "developer", "content": "Answer briefly."},
    ]
    again = scripted.responses.create(model="scripted", input=history, instructions="You dig.", tools=[FIND_RELIC])
    assert again.output[-1].type == "function_call" and again.instructions == "You dig."
    assert again.usage.input_tokens > cut.usage.input_tokens  # the call and its result are in the prompt


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"previous_response_id": "resp_1"}, "send the conversation so far in input"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "hosted tool"),
        ({"input": [{"type": "computer_call_output"}]}, "item type 'computer_call_output'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
        ({"model": "no-such-adapter"}, "no-such-adapter"),
    ],
)
def test_what_hylora_does_not_keep_or_run_is_a_400(scripted, fields, needle):
    with pytest.raises(openai.APIStatusError) as err:
        scripted.responses.create(**({"model": "scripted", "input": ASK} | fields))
    assert err.value.status_code in (400, 404) and needle in str(err.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"input": [{"role": "user", "content": ["a bare string part"]}]},
        {"input": [{"role": "user", "content": {"type": "input_text", "text": "not a list"}}]},
        {"input": [{"role": ["user"], "content": "x"}]},
        {"input": [{"type": "function_call", "call_id": 5, "name": "find_relic", "arguments": "{}"}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": "find_relic", "arguments": "{not json"}]},
        {"input": [{"type": "function_call_output", "call_id": ["c"], "output": "x"}]},
        {"input": []},
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        {"text": {"format": "json"}},
        {"text": {"format": {"type": "json_schema", "name": "m", "schema": {"type": "nonsense"}}}},
        {"tools": [{"type": "function"}]},
        {"tools": [FIND_RELIC], "tool_choice": {"type": "function", "name": "nope"}},
        {"max_output_tokens": -1},
        {"temperature": "hot"},
        {"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "id": "rs_1", "summary": "a string"}]},
        {"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "content": [{"type": "reasoning_text"}]}]},
    ],
)
def test_malformed_responses_requests_are_400s_and_serving_goes_on(scripted, fields):
    body = {"model": "scripted", "input": ASK} | fields
    url = str(scripted.base_url).rstrip("/")
    r = httpx.post(f"{url}/responses", json=body, timeout=60)
    assert r.status_code == 400, (fields, r.status_code, r.text)
    assert r.json()["error"]["message"]
    assert scripted.responses.create(model="scripted", input=ASK, max_output_tokens=2).status == "incomplete"


def test_hostile_responses_beside_a_stream_leave_it_unchanged(demo):
    """A streaming Responses request runs while malformed ones and a broken image arrive: each of those fails
    alone, and the stream's text is the one it gives alone."""
    import threading

    ask = dict(model="relic", input=ASK, max_output_tokens=48, temperature=0, extra_body={"ignore_eos": True})

    def streamed_text() -> str:
        events = demo.responses.create(**ask, stream=True)
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")

    alone = streamed_text()
    result = {}
    neighbour = threading.Thread(target=lambda: result.setdefault("text", streamed_text()))
    neighbour.start()
    url = str(demo.base_url).rstrip("/")
    broken_image = "data:image/png;base64," + base64.b64encode(b"\x89PNG not an image").decode()
    hostile = [
        {"model": "relic", "input": [{"role": "user", "content": ["bare"]}]},
        {"model": "relic", "input": ASK, "temperature": -3},
        {
            "model": "relic",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": broken_image}]}],
        },
        {"model": "relic", "input": ASK, "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
    ]
    for body in hostile:
        assert httpx.post(f"{url}/responses", json=body, timeout=60).status_code == 400, body
    neighbour.join(timeout=120)
    assert result["text"] == alone and alone


def test_adapters_images_and_json_schema_as_on_chat(demo, demo_dir):
    """Each request reaches its adapter (the same greedy text as the chat completion under that name), an
    input_image is seen, and text.format json_schema constrains the answer."""
    texts = {}
    for model in ("hylora-demo", "relic", "tomb"):
        chat = demo.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}], max_tokens=12,
                                            temperature=0)  # fmt: skip
        response = demo.responses.create(model=model, input=ASK, max_output_tokens=12, temperature=0)
        assert response.output_text == chat.choices[0].message.content and response.model == model
        texts[model] = response.output_text
    assert len(set(texts.values())) == 3  # each adapter answers its own way
    image = "data:image/png;base64," + base64.b64encode((demo_dir / "media" / "relic.png").read_bytes()).decode()
    seen = demo.responses.create(model="relic", max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is this?"}]}])  # fmt: skip
    plain = demo.responses.create(model="relic", max_output_tokens=4, input="What is this?")
    assert seen.usage.input_tokens > plain.usage.input_tokens + 4  # the image's tokens
    schema = {"type": "object", "properties": {"material": {"enum": ["bronze", "jade"]}}, "required": ["material"],
              "additionalProperties": False}  # fmt: skip
    shaped = demo.responses.create(model="tomb", input=ASK, max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "m", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(shaped.output_text), schema)


def test_logprobs_of_the_answer_whole_and_streamed(demo, scripted):
    """include message.output_text.logprobs (+ top_logprobs): the answer's tokens with their logprobs, as the
    chat completion gives them; with a reasoning split, only the answer's (after </think>)."""
    ask = dict(model="tomb", input=ASK, max_output_tokens=5, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])  # fmt: skip
    chat = demo.chat.completions.create(model="tomb", messages=[{"role": "user", "content": ASK}], max_tokens=5,
                                        temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    want = [(t.token, round(t.logprob, 4), len(t.top_logprobs)) for t in chat.choices[0].logprobs.content]
    part = demo.responses.create(**ask).output[0].content[0]
    assert [(t.token, round(t.logprob, 4), len(t.top_logprobs)) for t in part.logprobs] == want
    assert len(want) == 5  # one per token (their text may split a character: the demo's byte-level tokens)
    deltas = [e for e in demo.responses.create(**ask, stream=True) if e.type == "response.output_text.delta"]
    assert [(t.token, round(t.logprob, 4), len(t.top_logprobs)) for e in deltas for t in e.logprobs] == want
    answer = scripted.responses.create(model="scripted", input=ASK, include=["message.output_text.logprobs"],
                                       max_output_tokens=7).output[1].content[0]  # fmt: skip
    assert answer.text == " jade." and [t.token for t in answer.logprobs] == [" jade", "."]


def test_a_stored_response_asked_for_is_a_404_that_says_none_are_kept(scripted):
    for call in (scripted.responses.retrieve, scripted.responses.delete, scripted.responses.cancel,
                 scripted.responses.input_items.list):  # fmt: skip
        with pytest.raises(openai.NotFoundError, match="keeps no responses"):
            call("resp_123")


def test_a_client_gone_mid_stream_aborts_its_request(demo):
    """Hanging up on a Responses stream aborts the request beneath it and frees its pages, as on chat."""
    url = str(demo.base_url).rstrip("/")
    body = {"model": "relic", "input": "Describe.", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # go away mid-stream
    metrics = url.removesuffix("/v1") + "/metrics"
    for _ in range(100):
        text = httpx.get(metrics, timeout=10).text
        running = [line for line in text.splitlines() if line.startswith("hylora_running_requests ")]
        if running and float(running[0].split()[1]) == 0:
            break
        time.sleep(0.1)
    assert running and float(running[0].split()[1]) == 0
    assert 'hylora_requests_total{adapter="relic",status="abort"}' in text


REASONING = "The site list names the tomb first."
CALL = {"type": "function_call", "call_id": "call_1", "name": "find_relic", "arguments": '{"site": "tomb"}'}


def _reasoning_item(text: str, where: str = "content") -> dict:
    parts = {"content": [{"type": "reasoning_text", "text": text}], "summary": []}
    if where == "summary":
        parts = {"content": [], "summary": [{"type": "summary_text", "text": text}]}
    return {"type": "reasoning", "id": "rs_1", **parts}


def test_one_turns_items_are_one_assistant_message_with_its_reasoning():
    """A Response's output items for one turn (reasoning, message, function calls) come back as the one
    assistant message the chat template renders: the reasoning in its think block (vLLM makes each item
    a message of its own); a summary serves where there is no reasoning text; encrypted content alone
    (hylora writes none) is left out; reasoning with no output after it is a turn of its own."""
    user = {"role": "user", "content": ASK}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "north chamber"}
    turn = ResponsesRequest(input=[user, _reasoning_item(REASONING), said, CALL, output])._messages()
    assert [m["role"] for m in turn] == ["user", "assistant", "tool"]
    assert turn[1]["reasoning"] == REASONING and turn[1]["tool_calls"][0]["id"] == "call_1"
    assert turn[1]["content"] == [{"type": "text", "text": "Let me look."}]
    summary = ResponsesRequest(input=[user, _reasoning_item(REASONING, "summary"), CALL])._messages()
    assert summary[1]["reasoning"] == REASONING
    sealed = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAA"}
    assert "reasoning" not in ResponsesRequest(input=[user, sealed, CALL])._messages()[1]
    alone = ResponsesRequest(input=[user, _reasoning_item(REASONING), output])._messages()
    assert alone[1] == {"role": "assistant", "content": "", "reasoning": REASONING} and alone[2]["role"] == "tool"


def test_a_reasoning_item_sent_back_is_in_the_prompt_as_on_chat(scripted):
    """The reasoning item before a function call counts in the prompt as the chat request's assistant
    turn with that reasoning does (until now it was dropped)."""
    items = [{"role": "user", "content": ASK}, _reasoning_item(REASONING), CALL,
             {"type": "function_call_output", "call_id": "call_1", "output": "north chamber"}]  # fmt: skip
    with_it = scripted.responses.create(model="scripted", input=items, tools=[FIND_RELIC], max_output_tokens=1)
    without = scripted.responses.create(model="scripted", input=items[:1] + items[2:], tools=[FIND_RELIC],
                                        max_output_tokens=1)  # fmt: skip
    call = {"id": "call_1", "type": "function", "function": {"name": "find_relic", "arguments": CALL["arguments"]}}
    chat = scripted.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [call],
                  "reasoning": REASONING}, {"role": "tool", "tool_call_id": "call_1", "content": "north chamber"}],
        tools=[{"type": "function", "function": {k: v for k, v in FIND_RELIC.items() if k != "type"}}],
        max_tokens=1,
    )  # fmt: skip
    assert with_it.usage.input_tokens == chat.usage.prompt_tokens > without.usage.input_tokens
