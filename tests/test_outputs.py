"""Output types: vLLM's attribute names, derived metrics and readable reprs."""

from deepinfer_core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def completion(**overrides):
    fields = {"index": 0, "text": "hi", "token_ids": [5, 6], "cumulative_logprob": -1.5, "logprobs": None}
    return CompletionOutput(**{**fields, **overrides})


def test_completion_is_finished_once_a_reason_is_set():
    assert not completion().finished()
    assert completion(finish_reason="length").finished()


def test_metrics_derive_queue_time_and_time_to_first_token():
    metrics = RequestMetrics(arrival_time=10.0)
    assert metrics.time_in_queue is None and metrics.time_to_first_token is None
    metrics.first_scheduled_time, metrics.first_token_time = 10.5, 11.25
    assert metrics.time_in_queue == 0.5 and metrics.time_to_first_token == 1.25


def test_request_output_repr_is_short_for_long_prompts_and_logprobs():
    steps = [{5: Logprob(-0.5, 1, "a")}, {6: Logprob(-1.0, 1, "b")}]
    output = RequestOutput(
        request_id="r0",
        prompt=None,
        prompt_token_ids=list(range(1000)),
        outputs=[completion(logprobs=steps, finish_reason="stop", stop_reason=6)],
        finished=True,
    )
    text = repr(output)
    assert "(1000 tokens)" in text and "999" not in text
    assert "logprobs=<2 steps>" in text and "finish_reason=stop" in text and "stop_reason=6" in text
    assert output.outputs[0].logprobs[1][6].decoded_token == "b"
    assert output.num_cached_tokens == 0 and output.prompt_logprobs is None
