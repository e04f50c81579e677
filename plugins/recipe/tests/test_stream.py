"""The output side: engine RequestOutputs -> API responses, driven by hand-built outputs."""

from __future__ import annotations

import json

import pytest
from deepinfer_recipe.encoding import RecipeChatEncoding
from deepinfer_recipe.tokenizer import DeepseekTokenizer

from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput

EOS = 1


@pytest.fixture(scope="module")
def encoding(v4_tokenizer: DeepseekTokenizer) -> RecipeChatEncoding:
    return RecipeChatEncoding(v4_tokenizer, "deepseek_v4", ["tiny-v4"])


def outputs_for(prompt: list[int], generated: list[int], finish_reason: str = "stop", cached: int = 0,
                logprobs: bool = False) -> list[RequestOutput]:
    """One RequestOutput per generated token, cumulative, the last one finished."""
    steps = []
    for n in range(1, len(generated) + 1):
        done = n == len(generated)
        lps = [{t: Logprob(-0.5), 7: Logprob(-1.5)} for t in generated[:n]] if logprobs else None
        completion = CompletionOutput(0, "", generated[:n], None, lps, finish_reason if done else None)
        steps.append(RequestOutput("r", None, prompt, [completion], done, num_cached_tokens=cached))
    return steps


def run(encoding: RecipeChatEncoding, api: str, body: dict, generated: list[int], **kw: object) -> tuple[list[str], object]:
    prepared = encoding.prepare(api, body, 4096)
    stream = encoding.open_stream(prepared, {"chat": "chatcmpl-1", "responses": "resp_1", "messages": "msg_1"}[api],
                                  [EOS])
    frames = []
    for output in outputs_for(prepared.prompt_token_ids, generated, **kw):
        frames += stream.push(output)
        if stream.finished:
            break
    frames += stream.finish()
    return frames, stream


def test_eos_never_reaches_the_text_but_counts_as_generated(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("Hello there") + [EOS]
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    _, stream = run(encoding, "chat", body, generated, cached=4)
    response = json.loads(stream.response_json())
    assert response["choices"][0]["message"]["content"] == "Hello there"
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] == len(generated)
    assert response["usage"]["prompt_cache_hit_tokens"] == 4


def test_reasoning_and_tool_calls_are_parsed(encoding, v4_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    answer = ("Need weather.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
              "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n"
              "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "weather?"}], "tools": tools}
    _, stream = run(encoding, "chat", body, v4_tokenizer.encode(answer) + [EOS])
    message = json.loads(stream.response_json())["choices"][0]["message"]
    assert message["reasoning_content"] == "Need weather."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_stop_sequence_finishes_before_the_engine(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("one two STOP three four five") + [EOS]
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "count"}],
            "thinking": {"type": "disabled"}, "stop": ["STOP"], "stream": True}
    frames, stream = run(encoding, "chat", body, generated)
    text = "".join(json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
                   for f in frames if f.startswith("data: {"))
    assert stream.finished and text == "one two " and frames[-1] == "data: [DONE]\n\n"


def test_length_finish_maps_to_each_api(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("abc def")
    body = {"model": "tiny-v4", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}],
            "thinking": {"type": "disabled"}}
    _, stream = run(encoding, "messages", body, generated, finish_reason="length")
    response = json.loads(stream.response_json())
    assert response["stop_reason"] == "max_tokens" and response["id"] == "msg_1"


def test_streamed_event_names_follow_each_api(encoding, v4_tokenizer) -> None:
    body = {"model": "tiny-v4", "input": "x", "stream": True, "reasoning": {"effort": "none"}}
    frames, _ = run(encoding, "responses", body, v4_tokenizer.encode("ok") + [EOS])
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert all(f.startswith("event: ") for f in frames)


def test_logprobs_are_passed_through(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("Hi") + [EOS]
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"},
            "logprobs": True, "top_logprobs": 2}
    _, stream = run(encoding, "chat", body, generated, logprobs=True)
    content = json.loads(stream.response_json())["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == [-0.5] * (len(generated) - 1)
    assert len(content[0]["top_logprobs"]) == 2


# 🙂 is two ids of the V4 vocabulary, neither a whole character alone.
SMILE = [80300, 227]
SMILE_FIRST_HALF = SMILE[:1]


def chat_text(frames: list[str]) -> str:
    return "".join(json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
                   for f in frames if f.startswith("data: {") and json.loads(f[6:])["choices"])


def test_a_character_split_across_ids_arrives_whole(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("Hi ") + SMILE + v4_tokenizer.encode(" ok") + [EOS]
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"},
            "stream": True, "stream_options": {"include_usage": True}}
    frames, _ = run(encoding, "chat", body, generated)
    assert chat_text(frames) == "Hi 🙂 ok"
    assert json.loads(frames[-2][6:])["usage"]["completion_tokens"] == len(generated)


def test_an_answer_ending_mid_character_keeps_its_last_token(encoding, v4_tokenizer) -> None:
    generated = v4_tokenizer.encode("Tell me") + SMILE_FIRST_HALF
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"},
            "stream": True, "stream_options": {"include_usage": True}}
    frames, _ = run(encoding, "chat", body, generated, finish_reason="length")
    assert chat_text(frames) == "Tell me\ufffd"  # the partial character flushed, replaced
    final = json.loads(frames[-2][6:])
    assert final["usage"]["completion_tokens"] == len(generated)
    assert final["choices"][0]["finish_reason"] == "length"


def test_one_output_ending_mid_character_is_not_lost(encoding, v4_tokenizer) -> None:
    """LLM.chat pushes one finished output holding every id."""
    generated = v4_tokenizer.encode("</think>Once upon a time") + SMILE_FIRST_HALF
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    prepared = encoding.prepare("chat", body, 4096)
    stream = encoding.open_stream(prepared, "chatcmpl-1", [EOS])
    lps = [{t: Logprob(-0.5)} for t in generated]
    completion = CompletionOutput(0, "", generated, None, lps, "length")
    stream.push(RequestOutput("r", None, prepared.prompt_token_ids, [completion], True))
    stream.finish()
    response = json.loads(stream.response_json())
    assert response["choices"][0]["message"]["content"] == "Once upon a time\ufffd"
    assert response["usage"]["completion_tokens"] == len(generated)
    # Every answer token keeps its logprob, the flushed partial one too (issue 49 item 9: it had none).
    entries = response["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in entries[:4]] == ["Once", " upon", " a", " time"]
    assert len(entries) == 5 and entries[4]["logprob"] == -0.5
    assert bytes(entries[4]["bytes"]) == "\N{SLIGHTLY SMILING FACE}".encode()[:len(entries[4]["bytes"])]  # its first bytes


# Seven ids whose text encodes again as nine: recipe's own count (re-encoding the reasoning) said 9 of 7.
REENCODES_LONGER = [66150, 18254, 36941, 18316, 99064, 12429, 81050]


def usage_of(stream, frames: list[str]) -> dict:
    if frames and frames[0].startswith(("data: {", "event: ")):
        body = next(f for f in reversed(frames) if '"usage":{' in f)
        data = json.loads(body.split("data: ", 1)[1])
        return data.get("usage") or data["response"]["usage"]
    return json.loads(stream.response_json())["usage"]


@pytest.mark.parametrize(("api", "stream"), [("chat", False), ("chat", True), ("responses", False), ("responses", True)])
def test_reasoning_tokens_are_the_generated_ids_before_thinking_ends(encoding, api, stream) -> None:
    body = ({"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}]} if api == "chat"
            else {"model": "tiny-v4", "input": "x"})
    if stream:
        body |= {"stream": True} | ({"stream_options": {"include_usage": True}} if api == "chat" else {})
    frames, stream_ = run(encoding, api, body, REENCODES_LONGER, finish_reason="length")
    usage = usage_of(stream_, frames)
    details = usage.get("completion_tokens_details") or usage["output_tokens_details"]
    total = usage.get("completion_tokens", usage.get("output_tokens"))
    assert total == len(REENCODES_LONGER) and details["reasoning_tokens"] == len(REENCODES_LONGER)


def test_reasoning_tokens_stop_at_the_close_tag_and_skip_eos(encoding, v4_tokenizer) -> None:
    thought = v4_tokenizer.encode("Let me see, 🙂 ok")
    generated = thought + v4_tokenizer.encode("</think>The answer is 42.") + [EOS]
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}]}
    _, stream = run(encoding, "chat", body, generated)
    usage = json.loads(stream.response_json())["usage"]
    assert usage["completion_tokens"] == len(generated)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(thought)


def test_no_reasoning_tokens_without_thinking(encoding) -> None:
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"}}
    _, stream = run(encoding, "chat", body, REENCODES_LONGER, finish_reason="length")
    usage = json.loads(stream.response_json())["usage"]
    assert usage["completion_tokens"] == 7 and usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0) == 0


def _split_smile_entries(encoding, v4_tokenizer) -> list[dict]:
    """Recipe's own entries for 🙂's two ids, met in the middle of an answer (OpenAI's convention)."""
    generated = v4_tokenizer.encode("Hi ") + SMILE + v4_tokenizer.encode(" ok") + [EOS]
    body = {"model": "tiny-v4", "input": "x", "reasoning": {"effort": "none"}, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"]}
    _, stream = run(encoding, "responses", body, generated, logprobs=True)
    entries = json.loads(stream.response_json())["output"][0]["content"][0]["logprobs"]
    return entries[-3:-1]


@pytest.mark.parametrize("streamed", [False, True])
def test_responses_logprobs_keep_a_final_partial_character(encoding, v4_tokenizer, streamed) -> None:
    """Issue 49 item 9: the Responses API's answer ending mid-character has an entry per output token."""
    generated = v4_tokenizer.encode("Once upon") + SMILE_FIRST_HALF
    body = {"model": "tiny-v4", "input": "x", "reasoning": {"effort": "none"}, "top_logprobs": 1,
            "include": ["message.output_text.logprobs"], "stream": streamed}
    frames, stream = run(encoding, "responses", body, generated, finish_reason="length", logprobs=True)
    if streamed:
        events = [json.loads(f.split("data: ", 1)[1]) for f in frames if f.startswith("event: ")]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(e["delta"] for e in deltas) == "Once upon\ufffd"
        assert sum(len(e["logprobs"]) for e in deltas) == len(generated)  # the tail's delta carries its entry
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert len(done["logprobs"]) == len(generated)
        part = next(e for e in events if e["type"] == "response.content_part.done")["part"]
        assert len(part["logprobs"]) == len(generated)
        response = next(e for e in events if e["type"] == "response.incomplete")["response"]
    else:
        response = json.loads(stream.response_json())
    content = response["output"][0]["content"][0]
    assert content["text"] == "Once upon\ufffd"
    assert response["usage"]["output_tokens"] == len(generated) == len(content["logprobs"])
    tail = content["logprobs"][-1]
    # The partial id's entry is the one recipe gives the same id in the middle of an answer.
    assert tail == _split_smile_entries(encoding, v4_tokenizer)[0] | {"logprob": -0.5}
    assert tail["token"] == "\\xf0\\x9f\\x99" and bytes(tail["bytes"]) == "\N{SLIGHTLY SMILING FACE}".encode()[:3]


def test_chat_logprobs_of_a_final_partial_character_follow_recipe_convention(encoding, v4_tokenizer) -> None:
    """A flushed tail's Chat Completions entry is shaped as recipe shapes the same id mid-answer."""
    generated = v4_tokenizer.encode("Tell me") + SMILE_FIRST_HALF
    body = {"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "disabled"},
            "logprobs": True, "top_logprobs": 1}
    _, stream = run(encoding, "chat", body, generated, finish_reason="length", logprobs=True)
    entries = json.loads(stream.response_json())["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(generated)
    assert entries[-1] == _split_smile_entries(encoding, v4_tokenizer)[0] | {"logprob": -0.5}
