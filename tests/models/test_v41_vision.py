"""V4.1's vision tower and image span on the model: the ViT + aligner against a second implementation written
here from DeepSeek's reference (fp32), the span layout on hand-checked sizes, and an image prompt's logits
against a whole forward recomputed here (the span's embeddings overlaid, `bias_vl` routing, Engram gate 0
and n-gram breaks at every span position)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.engram import engram_forward
from deepinfer_core.models.deepseek_v41.vision import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEWLINE,
    IMAGE_START,
    VisionConfig,
    image_span,
)
from deepinfer_core.models.deepseek_v41.vision_tower import Aligner, VisionTower, encode_span
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.reference.layer_ops import collapse, hyper_mix, hyper_residual, weighted_rms_norm
from tests.models.v41_helpers import make_runner, random_prompt
from tests.oracle import FakeSeq, step_plan

SIZES = [(126, 126), (42, 168), (196, 70), (14, 14), (56, 98), (70, 28)]
"""Processed sizes (multiples of 14): square, wide, tall with both grid sides padded to 3, one patch, ..."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_v41_config(vision=True)
    directory = write_v41_checkpoint(tmp_path_factory.mktemp("v41-vision"), config, seed=11)
    return directory, load_v41_checkpoint(directory, V41Config.from_dict(config), torch.float32, "cpu")


@pytest.fixture(scope="module")
def model(checkpoint):
    return make_runner(*checkpoint).model


# ---------------------------------------------------------------------- the second implementation


def rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_span(w: dict, vc: VisionConfig, pixels: torch.Tensor) -> torch.Tensor:
    """The span's embeddings as DeepSeek's `vision.py` / `model.py` compute them, written out in fp32."""
    w = {k: v.float() for k, v in w.items()}
    p, r, heads = vc.patch_size, vc.downsample_ratio, vc.num_heads
    nh, nw = pixels.shape[1] // p, pixels.shape[2] // p
    patches = pixels.unfold(1, p, p).unfold(2, p, p).permute(1, 2, 0, 3, 4).reshape(nh * nw, 3 * p * p)
    x = patches @ w["vision.patch_embed.proj.weight"].T + w["vision.patch_embed.proj.bias"]
    hd = vc.dim // heads
    quarter = hd // 4
    freqs = [vc.rope_theta ** (-2 * i / (hd // 2)) for i in range(quarter)]
    angles = torch.tensor([[a * f for f in freqs] + [b * f for f in freqs] for a in range(nh) for b in range(nw)])
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rotate(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    for k in range(vc.num_layers):
        b = f"vision.blocks.{k}."
        qkv = rms(x, w[b + "norm1.weight"]) @ w[b + "attn.wqkv.weight"].T + w[b + "attn.wqkv.bias"]
        q, key, v = (t.reshape(-1, heads, hd) for t in qkv.split(vc.dim, dim=-1))
        q, key = rotate(q), rotate(key)
        scores = torch.einsum("qhd,khd->hqk", q, key) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(-1, vc.dim)
        x = x + o @ w[b + "attn.wo.weight"].T + w[b + "attn.wo.bias"]
        gate, up = (rms(x, w[b + "norm2.weight"]) @ w[b + "mlp.w1.weight"].T).chunk(2, dim=-1)
        x = x + (gate * torch.sigmoid(gate) * up) @ w[b + "mlp.w2.weight"].T
    x = rms(x, w["vision.norm.weight"])
    grid = F.pad(x.T.reshape(vc.dim, nh, nw), (0, -nw % r, 0, -nh % r))
    unfolded = F.unfold(grid[None], r, stride=r)[0].T
    hidden = unfolded @ w["aligner.w1.weight"].T + w["aligner.w1.bias"]
    hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
    rows = iter(hidden @ w["aligner.w2.weight"].T + w["aligner.w2.bias"])
    delimiters = {IMAGE_START: w["image_start"], IMAGE_NEWLINE: w["image_newline"], IMAGE_END: w["image_end"]}
    kinds = [IMAGE_START] + ([IMAGE] * math.ceil(nw / r) + [IMAGE_NEWLINE]) * math.ceil(nh / r) + [IMAGE_END]
    out = torch.stack([next(rows) if kind == IMAGE else delimiters[kind] for kind in kinds])
    assert next(rows, None) is None
    return out


@pytest.mark.parametrize("size", SIZES)
def test_the_tower_and_aligner_equal_the_reference(checkpoint, model, size):
    _, weights = checkpoint
    pixels = torch.rand(3, *size, generator=torch.Generator().manual_seed(size[0] * 1000 + size[1])) * 2 - 1
    got = model.encode_image(pixels)
    expected = reference_span(weights, model.vision_config, pixels)
    assert got.shape == (image_span(model.config, *size).length, model.config.hidden_size)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() < 1e-5


def test_the_tower_runs_in_the_parameters_dtype(checkpoint, model):
    vc = model.vision_config
    tower, aligner = VisionTower(vc, torch.bfloat16), Aligner(vc, torch.bfloat16)
    tower.load_state_dict(model.vision.state_dict())
    aligner.load_state_dict(model.aligner.state_dict())
    delimiters = tuple(t.to(torch.bfloat16) for t in (model.image_start, model.image_newline, model.image_end))
    pixels = torch.rand(3, 42, 56, generator=torch.Generator().manual_seed(3)) * 2 - 1
    got = encode_span(tower, aligner, delimiters, pixels)
    assert got.dtype == torch.bfloat16
    assert (got.float() - model.encode_image(pixels)).abs().max().item() < 0.1  # bf16 rounding only


def test_bad_pixel_shapes_are_clear_errors(model):
    with pytest.raises(ValueError, match="must be \\[3, H, W\\]"):
        model.encode_image(torch.zeros(4, 14, 14))
    with pytest.raises(ValueError, match="processed width must be a positive multiple of the patch size 14"):
        model.encode_image(torch.zeros(3, 14, 20))


# ---------------------------------------------------------------------- the span layout


def test_the_span_layout_of_hand_checked_sizes():
    release = V41Config.from_dict({**tiny_v41_config(), "vision_config": {"model_type": "deepseek_v41_vision"}})
    one = image_span(release, 14, 14)  # one patch: a 1x1 grid after the (padded) 3x3 unfold
    assert (one.n_vit_h, one.n_vit_w, one.n_llm_h, one.n_llm_w) == (1, 1, 1, 1)
    assert one.kinds == [IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END] and one.length == 4
    wide = image_span(release, 42, 84)  # 3x6 patches -> 1x2
    assert wide.kinds == [IMAGE_START, IMAGE, IMAGE, IMAGE_NEWLINE, IMAGE_END]
    tall = image_span(release, 98, 28)  # 7x2 patches -> 3x1
    assert tall.kinds == [IMAGE_START] + [IMAGE, IMAGE_NEWLINE] * 3 + [IMAGE_END]
    assert image_span(release, 448, 448).length == 11 * 12 + 2  # 32x32 patches -> 11x11
    big = image_span(release, 1036, 1036)  # a 1024x1024 image, padded up to 74 patches a side -> 25x25
    assert big.length == 652 and big.num_patches == 74 * 74
    assert big.token_ids == [129264] * 652


def test_span_sizes_that_are_not_patch_multiples_or_a_model_without_a_tower_are_refused():
    config = V41Config.from_dict(tiny_v41_config(vision=True))
    with pytest.raises(ValueError, match="processed height must be a positive multiple of the patch size 14"):
        image_span(config, 15, 14)
    with pytest.raises(ValueError, match="width must be a positive multiple"):
        image_span(config, 14, 0)
    text_only = V41Config.from_dict({k: v for k, v in tiny_v41_config().items() if k != "vision_config"})
    assert VisionConfig.of(text_only) is None
    with pytest.raises(ValueError, match="has no vision tower"):
        image_span(text_only, 14, 14)


# ---------------------------------------------------------------------- the image prompt on the model


def image_prompt(model, size=(42, 70)):
    """Text, an image span, text: the ids, the span's mask, the span's embeddings."""
    span = image_span(model.config, *size)
    before, after = random_prompt(5, seed=1), random_prompt(6, seed=2)
    ids = before + span.token_ids + after
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(before) : len(before) + span.length] = True
    pixels = torch.rand(3, *size, generator=torch.Generator().manual_seed(9)) * 2 - 1
    return ids, mask, model.encode_image(pixels)


def step(runner, ids, chunks):
    """The context of each step feeding `ids` in `chunks` (token counts) to one request."""
    seq = FakeSeq(ids, slot=0, block_table=[0, 1, 2])
    for n in chunks:
        plan = step_plan(runner, [seq], [n])
        yield seq.num_computed_tokens, n, runner.prepare_inputs(plan, runner.update_states(plan))[0]
        seq.num_computed_tokens += n


def engine_logits(checkpoint, ids, mask, embeds, chunks) -> torch.Tensor:
    runner, out = make_runner(*checkpoint), []
    for start, n, ctx in step(runner, ids, chunks):
        rows = mask[start : start + n]
        before = int(mask[:start].sum())
        out.append(runner.model(ctx, runner.kv_cache.layers, torch.arange(n), image_mask=rows,
                                image_embeds=embeds[before : before + int(rows.sum())]))
    return torch.cat(out)


def engram_lookback(model, ids: list[int], mask: torch.Tensor) -> torch.Tensor:
    """Per position, the compressed ids of it and the tokens before it: -1 at an image position, -2
    before the start (the hasher turns both, and every step behind them, into the pad's id)."""
    compressed = [-1 if dead else int(model.hasher.token_map[t]) for t, dead in zip(ids, mask.tolist())]
    return torch.tensor([[compressed[p - k] if p - k >= 0 else -2 for k in range(model.hasher.max_ngram)]
                         for p in range(len(ids))])


def recomputed_logits(model, ctx, caches, ids, mask, embeds, engram_gate_at_images=False) -> torch.Tensor:
    """The whole forward written out: embeddings with the span overlaid, single-pass mHC, Engram with its
    gate shut at image positions, the router's bias_vl at image positions (row by row), the fp32 head."""
    eps, spec = model.config.rms_norm_eps, model.mix_spec
    x = model.embed(ctx.input_ids).clone()
    x[mask] = embeds
    streams = x.unsqueeze(1).repeat(1, model.hc_mult, 1)
    pre = torch.zeros(len(ids), model.hc_mult)
    pre[:, 0] = 1
    hashes = model.hasher.hashes(engram_lookback(model, ids, mask))
    shared, image_rows = {}, mask.nonzero().flatten().tolist()
    for i, block in enumerate(model.layers):
        if model.plans[i].has_engram:
            engram = block.engram
            rows = model.tables[i].lookup(hashes[:, model.engram_columns[i]])
            new = engram_forward(streams, rows, engram.wkv.weight, engram.q_weight * engram.k_weight, eps)
            if not engram_gate_at_images:
                new[mask] = streams[mask]  # gate 0: an image position's streams pass unchanged
            streams = new
        pre_a, post, comb = hyper_mix(streams, model.hc[i][0], spec)
        h = weighted_rms_norm(collapse(streams, pre), block.attn_norm.weight, eps)
        streams = hyper_residual(streams, model.attention(i, h, ctx, caches[i], shared), post, comb)
        pre, post, comb = hyper_mix(streams, model.hc[i][1], spec)
        h = weighted_rms_norm(collapse(streams, pre_a), block.ffn_norm.weight, eps)
        routed = torch.cat([model.moe_backends[i].forward(h[r : r + 1], ctx.input_ids[r : r + 1], dataclasses.replace(
            model.moe_weights[i], score_bias=block.ffn.gate.bias_vl if r in image_rows else block.ffn.gate.bias))
            for r in range(len(ids))])
        out = routed + block.ffn.shared_experts(h, float(model.config.swiglu_limit))
        streams = hyper_residual(streams, out, post, comb)
    hidden = weighted_rms_norm(collapse(streams, pre), model.norm.weight, eps)
    return F.linear(hidden.float(), model.head.weight.float())


def test_an_image_prompt_equals_the_whole_forward_recomputed(checkpoint, model):
    ids, mask, embeds = image_prompt(model)
    got = engine_logits(checkpoint, ids, mask, embeds, [len(ids)])
    runner = make_runner(*checkpoint)
    ((_, _, ctx),) = step(runner, ids, [len(ids)])
    with torch.inference_mode():
        expected = recomputed_logits(runner.model, ctx, runner.kv_cache.layers, ids, mask, embeds)
    assert (got - expected).abs().max().item() < 1e-4
    # each ingredient shows: the placeholder's embeddings, or Engram's gate open, give other logits
    text = engine_logits(checkpoint, ids, torch.zeros_like(mask), embeds[:0], [len(ids)])
    assert (got - text).abs().max().item() > 1e-2
    runner = make_runner(*checkpoint)
    ((_, _, ctx),) = step(runner, ids, [len(ids)])
    with torch.inference_mode():
        gated = recomputed_logits(runner.model, ctx, runner.kv_cache.layers, ids, mask, embeds, True)
    assert (gated - expected).abs().max().item() > 1e-3


def test_chunks_cutting_through_the_image_equal_one_shot(checkpoint, model):
    ids, mask, embeds = image_prompt(model)
    whole = engine_logits(checkpoint, ids, mask, embeds, [len(ids)])
    first = int(mask.nonzero()[3])  # the first chunk ends inside the span's first image row
    chunked = engine_logits(checkpoint, ids, mask, embeds, [first, 7, len(ids) - first - 7])
    assert (chunked - whole).abs().max().item() < 1e-4


def test_image_embeds_of_the_wrong_shape_are_clear_errors(checkpoint, model):
    ids, mask, embeds = image_prompt(model)
    runner = make_runner(*checkpoint)
    ((_, _, ctx),) = step(runner, ids, [len(ids)])
    with pytest.raises(ValueError, match=r"image_embeds must be \[\d+, 64\]"):
        runner.model(ctx, runner.kv_cache.layers, torch.arange(1), image_mask=mask, image_embeds=embeds[1:])
    with pytest.raises(ValueError, match="without the image_mask"):
        runner.model(ctx, runner.kv_cache.layers, torch.arange(1), image_embeds=embeds)


# ---------------------------------------------------------------------- layout under parallelism


def test_the_tower_is_replicated_and_never_an_fp8_projection(model):
    from deepinfer_core.models import tensor_parallel
    from deepinfer_core.models.deepseek_v41.release import is_vision
    from deepinfer_core.models.loading.weight_formats import fp8_projection_names

    names = [n for n in model.state_dict() if is_vision(n)]
    assert len(names) == 2 + 8 * 2 + 1 + 4 + 3
    assert tensor_parallel.tensor_shards(names, 0, 2) == {}  # whole on every tensor-parallel rank
    assert not [n for n in fp8_projection_names(model) if is_vision(n)]


def test_images_under_expert_parallelism_are_refused_before_a_step(model):
    from deepinfer_core.models.deepseek_v41.vision import check_image_input

    check_image_input(model.config)
    with pytest.raises(NotImplementedError, match="^images under expert parallelism: "):
        check_image_input(model.config, expert_parallel=True)
    text_only = V41Config.from_dict({k: v for k, v in tiny_v41_config().items() if k != "vision_config"})
    with pytest.raises(ValueError, match="cannot take images"):
        check_image_input(text_only)
