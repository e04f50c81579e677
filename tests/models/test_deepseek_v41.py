"""DeepSeek-V4.1's forward on a tiny model with every role: decode == full forward, any chunking == one
shot, a batch == each alone, reuse layers get their sources' tensors, reindex picks, single-pass mHC."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from deepinfer_core.models.deepseek_v41 import model as deepseek_v41
from deepinfer_core.reference.layer_ops import collapse, hyper_mix, hyper_residual
from tests.models.v41_helpers import make_runner, random_prompt, tiny_checkpoint
from tests.oracle import FakeSeq, all_position_logprobs, run_chunked

PROMPT_LENGTHS = (1, 6, 23, 41)  # from one token to several windows (8) and candidate pools (6 entries)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def one_shot(checkpoint):
    runner = make_runner(*checkpoint)
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    return prompts, [run_chunked(runner, [p], chunk=1000)[0] for p in prompts]


@pytest.mark.parametrize("chunk", [2, 3, 8])  # 1 token a step: the decode test
def test_any_chunking_equals_one_shot(checkpoint, one_shot, chunk):
    prompts, expected = one_shot
    runner = make_runner(*checkpoint)
    for prompt, mine, full in zip(prompts, run_chunked(runner, prompts, chunk), expected):
        assert torch.equal(mine.argmax(-1), full.argmax(-1)), len(prompt)
        assert (mine - full).abs().max().item() < 1e-4, len(prompt)


def test_incremental_decode_equals_the_full_forward(checkpoint, one_shot):
    prompts, expected = one_shot
    runner = make_runner(*checkpoint)
    seq = FakeSeq(prompts[-1], slot=1, block_table=[3])
    parts = all_position_logprobs(runner, [seq], [11])  # odd: the ratio-2 group stays open across steps
    while seq.num_computed_tokens < seq.num_tokens:
        parts += all_position_logprobs(runner, [seq], [1])
    assert (torch.cat(parts) - expected[-1]).abs().max().item() < 1e-4


def test_a_batch_equals_each_request_alone(checkpoint, one_shot):
    prompts, expected = one_shot
    runner = make_runner(*checkpoint)
    together = run_chunked(runner, prompts, chunk=5)
    for mine, alone in zip(together, expected):
        assert (mine - alone).abs().max().item() < 1e-4


def rms_norm_by_hand(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def rope_by_hand(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing pairs (2i, 2i + 1) of `x` by `angle` `[rope_dim // 2]` (interleaved, as released)."""
    head, rope = x[: -2 * len(angle)], x[-2 * len(angle) :]
    even, odd = rope[0::2], rope[1::2]
    rotated = torch.stack((even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()), -1)
    return torch.cat((head, rotated.flatten()))


@pytest.mark.parametrize("layer, ratio", [(2, 2), (5, 1)])  # a ratio-2 source with a gate, the ratio-1 one
@torch.no_grad()
def test_compressed_entries_and_index_keys_are_the_spec_computed_by_hand(checkpoint, layer, ratio):
    """research-v41.md §4.3: group g pools its tokens' fp32 `wkv` rows with a per-channel softmax over
    `wgate` (ratio 2; ratio 1 is the projection), RMSNorms them into the latent, stores RoPE(latent) at
    position g * ratio and the index key RoPE(k_norm(wk latent)) at the same position; an open group
    waits in the tail ring, unwritten."""
    runner = make_runner(*checkpoint)
    model, inputs = runner.model, {}
    real = model.attention

    def record(i, x, *rest, **options):
        inputs[i] = x.clone()
        return real(i, x, *rest, **options)

    model.attention = record
    prompt, block = random_prompt(7, seed=4), 2
    all_position_logprobs(runner, [FakeSeq(prompt, slot=1, block_table=[block])], [7])
    weights, cache, eps = model.layers[layer].attn, runner.kv_cache.layers[layer], model.config.rms_norm_eps
    compressor, indexer = weights.compressor, weights.indexer
    x = inputs[layer].float()
    kv = x @ compressor.wkv.weight.float().T
    # inverse frequencies of the compressed rope (its YaRN tables are checked in test_v41_plan)
    inv_freq = model.rotary["compress"].inv_freq.float()
    scaling = model.rotary["compress"].scaling
    assert scaling == 1.0  # the reference does not scale cos / sin
    first = block * (128 // ratio)
    for g in range(7 // ratio):
        rows = slice(g * ratio, (g + 1) * ratio)
        if ratio == 2:
            gate = x[rows] @ compressor.wgate.weight.float().T
            pooled = (gate.softmax(dim=0) * kv[rows]).sum(dim=0)
        else:
            pooled = kv[g]
        latent = rms_norm_by_hand(pooled, compressor.norm.weight.float(), eps)
        angle = g * ratio * inv_freq  # the group's first token
        entry = rope_by_hand(latent, angle)
        key = rope_by_hand(rms_norm_by_hand(latent @ indexer.wk.weight.float().T, indexer.k_norm.weight.float(), eps),
                           angle)
        assert torch.allclose(cache.compressed[first + g].float(), entry, atol=1e-5), g
        assert torch.allclose(cache.index_keys[first + g].float(), key, atol=1e-5), g
        assert not torch.allclose(entry, rope_by_hand(latent, (g * ratio + 1) * inv_freq), atol=1e-3)
    if ratio == 2:  # token 6 opens group 3: not written, its fp32 rows in the tail ring at 6 % 17
        assert cache.compressed[first + 3].abs().sum() == 0 and cache.kv_tail.shape[1] == 17
        assert torch.allclose(cache.kv_tail[1, 6].float(), kv[6], atol=1e-5)
        assert torch.allclose(cache.gate_tail[1, 6], x[6] @ compressor.wgate.weight.float().T, atol=1e-5)
    else:
        assert cache.kv_tail.shape[1] == 0  # ratio 1 never has an open group: no tail rows


class Recorder:
    """Wraps an attention backend; keeps what each call received."""

    def __init__(self, backend, calls: list) -> None:
        self.backend, self.calls = backend, calls
        self.spec, self.supports_cuda_graphs = backend.spec, False

    def forward(self, q, kv, window, compressed, sinks, metadata, topk=None, num_entries=None):
        self.calls.append((compressed, topk))
        return self.backend.forward(q, kv, window, compressed, sinks, metadata, topk, num_entries)

    def indexer_topk(self, *args):
        return self.backend.indexer_topk(*args)


def with_text_config(checkpoint, directory: Path, **text) -> tuple[Path, dict]:
    """The checkpoint's files under `directory` (links) with `text` changed in its config.json."""
    source, weights = checkpoint
    directory.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (directory / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["text_config"] |= text
    (directory / "config.json").write_text(json.dumps(config))
    return directory, weights


# the tiny model's 3 candidate blocks of 2 entries are fewer than its 8 picks; the release keeps 2,048
# blocks of 8 for 512 picks: there every pick of a reindex layer lies within its candidates
@pytest.mark.parametrize("regime", [{}, {"candidate_topk_blocks": 5, "index_topk": 4}], ids=["tiny", "release"])
def test_reuse_layers_receive_their_sources_entries_and_picks_unchanged(checkpoint, monkeypatch, tmp_path, regime):
    runner = make_runner(*with_text_config(checkpoint, tmp_path / "model", **regime))
    model = runner.model
    calls: list = []
    model.attention_backends = [Recorder(b, calls) for b in model.attention_backends]
    selections = []
    real = deepseek_v41.two_level_topk

    def record(q, weights, keys, meta, num_entries, plan, config, candidates):
        picks, masks = real(q, weights, keys, meta, num_entries, plan, config, candidates)
        selections.append((plan.index, picks, masks or candidates, meta.positions.clone()))
        return picks, masks

    monkeypatch.setattr(deepseek_v41, "two_level_topk", record)
    run_chunked(runner, [random_prompt(41, seed=9)], chunk=41)
    plans = model.plans
    for plan in plans:
        compressed, topk = calls[plan.index]
        if plan.role == "window":
            assert compressed is None and topk is None
            continue
        source_compressed, _ = calls[plan.kv_source if plan.kv_source is not None else plan.index]
        assert compressed is source_compressed  # the very pool, never re-gathered
        assert topk is calls[plan.index_source][1]  # the source's picks, the same tensor
    assert {i for i, *_ in selections} == {5, 7}  # the candidate source and its reindex layer
    (_, _, masks, positions), = [s for s in selections if s[0] == 7]
    picks = {i: p for i, p, *_ in selections}[7]
    k, within, filtered = plans[7].attention.index_topk, 0, 0
    for t, position in enumerate(positions.tolist()):
        visible = position + 1  # ratio 1
        chosen = [e for e in picks[t].tolist() if e >= 0]
        assert all(e < visible for e in chosen)  # never a future entry
        candidates = set(torch.nonzero(masks[0][t][:visible]).flatten().tolist())
        assert len(set(chosen) & candidates) == min(k, len(candidates))  # every candidate first
        assert len(chosen) == min(k, visible)
        if len(candidates) >= k:
            assert set(chosen) <= candidates
            within += 1
            filtered += len(candidates) < visible
    # the tiny regime never has k candidates; in the release's, most positions pick among filtered ones
    assert (within, filtered) == (0, 0) if not regime else within > 30 and filtered > 20


def test_the_comb_columns_sum_to_one(checkpoint):
    runner = make_runner(*checkpoint)
    model = runner.model
    streams = torch.randn(16, model.hc_mult, model.config.hidden_size) * 3
    for attn_site, ffn_site in model.hc:
        for site in (attn_site, ffn_site):
            _, _, comb = hyper_mix(streams, site, model.mix_spec)
            assert (comb.sum(dim=-2) - 1).abs().max().item() < 1e-5  # Sinkhorn ends on the columns


def test_single_pass_mixing_is_what_the_model_runs(checkpoint):
    """A guard: collapsing each sublayer with its own site's pre-mix (V4's way) changes the logits."""
    runner = make_runner(*checkpoint)
    model, prompt = runner.model, random_prompt(12, seed=3)
    seq = FakeSeq(prompt, slot=0, block_table=[0])
    single_pass = all_position_logprobs(runner, [seq], [12])[0]

    @torch.inference_mode()  # as the forward it stands for
    def v4_style(ctx, caches, logits_indices, image_mask=None):
        hashes = model.engram_hashes(ctx, caches, None)
        streams = model.embed(ctx.input_ids).unsqueeze(1).repeat(1, model.hc_mult, 1)
        shared = {}
        for i, block in enumerate(model.layers):
            if model.plans[i].has_engram:
                streams = model.engram(i, streams, hashes, None)
            pre, post, comb = hyper_mix(streams, model.hc[i][0], model.mix_spec)
            out = model.attention(i, model.ops.rms_norm(collapse(streams, pre), block.attn_norm.weight), ctx, caches[i], shared)
            streams = hyper_residual(streams, out, post, comb)
            pre, post, comb = hyper_mix(streams, model.hc[i][1], model.mix_spec)
            out = model.moe(i, model.ops.rms_norm(collapse(streams, pre), block.ffn_norm.weight), ctx, None)
            streams = hyper_residual(streams, out, post, comb)
        hidden = model.ops.rms_norm(collapse(streams, pre), model.norm.weight)
        return torch.nn.functional.linear(hidden.float(), model.head.weight)

    other = make_runner(*checkpoint)
    other.model.forward = v4_style
    v4_logprobs = all_position_logprobs(other, [FakeSeq(prompt, slot=0, block_table=[0])], [12])[0]
    assert (v4_logprobs - single_pass).abs().max().item() > 1e-2


def test_image_positions_route_with_bias_vl(checkpoint):
    from types import SimpleNamespace

    model = make_runner(*checkpoint).model
    layer, x = 3, torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5
    ffn = model.layers[layer].ffn
    with torch.no_grad():
        ffn.gate.bias_vl.copy_(-ffn.gate.bias - 5 * torch.arange(len(ffn.gate.bias)))  # favours low experts
    ctx = SimpleNamespace(input_ids=torch.arange(5))
    image = torch.tensor([False, True, False, True, True])
    mixed = model.moe(layer, x, ctx, image)
    text = model.moe(layer, x, ctx, None)
    # text rows route alone in `mixed`: a matmul over fewer rows may move the last bits on the CPU
    assert torch.allclose(mixed[~image], text[~image], rtol=0, atol=1e-6)
    weights, backend = model.moe_weights[layer], model.moe_backends[layer]
    vl = dataclasses.replace(weights, score_bias=ffn.gate.bias_vl)
    expected = backend.forward(x[image], ctx.input_ids[image], vl) + ffn.shared_experts(x[image], 10.0)
    assert torch.allclose(mixed[image], expected, atol=1e-6) and not torch.allclose(mixed[image], text[image])
