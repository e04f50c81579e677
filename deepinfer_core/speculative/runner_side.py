"""The runner's speculative hooks: save the rows drafts will write before the forward, then accept,
roll back and shrink block tables after it (`ModelRunner.execute` calls `capture` and `finish`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer_core import plugins
from deepinfer_core.backends.moe import check_expert_format
from deepinfer_core.backends.verify import VerifySpec
from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.kv.blocks import kept_blocks
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.plan import StepPlan, StepResult
from deepinfer_core.speculative import verify
from deepinfer_core.speculative.rollback import DraftRollback, DraftRows, SavedRows, check_ring_sizes


class SpecVerifier:
    """Per runner: the rollback of its cache and, for `acceptance="rejection"`, the verify backend."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, plans, kv_cache, device: torch.device,
                 seed: int) -> None:
        check_ring_sizes(plans, config.num_speculative_tokens)
        self.config = config
        self.rollback = DraftRollback(kv_cache.layers, plans, kv_cache.stacks)
        self.verifier = None
        self.generator = None
        if config.acceptance == "rejection":
            spec = VerifySpec(vocab_size=vocab_size, max_draft_tokens=config.num_speculative_tokens)
            self.verifier = plugins.make_verifier(spec, device)
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    @classmethod
    def build(cls, engine_config, model_config, plans, kv_cache, device: torch.device) -> SpecVerifier | None:
        """The runner's verifier, or None when the engine does not speculate."""
        config = engine_config.speculative_config
        if config is None:
            return None
        return cls(config, model_config.vocab_size, plans, kv_cache, device, engine_config.seed)

    def _draft_rows(self, plan: StepPlan, states) -> list[DraftRows]:
        return [DraftRows(state.slot, r.start, r.num_draft_tokens, state.block_table)
                for r, state in zip(plan.requests, states) if r.num_draft_tokens]

    def capture(self, plan: StepPlan, states) -> SavedRows | None:
        """Before the forward: the cache rows the plan's drafts will write (None: the plan has none)."""
        return self.rollback.capture(self._draft_rows(plan, states))

    def finish(self, plan: StepPlan, states, rows: list[int], logits: torch.Tensor, tensors,
               result: StepResult, saved: SavedRows, draft_probs: dict[int, torch.Tensor] | None = None) -> StepResult:
        """After sampling every row: accept drafts, roll back the rejected ones' cache rows and blocks,
        and return one output row per emitted token (`StepResult.num_accepted` per sampled request).
        `draft_probs`: per request index, the distributions its drafts were drawn from (MTP), which
        rejection sampling uses as q."""
        output, rejection = result.output, None
        if self.verifier is not None:
            eligible = {i for i in set(rows) if verify.is_rejection_eligible(
                states[i].sampling_params, plan.requests[i].start + 1 - states[i].num_prompt_tokens)}
            if eligible:
                rejection = verify.rejection_verify(self.verifier, plan, rows, eligible, logits,
                                                    tensors.temperature, self.generator, draft_probs)
                if rejection:
                    merged = verify.merge_rejection(output, logits, tensors, rows, rejection)
                    output = replace(merged, token_ids=_keep_nonfinite(output.token_ids, merged.token_ids))
        verified = verify.accept_drafts(plan, rows, output, rejection, tensors.needs_logprobs or tensors.num_logprobs > 0)
        accepted = dict(zip(dict.fromkeys(rows), verified.num_accepted, strict=True))
        drafted = [i for i, r in enumerate(plan.requests) if r.num_draft_tokens]
        DraftRollback.restore(saved, [accepted[i] for i in drafted])
        for i in drafted:
            request, state = plan.requests[i], states[i]
            keep = kept_blocks(len(state.block_table), len(request.new_block_ids), request.start + 1 + accepted[i])
            del state.block_table[keep:]
        return StepResult(verified.sampled, verified.output, result.prompt_logits, verified.num_accepted)


def _keep_nonfinite(sampled: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """Rows the sampler marked non-finite stay marked after the verifier's tokens are merged in."""
    return torch.where(sampled < 0, sampled, merged)


def build_mtp_drafter(engine_config, target, model, local_config, expert_format: str, tp,
                      weights: dict[str, torch.Tensor] | None):
    """The MTP drafter when `speculative_config.method == "mtp"` (else None): the checkpoint's `mtp.*`
    layer (from `weights`, internal names without `mtp.`, or read from the checkpoint), held in the
    target's formats (packed FP4 experts where `expert_format` is "fp4", FP8 projections where the
    target keeps them), bound to backends of its own plan and to the target `model`'s embedding, LM
    head and layer ops. `target`: the drafter's `DraftTarget`; `local_config`: this rank's part of the
    model; under tensor parallelism (`tp`: the rank's `GroupInfo`) the layer is the rank's shard, cut
    like the target's layers (`mtp_tensor_shards`).

    :raises MTPWeightsMissingError: the checkpoint has no MTP weights.
    """
    from deepinfer_core.models.loading.mtp_weights import build_mtp, load_mtp_weights
    from deepinfer_core.speculative.mtp_drafter import MTPDrafter

    config = engine_config.speculative_config
    if config is None or config.method != "mtp":
        return None
    keep_fp4 = expert_format == "fp4"
    keep_fp8 = engine_config.quantized_weights == "native"
    source = "the in-memory weights" if weights else engine_config.model
    dtype, device = target.dtype, target.device
    if not weights:  # none given with in-memory weights either: the checkpoint directory may hold them
        weights = load_mtp_weights(engine_config.model, target.config, dtype, device,
                                   keep_fp4=keep_fp4, keep_fp8=keep_fp8, tp_rank=tp.rank, tp_size=tp.size)
    elif tp.size > 1:  # this rank's slices, FP8 projections dequantised first (as the target's are)
        weights = weight_formats.prepare_weights(weights, "fp4" if keep_fp4 else "dense", dtype,
                                                 keep_fp8=False, block=weight_formats.fp8_layout(target.config)[0])
        weights = tensor_parallel.shard_weights(weights, tensor_parallel.mtp_tensor_shards(weights, tp.rank, tp.size))
    # a rank's layer has its share of the heads, output groups and expert width (`shard_config`)
    module = build_mtp(local_config, dtype, weights, device, source, keep_fp4=keep_fp4, keep_fp8=keep_fp8)
    check_ring_sizes([module.plan], config.num_speculative_tokens)
    attention = plugins.make_attention(module.plan.attention, device)
    moe = plugins.make_moe(module.plan.moe, device)
    check_expert_format(moe, module.plan.moe)
    linears = weight_formats.bind_linears(module, plugins.make_linear, device)
    module.bind(model, attention, moe, model.ops, device)
    model.keeps_final_streams = True
    drafter = MTPDrafter(module, target, config.num_speculative_tokens, keeps_probs=config.acceptance == "rejection")
    drafter.backends = [attention, moe, *linears]
    return drafter
