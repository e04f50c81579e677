"""DeepSeek-V4.1's forward on a tiny model with every role: decode == full forward, any chunking == one
shot, a batch == each alone, reuse layers get their sources' tensors, reindex picks, single-pass mHC."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.models import deepseek_v41
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


def test_reuse_layers_receive_their_sources_entries_and_picks_unchanged(checkpoint, monkeypatch):
    runner = make_runner(*checkpoint)
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
    k = plans[7].attention.index_topk
    for t, position in enumerate(positions.tolist()):
        visible = position + 1  # ratio 1
        chosen = [e for e in picks[t].tolist() if e >= 0]
        assert all(e < visible for e in chosen)  # never a future entry
        candidates = set(torch.nonzero(masks[0][t][:visible]).flatten().tolist())
        assert len(set(chosen) & candidates) == min(k, len(candidates))  # every candidate first
        assert len(chosen) == min(k, visible)


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
