"""The engine's knobs (`EngineConfig`): what the engine is asked to do, resolved once against the model's
config and capabilities (`EngineConfig.resolve`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from deepinfer_core.backends.parallel import EplbConfig, ParallelConfig
from deepinfer_core.config.family import ConfigError, FamilyConfig, SwaReplay
from deepinfer_core.config.speculative import SpeculativeConfig, check_against_model

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""vLLM's other spellings of `dtype` (`LLM(dtype="half")`, `deepinfer serve --dtype half`)."""
"""The compute dtypes, by their torch names (torch is imported when one is needed: the CLI parses without it)."""


class EngineConfig(BaseModel):
    """What the engine is asked to do; `resolve(model_config)` fills the model-dependent defaults.

    Defaults: `max_model_len` = min(max_position_embeddings, 8192); `max_num_batched_tokens` (the
    per-step token budget; prefill is chunked to fit it) = max(8192, max_num_seqs): large enough that a
    prefill step reads each routed expert's weights for many tokens, small enough that a long context
    does not blow up step memory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(description="Checkpoint directory (holds config.json and *.safetensors).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description='Compute dtype; "auto" takes the checkpoint\'s declared float dtype, else bfloat16.',
    )
    seed: int = Field(0, description="Seed for sampling and any random initialisation.")
    max_model_len: PositiveInt | None = Field(None, description="Longest prompt + output, in tokens.")
    max_num_seqs: PositiveInt = Field(256, description="Most requests in one step.")
    max_num_batched_tokens: PositiveInt | None = Field(None, description="Token budget of one step.")
    num_kv_blocks: PositiveInt | None = Field(
        None, description="KV blocks to allocate; None sizes from memory."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Fraction of device memory to use.")
    enable_prefix_caching: bool = Field(
        False, description="Reuse the KV blocks of prompt prefixes already computed (chained block hashes).")
    swa_replay: SwaReplay | None = Field(
        None,
        description='How a prefix-cache hit rebuilds the sliding windows: "exact" recomputes the last '
        'num_layers x sliding_window tokens before the hit, layer l only the last (num_layers - l) windows of them '
        '(same outputs as a cold run), "bounded" only the '
        "last sliding_window (SWA Bounded Replay, approximate, for models built for it); None takes \"exact\" "
        "under deterministic=True (which refuses \"bounded\"), else the model family's default "
        "(its config class's swa_replay_default: exact for V4, bounded for V4.1).",
    )
    host_cache_gib: float = Field(
        0.0, ge=0, description="GiB of (pinned, with CUDA) host memory holding prefix-cache blocks behind the "
        "device cache, least recently used out; 0: no host tier. Needs enable_prefix_caching.")
    prefix_store_path: str | None = Field(
        None, description="Directory (any POSIX path, shared by several engines; a 3FS mount in production) or "
        "plugin URL (scheme://...) of the prefix store: computed blocks are written there and found again by "
        "any engine of the same model, across restarts. Needs enable_prefix_caching.")
    prefix_store_gib: float | None = Field(
        None, gt=0, description="Capacity of the prefix store in GiB (the blocks expiring first go beyond it); "
        "None: unlimited.")
    prefix_store_ttl_s: dict[str, float] | None = Field(
        None, description="Seconds a stored block lives after its last use, per traffic class "
        "(SamplingParams.traffic_class); None: agent 3 days, chat 7 days.")
    default_traffic_class: str = Field("chat", description="Traffic class of requests that name none.")
    kv_transfer_role: Literal["prefill", "decode"] | None = Field(
        None, description='Prefill/decode disaggregation: "prefill" exports computed blocks (from the host tier) '
        'for decode instances, "decode" reads them by NIXL (deepinfer_core.kv.nixl_transfer); None: neither.')
    device: str | None = Field(None, description='Torch device string ("cpu", "cuda:0"); None detects it.')
    enforce_eager: bool = Field(False, description="Never capture CUDA graphs for decode steps.")
    cuda_graph_sizes: tuple[PositiveInt, ...] | None = Field(
        None,
        description="Decode batch sizes captured as CUDA graphs (vLLM's name). None: 1, 2, 4, 8, then steps "
        "of 8 to 32, 16 to 64, 32 to 128, 64 beyond, up to max_num_seqs; one value N: that ladder up to "
        "min(N, max_num_seqs); several: exactly those. Fewer sizes start faster; larger batches than the "
        "largest size decode eagerly.",
    )
    quantized_weights: Literal["native", "dequantize"] = Field(
        "native",
        description='Quantised checkpoint weights: "native" keeps FP4 routed experts in their packed bytes '
        "(the MoE backend decodes them per step; the reference dequantises per call) and FP8 projections "
        "in theirs (run by the make_linear backend; the reference dequantises per call); FP8 routed experts "
        "are dequantised at load. \"dequantize\" expands every quantised tensor to the compute dtype at load.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Overlap decode steps: launch the next step from the sampled tokens still on the "
        "device while the host handles the last one's outputs; None turns it on for CUDA devices.",
    )
    distributed_executor_backend: Literal["uni", "mp"] = Field(
        "uni",
        description='Where the model runs: "uni" in this process, "mp" in one spawned worker process per '
        "rank (world_size ranks, joined by torch.distributed). Under torchrun the ranks are torchrun's.",
    )
    world_size: PositiveInt = Field(
        1, description="Worker ranks of the mp executor when no parallel layout is set (each then holds the whole "
        "model and runs every plan); with tensor/data/context parallel sizes the world is their product."
    )
    worker_timeout_s: float = Field(
        600.0, gt=0, description="Longest a worker rank may take to answer one step before the engine fails."
    )
    worker_heartbeat_timeout_s: float = Field(
        30.0, gt=0, description="Longest a worker rank (mp or torchrun), or a data-parallel engine core, may "
        "stay silent while it has work (no answer, no heartbeat: hung or stopped) before the engine fails, naming "
        "it; ranks and cores beat every quarter of it.")
    speculative_config: SpeculativeConfig | None = Field(
        None, description='Speculative decoding, vLLM\'s spelling: {"method": "ngram" | "mtp" | "dspark", '
        '"num_speculative_tokens": k, ...} (see `deepinfer_core.config.speculative.SpeculativeConfig`); '
        "None decodes one token per request and step.")
    tensor_parallel_size: PositiveInt = Field(1, description="Ranks splitting attention heads and dense projections.")
    data_parallel_size: PositiveInt = Field(
        1, description="Attention data-parallel ranks, each with its own scheduler, requests and cache.")
    context_parallel_size: PositiveInt = Field(1, description="Ranks splitting one long prompt's prefill.")
    enable_expert_parallel: bool = Field(
        False, description="Spread the routed experts over every rank (EP size = TP x DP x CP).")
    enable_eplb: bool = Field(False, description="Rebalance expert replicas by observed load (needs expert parallelism).")
    time_ep_dispatch: bool = Field(
        False, description="Time the expert-parallel all-to-alls on every rank, synchronising the device around "
        "each (bench/ep_scale.py reads it from stats()['ranks']); off for serving.")
    eplb_config: EplbConfig = Field(
        default_factory=EplbConfig,
        description='EPLB knobs: {"num_redundant_experts": R, "window_size": W, "step_interval": S}.')
    deterministic: bool = Field(
        False,
        description="Batch-invariant inference: a request's greedy tokens and logprobs are bit-identical "
        "whatever shares its batch, however its prompt is chunked, after a preemption and after a prefix-cache "
        "hit (every backend is built in its invariant variant; prefix hits replay exactly). Costs throughput.",
    )
    engram_placement: Literal["device", "host"] = Field(
        "device", description='Where a model\'s Engram tables live (DeepSeek-V4.1): "device", or "host" (pinned '
        'host memory: the release\'s ~190 GiB of tables fit no GPU). Layer ops that read host memory from the '
        'device (`HostRowGather`: the NVIDIA plugin\'s) gather the rows with a kernel and decode keeps its CUDA '
        'graphs; others gather on the host, and decode then runs without CUDA graphs. '
        '"host" for a model without Engram tables is an error.')
    engram_prefetch: bool = Field(
        True, description="Host-placed Engram tables: start a step's lookups before its first layer, on a side "
        "stream when the device reads the tables, else gathered on a worker thread and copied on a side stream "
        "(models/engram_prefetch.py); False gathers at the layer. Changes nothing for tables on the device or a "
        "model without Engram.")
    decoder_trimming: bool = Field(
        False, description="DeepSeek-V4.1's decoder-side trimming: in prefill, once the candidate source layer "
        "(20 in the release) has written every row's compressed KV and index keys, the rest of that layer and the "
        "later ones run only on each request's last sliding_window (128) prompt rows and what follows them; "
        "requests asking for prompt logprobs are never trimmed. Faster prefill, not exact (those rows lose "
        "receptive field in the later layers; models/v41_trim.py). Any other model is an error.")
    max_image_bytes: PositiveInt = Field(
        20 * 1024 * 1024, description="Largest encoded image a request may carry, in bytes (a larger one is "
        "refused: HTTP 400).")
    max_image_pixels: PositiveInt = Field(
        32 * 1024 * 1024, description="Most pixels (width x height) of one image, read from its header before "
        "anything is decoded (a decompression bomb is refused: HTTP 400).")
    max_images_per_prompt: int = Field(8, ge=0, description="Most images in one prompt (0: images refused).")
    encoder_cache_mib: float = Field(
        256.0, ge=0, description="MiB of device memory keeping vision encoder outputs by image content hash "
        "(least recently used dropped first), so an image sent again is not encoded again; 0: off.")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        try:
            parallel = self.parallel_config
        except ValidationError as err:
            raise ValueError(f"parallel layout: {err}") from err
        if parallel.world_size > 1 and self.world_size not in (1, parallel.world_size):
            raise ValueError(
                f"world_size={self.world_size} does not match the parallel layout's {parallel.world_size} ranks "
                f"(tensor x data x context parallel sizes); leave world_size at 1 or set it to that product"
            )
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model!r} is not a checkpoint directory (no config.json in it)")
        if (self.host_cache_gib or self.prefix_store_path or self.kv_transfer_role) and not self.enable_prefix_caching:
            raise ValueError("host_cache_gib, prefix_store_path and kv_transfer_role extend the prefix cache: set "
                             "enable_prefix_caching=True too")
        if self.prefix_store_path:
            from deepinfer_core.config.traffic import DEFAULT_TRAFFIC_TTL_S, check_traffic_classes

            check_traffic_classes(self.prefix_store_ttl_s or DEFAULT_TRAFFIC_TTL_S, self.default_traffic_class)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step; raise it or lower "
                f"max_num_seqs"
            )
        if self.deterministic and self.swa_replay == "bounded":
            raise ValueError(
                'deterministic=True needs exact window replay on prefix hits: swa_replay="bounded" changes a '
                'hit\'s outputs by design; leave swa_replay unset or set it to "exact"'
            )
        return self

    @property
    def parallel_config(self) -> ParallelConfig:
        """The parallel layout these options describe (`deepinfer_core.backends.parallel`)."""
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, data_parallel_size=self.data_parallel_size,
            context_parallel_size=self.context_parallel_size, enable_expert_parallel=self.enable_expert_parallel,
            enable_eplb=self.enable_eplb, eplb_config=self.eplb_config)

    @property
    def num_ranks(self) -> int:
        """Ranks of the world: the parallel layout's, else `world_size` (replicas of the whole model)."""
        return max(self.parallel_config.world_size, self.world_size)

    def resolve(self, model_config: FamilyConfig) -> EngineConfig:
        """Return a copy with every None default made concrete for `model_config` (and checked against
        what its family can do, `model_config.capabilities`): the one place the options meet the model.
        After it, `speculative_config` is the typed drafter request the model can serve (or None)."""
        capabilities = model_config.capabilities
        if self.engram_placement != "device" and not capabilities.has_engram:
            raise ConfigError(f"engram_placement={self.engram_placement!r}: {model_config.model_type} has no Engram "
                              "tables (only DeepSeek-V4.1 does); leave engram_placement at 'device'")
        if self.decoder_trimming:
            model_config.check_decoder_trimming()
        check_against_model(self.speculative_config, model_config.model_type, capabilities.drafters,
                            capabilities.dspark_block_size)
        max_model_len = self.max_model_len or min(model_config.max_position_embeddings, 8192)
        if max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}); lower max_model_len"
            )
        budget = self.max_num_batched_tokens or max(8192, self.max_num_seqs)
        replay = self.swa_replay or ("exact" if self.deterministic else capabilities.swa_replay_default)
        try:
            return EngineConfig.model_validate(
                {**self.model_dump(), "max_model_len": max_model_len, "max_num_batched_tokens": budget,
                 "swa_replay": replay}
            )
        except ValidationError as err:  # pragma: no cover - inputs were validated already
            raise ConfigError(str(err)) from err

    def torch_dtype(self, model_config: FamilyConfig) -> torch.dtype:
        """The compute dtype: explicit, or the checkpoint's declared float dtype, else bfloat16."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        declared = model_config.checkpoint_dtype
        return getattr(torch, declared) if declared in _DTYPES else torch.bfloat16
