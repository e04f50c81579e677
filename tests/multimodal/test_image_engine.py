"""An image prompt through the engine on a tiny V4.1 checkpoint with a vision tower: greedy tokens and
logprobs equal a whole-forward recomputation, under chunked prefill cutting through the image, preemption
and a prefix hit; the cache keys cover the image; the encoder runs once per image."""

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("PIL.Image")

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.entrypoints.chat import chat_encoding_of, chat_request_body
from deepinfer_core.multimodal import ImageError
from deepinfer_core.testing.serving import serve
from tests.multimodal.vision_helpers import (
    IMAGE_ID,
    make_engine,
    picture,
    text_ids,
    vision_checkpoint,
    whole_forward_logprobs,
)

GREEDY = {"temperature": 0, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return vision_checkpoint(tmp_path_factory)


def chosen(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    return completion.token_ids, [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


def serve_images(engine, prompts, max_tokens=4):
    """`prompts`: (ids with placeholders, images); served together, greedy."""
    laid = [engine.prepare_images(ids, images) for ids, images in prompts]
    params = [SamplingParams(max_tokens=max_tokens, **GREEDY) for _ in prompts]
    outputs = serve_laid(engine, laid, params)
    return outputs, laid


def serve_laid(engine, laid, params):
    for i, ((ids, images), p) in enumerate(zip(laid, params)):
        engine.add_request(f"r{i}", ids, p, images=images)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[f"r{i}"] for i in range(len(laid))]


def assert_follows_the_forward(checkpoint, output, ids, images):
    tokens, logprobs = chosen(output)
    forward = whole_forward_logprobs(checkpoint, ids + tokens[:-1], images)[len(ids) - 1 :]
    assert forward.argmax(-1).tolist() == tokens
    expected = forward.gather(1, forward.new_tensor(tokens, dtype=int)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4


PROMPT = [0, *text_ids(6, seed=1), IMAGE_ID, *text_ids(5, seed=2)]


def test_llm_generate_with_multi_modal_data_follows_the_whole_forward(checkpoint):
    directory, _ = checkpoint
    llm = LLM(model=str(directory), dtype="float32", max_num_seqs=2, num_kv_blocks=8)
    image = picture(150, 100, seed=3)
    output = llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image}},
                          SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0]
    ids, images = llm.engine.prepare_images(PROMPT, [image])
    assert len(ids) == len(PROMPT) - 1 + images[0].length and images[0].offset == 7
    assert output.prompt_token_ids == ids
    assert_follows_the_forward(checkpoint, output, ids, images)
    stats = llm.engine.stats()
    assert stats["encoder_images_encoded"] == 1 and stats["encoder_seconds"] > 0
    # LLM.chat: an OpenAI image_url part (a data: URL) through the recipe's V4.1 encoding
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    answer = llm.chat(messages, SamplingParams(max_tokens=2, **GREEDY), thinking=False)[0]
    prepared = chat_encoding_of(llm).prepare("chat", chat_request_body(chat_encoding_of(llm), messages, None, False),
                                             1 << 20)
    ids, images = llm.engine.prepare_images(prepared.prompt_token_ids, list(prepared.images))
    assert answer.prompt_token_ids == ids and answer.usage["prompt_tokens"] == len(ids)
    assert_follows_the_forward(checkpoint, answer, ids, images)
    assert llm.engine.stats()["encoder_images_encoded"] == 1  # the same pixels: the encoder cache had them
    # a text prompt spells the placeholder; a list of images, one per placeholder
    texts = llm.generate({"prompt": "A <｜deepseek_image｜> and a <｜deepseek_image｜>.",
                          "multi_modal_data": {"image": [image, picture(60, 90, seed=4)]}},
                         SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)[0]
    spans = llm.engine.prepare_images([IMAGE_ID, IMAGE_ID], [image, picture(60, 90, seed=4)])[1]
    assert texts.prompt_token_ids.count(IMAGE_ID) == sum(span.length for span in spans)


def test_chunked_prefill_through_the_image_and_preemption_follow_the_forward(checkpoint):
    # the first step's 110-token chunk stops inside the first prompt's span [101, 118); three requests
    # decoding across the 128-token block edge in a 4-block pool: some are preempted and recomputed
    prompts = [([0, *text_ids(100 + i, seed=i), IMAGE_ID, *text_ids(5, seed=10 + i)], [picture(150, 100, seed=i)])
               for i in range(3)]
    engine = make_engine(checkpoint, max_num_seqs=3, max_num_batched_tokens=110, num_kv_blocks=4)
    outputs, laid = serve_images(engine, prompts, max_tokens=10)
    assert [images[0].offset for _, images in laid] == [101, 102, 103] and laid[0][1][0].length == 17
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, "the pool was meant to force preemption"
    # each image encoded once: the second chunk of a cut span and every recompute read the encoder cache
    assert stats["encoder_images_encoded"] == 3 and stats["encoder_cache_hits"] >= 1
    for output, (ids, images) in zip(outputs, laid):
        assert_follows_the_forward(checkpoint, output, ids, images)


LONG = [0, *text_ids(30, seed=5), IMAGE_ID, *text_ids(120, seed=6)]
"""The image sits in the first 128-token block; the prompt has one full block to hit."""


def test_the_same_image_hits_the_prefix_cache_and_another_misses(checkpoint):
    # 56-token chunks: the exact replay of a hit starts at 128 - 9 layers x 8 = 56, a chunk edge of the cold run
    engine = make_engine(checkpoint, max_num_seqs=1, max_num_batched_tokens=56, num_kv_blocks=6,
                         enable_prefix_caching=True, swa_replay="exact")
    first, laid = serve_images(engine, [(LONG, [picture(150, 100, seed=7)])], max_tokens=2)
    assert first[0].num_cached_tokens == 0
    assert_follows_the_forward(checkpoint, first[0], *laid[0])
    same, _ = serve_images(engine, [(LONG, [picture(150, 100, seed=7)])], max_tokens=2)
    assert same[0].num_cached_tokens == 128
    assert chosen(same[0]) == chosen(first[0])  # bit-identical answer (exact replay)
    other, laid = serve_images(engine, [(LONG, [picture(150, 100, seed=8)])], max_tokens=2)  # same ids, another image
    assert other[0].num_cached_tokens == 0
    assert_follows_the_forward(checkpoint, other[0], *laid[0])
    # seed 7 once: the hit's replay starts at 56, past its span [31, 48), so the re-send needs no rows
    assert engine.stats()["encoder_images_encoded"] == 2


def test_placeholder_count_and_text_only_prompts(checkpoint):
    engine = make_engine(checkpoint)
    with pytest.raises(ImageError, match="1 image placeholders .* but 2 images"):
        engine.prepare_images(PROMPT, [picture(20, 20, 0), picture(20, 20, 1)])
    out = serve(engine, [text_ids(12, seed=9)], [SamplingParams(max_tokens=2, **GREEDY)])[0]
    assert len(out.outputs[0].token_ids) == 2 and engine.stats()["encoder_images_encoded"] == 0
