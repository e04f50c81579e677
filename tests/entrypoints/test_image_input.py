"""Images through the HTTP server (tiny V4.1 with a vision tower): OpenAI `image_url` parts, Anthropic
`image` blocks and Responses `input_image` items are laid into the prompt; URLs to fetch, limits and
hostile image bytes are clear 400s, and the server stays healthy after each."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("deepinfer_recipe", reason="the HTTP server needs the recipe plugin")
pytest.importorskip("PIL.Image")

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.multimodal.images import HOSTILE, png_bytes
from tests.multimodal.vision_helpers import make_engine, vision_checkpoint

MODEL = "DeepSeek-V4.1-Flash"
MAX_IMAGE_BYTES = 60_000


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def chat_body(*parts: dict, max_tokens: int = 2) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = make_engine(vision_checkpoint(tmp_path_factory), max_num_seqs=2, num_kv_blocks=8,
                         max_image_bytes=MAX_IMAGE_BYTES, max_images_per_prompt=2)
    with running_server(build_app(engine)) as base_url:
        yield base_url, engine


def laid_prompt_length(engine, api: str, body: dict) -> int:
    """The prompt length the engine should see: the encoding's ids with each image laid into its span."""
    from deepinfer_core.entrypoints.chat import load_chat_encoding

    prepared = load_chat_encoding(engine.tokenizer, engine.model_config).prepare(api, body, 1 << 20)
    assert len(prepared.images) == sum(t == engine.model_config.image_token_id for t in prepared.prompt_token_ids)
    ids, images = engine.prepare_images(prepared.prompt_token_ids, list(prepared.images))
    assert images and len(ids) == len(prepared.prompt_token_ids) + sum(i.length - 1 for i in images)
    return len(ids)


def test_openai_image_url_parts_are_laid_into_the_prompt(server):
    base_url, engine = server
    body = chat_body(image_part(data_url(png_bytes(150, 100, seed=1))))
    status, answer = post(f"{base_url}/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == laid_prompt_length(engine, "chat", body)
    assert answer["usage"]["completion_tokens"] == 2
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=60) as response:
        metrics = response.read().decode()
    encoded = next(line for line in metrics.splitlines() if line.startswith("deepinfer_encoder_images_encoded_total "))
    assert float(encoded.split()[1]) >= 1 and "deepinfer_encoder_seconds_total " in metrics


def test_anthropic_image_blocks_and_responses_input_images(server):
    base_url, engine = server
    data = base64.b64encode(png_bytes(90, 120, seed=2)).decode()
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "Describe it."}]}]}
    status, answer = post(f"{base_url}/v1/messages", messages)
    assert status == 200, answer
    assert answer["usage"]["input_tokens"] == laid_prompt_length(engine, "messages", messages)
    responses = {"model": MODEL, "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_url(png_bytes(60, 60))}]}]}
    status, answer = post(f"{base_url}/v1/responses", responses)
    assert status == 200, answer
    assert answer["usage"]["input_tokens"] == laid_prompt_length(engine, "responses", responses)


@pytest.mark.parametrize("case", [
    "https", "truncated", "bomb", "animated", "16-bit", "not an image", "too many bytes", "too many images",
    "bad base64",
])
def test_each_refused_image_is_a_clear_400_and_the_server_stays_healthy(server, case):
    base_url, _ = server
    if case == "https":
        parts, words = [image_part("https://example.com/cat.png")], "not fetched"
    elif case == "too many bytes":
        parts, words = [image_part(data_url(b"\x89PNG" + b"\x00" * MAX_IMAGE_BYTES))], "max_image_bytes"
    elif case == "too many images":
        parts, words = [image_part(data_url(png_bytes(20, 20, seed=i))) for i in range(3)], "max_images_per_prompt"
    elif case == "bad base64":
        parts, words = [image_part("data:image/png;base64,@@not base64@@")], "base64"
    else:
        make, words = HOSTILE[case]
        parts = [image_part(data_url(make()))]
    status, answer = post(f"{base_url}/v1/chat/completions", chat_body(*parts))
    assert status == 400, answer
    message = answer["error"]["message"]
    assert words in message and "Traceback" not in message
    status, answer = post(f"{base_url}/v1/chat/completions", chat_body(max_tokens=1))  # still serving
    assert status == 200 and answer["usage"]["completion_tokens"] == 1


def test_a_text_only_model_refuses_images():
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models.tiny import tiny_config
    from deepinfer_core.multimodal import ImageError, lay_images

    with pytest.raises(ImageError, match="takes text only"):
        lay_images([0, 5], [png_bytes(8, 8)], ModelConfig.from_dict(tiny_config()))
