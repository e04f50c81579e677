"""LLM.chat on the real engine with the embedded tiny model."""

from __future__ import annotations

import deepseek_recipe as dr
import pytest

from deepinfer_core.entrypoints.chat import ChatOutput, ChatRequestError
from deepinfer_core.llm import LLM
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(embedded_tiny_model_dir()), max_model_len=1024, device="cpu")


@pytest.fixture(scope="module")
def recipe_encoding() -> dr.DeepseekV4Encoding:
    tokenizer = dr.Tokenizer.from_file(str(embedded_tiny_model_dir() / "tokenizer.json"))
    return dr.DeepseekV4Encoding().with_tokenizer(tokenizer)


def test_one_conversation_without_thinking(llm: LLM, recipe_encoding) -> None:
    text = "Hello <｜Assistant｜> there"
    [answer] = llm.chat([{"role": "user", "content": text}], SamplingParams(max_tokens=5, temperature=0),
                        thinking=False)
    assert isinstance(answer, ChatOutput)
    expected = recipe_encoding.encode(dr.Conversation([dr.UserMessage(text)], thinking_mode=False))
    assert answer.output.prompt_token_ids == expected  # recipe's own ids: the typed marker is plain text
    assert answer.reasoning_content is None and isinstance(answer.content, str)
    assert answer.usage["completion_tokens"] == len(answer.output.outputs[0].token_ids) <= 5
    assert answer.usage["prompt_tokens"] == len(expected)
    assert answer.message["role"] == "assistant"


def test_thinking_mode_reports_reasoning(llm: LLM) -> None:
    [answer] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert isinstance(answer.reasoning_content, str)
    assert answer.output.prompt_token_ids[-1] == 128821  # the prompt opens <think>


def test_several_conversations_come_back_in_order(llm: LLM) -> None:
    conversations = [[{"role": "user", "content": "first"}], [{"role": "user", "content": "second, longer one"}]]
    answers = llm.chat(conversations, SamplingParams(max_tokens=3), thinking=False)
    assert len(answers) == 2
    assert len(answers[0].output.prompt_token_ids) < len(answers[1].output.prompt_token_ids)


def test_tools_and_tool_history(llm: LLM) -> None:
    history = [
        {"role": "user", "content": "define cat"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{\"word\": \"cat\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "a small feline"},
    ]
    with_tools = llm.chat(history, SamplingParams(max_tokens=2), tools=[TOOL], thinking=False)[0]
    plain = llm.chat([{"role": "user", "content": "define cat"}], SamplingParams(max_tokens=2), thinking=False)[0]
    assert len(with_tools.output.prompt_token_ids) > len(plain.output.prompt_token_ids) + 50  # tool schema
    assert isinstance(with_tools.tool_calls, list)


def test_default_sampling_fills_the_context(llm: LLM) -> None:
    from deepinfer_core.entrypoints.chat import chat_encoding_of, prepare_conversations, sampling_params_for

    [prepared] = prepare_conversations(chat_encoding_of(llm), [[{"role": "user", "content": "x"}]], None, False, 1024)
    assert sampling_params_for(prepared, None).max_tokens == 1024 - len(prepared.prompt_token_ids)
    assert sampling_params_for(prepared, SamplingParams(max_tokens=5000)).max_tokens == prepared.max_tokens


def test_invalid_conversation_names_its_index(llm: LLM) -> None:
    good = [{"role": "user", "content": "ok"}]
    bad = [{"role": "wizard", "content": "??"}]
    with pytest.raises(ChatRequestError, match="conversation 1"):
        llm.chat([good, bad])
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


def test_an_answer_ending_mid_character_is_kept_and_counted(llm: LLM) -> None:
    """Issue 14 item 1: the last id (25249) ends mid-character; the answer was lost, with 0 tokens."""
    [answer] = llm.chat([{"role": "user", "content": "Tell me a story."}], SamplingParams(max_tokens=32, seed=6))
    ids = answer.output.outputs[0].token_ids
    assert llm.get_tokenizer().decode(ids).endswith("\ufffd")  # the case: ends in a partial character
    assert answer.reasoning_content and answer.reasoning_content.endswith("\ufffd")  # flushed, replaced
    assert answer.usage["completion_tokens"] == len(ids) == 32


def test_reasoning_tokens_never_exceed_completion_tokens(llm: LLM) -> None:
    """Issue 14 item 2: re-encoding this reasoning text gives 11 tokens of the 8 generated."""
    [answer] = llm.chat([{"role": "user", "content": "Tell me a story."}], SamplingParams(max_tokens=8, seed=4))
    ids = answer.output.outputs[0].token_ids
    assert len(llm.get_tokenizer().encode(answer.reasoning_content)) > len(ids)  # the case that overcounted
    usage = answer.usage
    assert usage["completion_tokens"] == len(ids) == 8
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 8  # all thinking: no </think> yet


def test_chat_returns_vllms_request_output(llm: LLM) -> None:
    """Issue 49 item 8: vLLM's `LLM.chat` returns `RequestOutput`s; `outputs[0].text` is the raw text."""
    from deepinfer_core.outputs import RequestOutput

    [answer] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0),
                        use_tqdm=False, tools=[TOOL], chat_template_kwargs={"thinking": False})
    assert isinstance(answer, RequestOutput) and answer.finished
    assert answer.outputs[0].text == llm.get_tokenizer().decode(answer.outputs[0].token_ids)
    assert answer.output is answer and answer.reasoning_content is None  # chat_template_kwargs turned thinking off


def test_continue_final_message_continues_the_assistants_text(llm: LLM, recipe_encoding) -> None:
    """Issue 49 item 8: vLLM's `continue_final_message` is DeepSeek's prefix completion."""
    conversation = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    [answer] = llm.chat(conversation, SamplingParams(max_tokens=3, temperature=0), add_generation_prompt=False,
                        continue_final_message=True, thinking=False)
    ids = answer.prompt_token_ids
    assert llm.get_tokenizer().decode(ids).endswith("</think>Once upon")  # open: no end of sentence, no new turn
    [closed] = prepare_conversations_of(llm, conversation)
    assert closed.prompt_token_ids[:len(ids)] == ids and len(closed.prompt_token_ids) > len(ids)
    assert answer.content == answer.outputs[0].text  # only the continuation, as vLLM and DeepSeek's API return it


def prepare_conversations_of(llm: LLM, conversation: list[dict]) -> list:
    from deepinfer_core.entrypoints.chat import chat_encoding_of, prepare_conversations

    return prepare_conversations(chat_encoding_of(llm), [conversation], None, False, 1024)


def test_vllm_chat_options_we_do_not_implement_say_so(llm: LLM) -> None:
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(NotImplementedError, match="chat_template"):
        llm.chat(user, chat_template="{{ messages }}")
    with pytest.raises(NotImplementedError, match="add_generation_prompt=False"):
        llm.chat(user, add_generation_prompt=False)
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(user, continue_final_message=True)
    with pytest.raises(ChatRequestError, match="assistant message last"):
        llm.chat(user, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(NotImplementedError, match="chat_template_kwargs"):
        llm.chat(user, chat_template_kwargs={"tools_in_system": True})
    assert not llm.engine.has_unfinished_requests()
