"""Image input with DeepInfer's `LLM` API (DeepSeek-V4.1, whose checkpoint carries a vision tower).

    python examples/image_input.py [--image picture.png] [--max-tokens 16]

Runs the checkpoint in `DEEPINFER_HF_MODEL_DIR` when it is set; otherwise a tiny random DeepSeek-V4.1
model with a small vision tower (built once under the user cache directory), so the whole image path -
decoding, DeepSeek's image processor, the span laid into the prompt, the vision encoder and its cache,
the language model - runs on a CPU. Its text is gibberish: the weights are random. Without `--image` the
picture is a generated gradient. Needs Pillow: pip install 'deepinfer[vision]'.
"""

from __future__ import annotations

import argparse
import base64
import io
import os

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.llm import MODEL_DIR_ENV


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=None, help="an image file (default: a generated gradient)")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per answer (default 16)")
    return parser.parse_args()


def load_picture(path: str | None):
    from PIL import Image

    if path is not None:
        with Image.open(path) as image:
            return image.convert("RGB")
    image = Image.new("RGB", (160, 120))
    image.putdata([(x * 255 // 159, y * 255 // 119, 128) for y in range(120) for x in range(160)])
    return image


def main() -> None:
    args = parse_args()
    directory = os.environ.get(MODEL_DIR_ENV)
    if not directory:
        from deepinfer_core.models.v41_tiny import embedded_tiny_v41_model_dir

        print(f"{MODEL_DIR_ENV} is not set: using a tiny random DeepSeek-V4.1 model with a vision tower")
        directory = str(embedded_tiny_v41_model_dir(vision=True))
    llm = LLM(model=directory, dtype="float32" if not os.environ.get(MODEL_DIR_ENV) else "auto", max_num_seqs=2,
              enable_prefix_caching=True)
    picture = load_picture(args.image)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    # vLLM's shape: one image_token_id in the prompt where the image goes; the engine lays its span there
    image_token_id = llm.engine.model_config.image_token_id
    prompt_ids = [*llm.tokenize("Describe this picture:"), image_token_id, *llm.tokenize(" in one line.")[1:]]
    output = llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": picture}}, params,
                          use_tqdm=False)[0]
    print(f"generate: {len(output.prompt_token_ids)} prompt positions -> {output.outputs[0].text!r}")

    # the chat format: an OpenAI image_url part with a data: URL (the same image: its encoding is cached)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    answer = llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                    {"type": "image_url", "image_url": {"url": url}}]}],
                      params, thinking=False)[0]
    print(f"chat: {answer.usage['prompt_tokens']} prompt tokens -> {answer.content!r}")
    stats = llm.engine.stats()
    print(f"vision encoder: {stats['encoder_images_encoded']} image(s) encoded in {stats['encoder_seconds']:.3f} s, "
          f"{stats['encoder_cache_hits']} encoder-cache hit(s)")


if __name__ == "__main__":
    main()
