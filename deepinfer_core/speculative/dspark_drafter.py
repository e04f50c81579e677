"""The DSpark drafter on the runner side: after each step, write the stage window caches at the positions
the step made final, then draft up to k tokens for every request the step sampled
(`deepinfer_core.models.deepseek_v41.dspark` computes; this module keeps the caches and the loop).

Caches: per stage a ring `[slots, window, head_dim]` of context KV, indexed by position % window. Only
final positions are ever written (a prefill chunk's rows, a replay's rows, the last token plus the drafts
the step accepted): the block's own KV is never cached, and rejected drafts never reach the rings, so a
rollback leaves nothing to undo. A request's rows since its admission (`first`) are the only ones its block
sees, so a slot's earlier owner, and a preempted run's rows, are never read; a prefix hit's replayed rows
(`swa_replay`) write the window below the hit as the target's replay recomputes it, and chunked prefill
writes each chunk's rows as they come.

Drafts are drawn slot by slot with the request's own sampling (greedy: argmax; seeded: the draw the
target will make at that position, `Sampler` with the request's seed and step), the Markov bias of each
slot reading the token drawn at the slot before (the anchor for slot 0), so a draft is accepted exactly
when DSpark agrees with the target's own draw and verification stays lossless. Each draft's confidence is
the confidence head's RAW output (no sigmoid; `seq.draft_confidences`), for the engine's policy to calibrate.

Layout: data parallelism runs one drafter per rank over its own requests, with the whole drafter (as the
MTP drafter runs); tensor and expert parallelism and decoder-side trimming are refused at build
(`NotImplementedError`; V4.1 has no context parallelism). The drafter runs eagerly (no CUDA graphs of
its own yet).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from deepinfer_core.backends.sampling_tensors import (
    to_device,
)
from deepinfer_core.plan import StepPlan, StepResult


class DSparkDrafter:
    """Runs DSpark over each step's final positions and proposes the next drafts; one per runner."""

    reads_every_step = True
    """The runner calls `propose` after steps that sample nothing too (prefill chunks write the windows)."""

    def __init__(self, module, target, num_drafts: int) -> None:
        """`module`: a bound `DSparkModule`; `target`: the target's side (`mtp_drafter.DraftTarget`);
        `num_drafts`: k, at most the module's block size."""
        if not 1 <= num_drafts <= module.block_size:
            raise ValueError(f"num_speculative_tokens is {num_drafts}; DSpark drafts 1 to dspark_block_size "
                             f"({module.block_size}) tokens")
        self.module, self.target, self.num_drafts, self.device = module, target, num_drafts, target.device
        width = module.config.head_dim
        self.rings = [torch.zeros(target.num_slots + 1, module.window, width, dtype=target.dtype, device=target.device)
                      for _ in module.mtp]
        """Per stage, each slot's ring of context KV (the last slot: scratch)."""
        self.first: dict[str, int] = {}
        """Per request, its first context position since admission: older ring rows belong to someone else."""
        self.graphs = None
        self.backends: list = []
        self.last_proposed: list[tuple[str, int]] = []
        """The last proposals' requests and the last context position each drafted after (plan order)."""

    def capture_graphs(self, api, sizes, max_seq_len: int) -> None:
        """DSpark runs eagerly: no graphs of its own yet (the target's decode graphs still capture)."""

    def draft_probs(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """No draft distributions are kept: rejection sampling treats DSpark's drafts as the seeded rule does."""
        return {}

    def propose(self, plan: StepPlan, states, input_ids: torch.Tensor, taps: torch.Tensor,
                result: StepResult) -> list[tuple[list[int], list[float]]] | None:
        """Write the step's final positions into the rings; per sampled request (plan order), its drafts
        and their raw confidences (None: the step sampled no request)."""
        for request_id in (*plan.freed_request_ids, *(n.request_id for n in plan.new_requests)):
            self.first.pop(request_id, None)
        final = self._final_rows(plan, result)
        if final["rows"]:
            self._write(states, taps, final)
        if not final["sampled"] or not plan.propose_drafts:  # windows written; no drafts asked for (pausable)
            return None
        emitted = result.output.token_ids.to(self.device, torch.long)
        anchors = emitted[to_device([final["emitted"]], self.device)[0]].clamp(min=0)
        return self._draft(plan, states, final["sampled"], anchors)

    def _final_rows(self, plan: StepPlan, result: StepResult) -> dict:
        """Host lists: the taps rows of the step's final positions (`rows`, `positions`, `slots` by state
        index), and per sampled request (state index, last context position) and its emitted token's row."""
        last_emitted = {i: row for row, i in enumerate(result.sampled)}
        accepted = dict(zip(dict.fromkeys(result.sampled), result.num_accepted or [], strict=False))
        out = {"rows": [], "positions": [], "states": [], "sampled": [], "emitted": []}
        offset = 0
        for i, request in enumerate(plan.requests):
            s, n, d = request.start, request.num_tokens, request.num_draft_tokens
            count = n - d + accepted.get(i, 0) if request.is_sampled else n
            first = self.first.setdefault(request.request_id, s)
            # only the last window's rows of a long chunk matter (and a ring takes each slot once)
            for j in range(max(0, count - self.module.window), count):
                out["rows"].append(offset + j)
                out["positions"].append(s + j)
                out["states"].append(i)
            if request.is_sampled and i in last_emitted and s + count - 1 >= first:
                out["sampled"].append((i, s + count - 1))
                out["emitted"].append(last_emitted[i])
            offset += n
        return out

    def _write(self, states, taps: torch.Tensor, final: dict) -> None:
        slots = [states[i].slot for i in final["states"]]
        rows, positions, slots_d = to_device([final["rows"], final["positions"], slots], self.device)
        keys = self.module.context_kv(taps.index_select(0, rows), positions)
        for ring, kv in zip(self.rings, keys, strict=True):
            ring[slots_d, positions % self.module.window] = kv.to(ring.dtype)

    def _draft(self, plan: StepPlan, states, sampled: list[tuple[int, int]], anchors: torch.Tensor):
        module, w = self.module, self.module.window
        self.last_proposed = [(plan.requests[i].request_id, p) for i, p in sampled]
        slots = [states[i].slot for i, _ in sampled]
        firsts = [self.first[plan.requests[i].request_id] for i, _ in sampled]
        slots_d, last_d, first_d = to_device([slots, [p for _, p in sampled], firsts], self.device)
        visible = context_visibility(last_d, first_d, w)[1]
        context = [ring[slots_d] for ring in self.rings]
        hidden, logits = module.block(anchors, last_d, context, visible)
        tensors = self.target.draft_tensors(states, [(i, p + 2) for i, p in sampled])
        prev, drafts, confidences = anchors, [], []
        for slot in range(self.num_drafts):
            bias, code = module.markov(prev)
            confidences.append(module.confidence(hidden[:, slot], code))
            if slot:
                tensors = self.target.next_draft_tensors(tensors, states, [(i, p + 2 + slot) for i, p in sampled])
            prev = self.target.sampler.sample(logits[:, slot] + bias, tensors).token_ids.to(torch.long)
            drafts.append(prev)
        k = self.num_drafts
        # one copy to the host for both (float64 holds every token id exactly)
        host = torch.cat((torch.stack(drafts, dim=1).double(), torch.stack(confidences, dim=1).double()), dim=1).tolist()
        return [([int(t) for t in row[:k]], row[k:]) for row in host]


def context_visibility(last: torch.Tensor, first: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the position each ring slot holds once position `last` `[B]` is written (slot j:
    `last - ((last - j) % window)`, the window (last - window, last]), and which of them its block sees:
    those at or after the request's `first` `[B]` context position (older rows, and negative ones, belong
    to no one or to a slot's earlier owner)."""
    held = last[:, None] - (last[:, None] - torch.arange(window, device=last.device)) % window
    return held, held >= first[:, None].clamp(min=0)


def build_dspark_drafter(engine_config, target, model, parallel, target_moe, trimming: bool) -> DSparkDrafter:
    """The DSpark drafter of a DeepSeek-V4.1 `model` (bound) when `speculative_config.method == "dspark"`:
    the checkpoint's `mtp.*` stages read from `engine_config.model`, held in the target's formats
    (`target_moe`: a target layer's `MoESpec`, whose expert format and deterministic mode the stages
    take), bound to the model's embedding, head, rope and layer ops; the model starts recording its taps.

    :raises NotImplementedError: under tensor or expert parallelism, or with decoder-side trimming.
    """
    from deepinfer_core import plugins
    from deepinfer_core.backends.moe import check_expert_format
    from deepinfer_core.models.deepseek_v41.dspark_weights import build_dspark, load_dspark_weights
    from deepinfer_core.models.loading import weight_formats

    if parallel.tp.size > 1 or parallel.ep.size > 1:
        raise NotImplementedError(f"DSpark under tensor or expert parallelism: tensor parallel size {parallel.tp.size}, "
                                  f"expert parallel size {parallel.ep.size} (data parallelism works)")
    if parallel.cp.size > 1:  # internal: V4.1 refuses context parallelism before any rank starts
        raise NotImplementedError("DSpark under context parallelism")
    if trimming:
        raise NotImplementedError("DSpark with decoder-side trimming: decoder_trimming=True keeps too few rows for "
                                  "its taps")
    config, fmt = target.config, target_moe.expert_format
    weights = load_dspark_weights(engine_config.model, config, target.dtype, target.device, keep_fp4=fmt == "fp4",
                                  keep_fp8=engine_config.quantized_weights == "native")  # FP8 as the target's
    module = build_dspark(config, target.dtype, weights, target.device, fmt)
    spec = replace(module.plans[0].moe, deterministic=target_moe.deterministic)
    moe = plugins.make_moe(spec, target.device)
    check_expert_format(moe, spec)
    linears = weight_formats.bind_linears(module, plugins.make_linear, target.device)  # before `bind` adds the target
    module.bind(model, [moe] * len(module.mtp))
    model.keeps_final_streams = True
    drafter = DSparkDrafter(module, target, engine_config.speculative_config.num_speculative_tokens)
    drafter.backends = [moe, *linears]
    return drafter
