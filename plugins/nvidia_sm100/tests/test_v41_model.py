"""A tiny DeepSeek-V4.1 model (every layer role) on the Triton attention, indexer and layer ops (the
single-pass mHC boundaries included) gives the reference's logits: prefill, then decode steps that close
ratio-2 groups and reuse the sources' pools and picks."""

from __future__ import annotations

import torch

from deepinfer_core.backends import IndexScorer
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint

TINY = {"hidden_size": 32, "moe_intermediate_size": 32, "hc_sinkhorn_iters": 3, "num_attention_heads": 2}
"""Off the GPU every kernel program runs in Triton's interpreter, and the mHC kernels' Sinkhorn loop (the
release's 20 iterations) was a third of it; 3 still run the loop. 2 heads, not 4: the attention kernels
and RoPE run a program per head row, and 2 still put more than one head in a token's rows."""


def build(directory, device, **options):
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.worker.runner import ModelRunner

    config = V41Config.from_dir(directory)
    weights = load_v41_checkpoint(directory, config, torch.float32, "cpu")
    engine_config = EngineConfig(model=str(directory), dtype="float32", max_num_seqs=1, num_kv_blocks=2, **options)
    return ModelRunner(config, engine_config.resolve(config), device, weights=weights)


def step(runner, tokens: list[int], start: int, keep_from: list[int] | None = None,
         last_only: bool = False) -> torch.Tensor:
    device, n = runner.device, len(tokens)
    ids = torch.tensor(tokens, device=device)
    positions = torch.arange(start, start + n, device=device)
    totals = torch.tensor([start + n], device=device)
    ctx = runner.make_context(
        ids, positions, totals, torch.zeros(1, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, n], device=device), start_positions=torch.tensor([start], device=device),
        slots=torch.zeros(1, dtype=torch.long, device=device), block_tables=torch.tensor([[0]], device=device),
        query_lens=[n], start_positions_host=[start], max_seq_len=start + n, keep_from=keep_from)
    rows = torch.tensor([n - 1], device=device) if last_only else torch.arange(n, device=device)
    return runner.model(ctx, runner.kv_cache.layers, rows)


def test_the_v41_model_on_triton_attention_and_layer_ops_matches_the_reference(kernel_device, tmp_path):
    """The Triton layer ops serve the norms, ropes, window writes and the single-pass mHC boundaries; the
Triton indexer kernel scores the two-level indexer's layers (`IndexScorer`)."""
    from deepinfer_nvidia_sm100.attention import TritonAttention
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    directory = write_v41_checkpoint(tmp_path / "tiny", tiny_v41_config(**TINY), seed=1)
    reference, triton = build(directory, torch.device("cpu")), build(directory, kernel_device)
    model = triton.model
    ops = TritonLayerOps(model.mix_spec, kernel_device)
    model.bind_backends([TritonAttention(plan.attention) for plan in model.plans], model.moe_backends, ops,
                        kernel_device)
    assert model.ops is ops and all(isinstance(b, IndexScorer) for b in model.attention_backends)
    prompt = torch.randint(3, 129000, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    for tokens, start in ((prompt[:11], 0), (prompt[11:12], 11), (prompt[12:13], 12)):
        expected, got = step(reference, tokens, start), step(triton, tokens, start).cpu()
        assert (got - expected).abs().max().item() < 1e-3


def test_a_trimmed_prefill_on_triton_matches_the_reference(kernel_device, tmp_path):
    """Decoder-side trimming (`EngineConfig.decoder_trimming`) on the Triton kernels: the layers after
    the trim point run the prompt's last window of rows, with window starts raised to the first kept
    position, and give the reference's logits; the decode step after it reads the trimmed windows."""
    from deepinfer_nvidia_sm100.attention import TritonAttention
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    directory = write_v41_checkpoint(tmp_path / "tiny", tiny_v41_config(**TINY), seed=1)
    reference = build(directory, torch.device("cpu"), decoder_trimming=True)
    triton = build(directory, kernel_device, decoder_trimming=True)
    model = triton.model
    model.bind_backends([TritonAttention(plan.attention) for plan in model.plans], model.moe_backends,
                        TritonLayerOps(model.mix_spec, kernel_device), kernel_device)
    assert model.trim_layer is not None and model.trim_layer < len(model.plans) - 1
    window = model.plans[-1].attention.sliding_window
    prompt = torch.randint(3, 129000, (window + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    keep_from = [len(prompt) - window]
    untrimmed = step(build(directory, torch.device("cpu")), prompt, 0, last_only=True)
    expected = step(reference, prompt, 0, keep_from=keep_from, last_only=True)
    got = step(triton, prompt, 0, keep_from=keep_from, last_only=True).cpu()
    assert (got - expected).abs().max().item() < 1e-3
    assert (expected - untrimmed).abs().max().item() > 1e-3  # the trimmed layers did drop rows
    expected, got = step(reference, [prompt[-1]], len(prompt)), step(triton, [prompt[-1]], len(prompt)).cpu()
    assert (got - expected).abs().max().item() < 1e-3
