"""Serving requests to the end: the loop that engine tests share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepinfer_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.outputs import RequestOutput


def record_attention_rows(engine: Engine) -> list[list[int]]:
    """From now on, per decoder layer of `engine`'s model, the position of every row its attention
    computes (tests of which rows a layer runs: exact replay's trimming)."""
    layers = engine.runner.model.model.layers
    rows = [[] for _ in layers]
    for layer, seen in zip(layers, rows):
        def forward(x, ctx, *args, seen=seen, inner=layer.self_attn.forward):
            seen += ctx.metadata.positions.tolist()
            return inner(x, ctx, *args)
        layer.self_attn.forward = forward
    return rows


def serve(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
          request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
    """Serve `prompts` together to the end; their final outputs, in prompt order.

    Every prompt is queued before the first step, as request `request_ids[i]` (by default `str(i)`) with
    `params` (one for all, or one per prompt); then the engine steps until it holds no unfinished request.

    :param engine: an `Engine`, or anything with its `add_request`, `step` and `has_unfinished_requests`
        (a `DataParallelEngine`).
    :returns: each request's finished `RequestOutput`, in the order of `prompts`.
    """
    ids = [str(i) for i in range(len(prompts))] if request_ids is None else list(request_ids)
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for request_id, prompt, request_params in zip(ids, prompts, per_prompt, strict=True):
        engine.add_request(request_id, prompt, request_params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return [finished[request_id] for request_id in ids]
