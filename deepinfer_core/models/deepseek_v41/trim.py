"""DeepSeek-V4.1's decoder-side trimming (research-v41.md §6), an option that is off by default.

Once the trim point (the candidate source layer: 20 in the release) has written its compressed entries
and index keys for every row of a prefill step, the rest of that layer and every later layer run only
on the rows the request will need again: its last `sliding_window` prompt positions (the window the
first decode token reads) and everything after them. A request's rows before its `keep_from` position
never reach those layers, so their window keys there are never written; kept rows' window attention in
those layers therefore starts at `keep_from` (raised window start), which makes the outcome the same
however the prompt is chunked, preempted and recomputed, or hit in the prefix cache. Not exact: kept
rows lose the receptive field the dropped rows gave them in the later layers.

`trim_layer` checks a layer plan can be trimmed, `first_kept_positions` is the runner's per-request
rule; `row_trim.TrimmedStep` cuts a step's flat tensors and metadata down to the kept rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer_core.config import ConfigError
from deepinfer_core.models.deepseek_v41.plan import V41LayerPlan


def trim_layer(plans: Sequence[V41LayerPlan]) -> int:
    """The layer after whose compressor the step keeps only the kept rows: the candidate source.

    Raises `ConfigError` naming `decoder_trimming` when the plan has no candidate source, or when a later
    layer owns state that every row must write (a compressor, Engram, the token-id pool)."""
    sources = [p.index for p in plans if getattr(p, "is_candidate_source", False)]
    if not sources:
        raise ConfigError("decoder_trimming=True needs a DeepSeek-V4.1 layer plan with a candidate source layer "
                          "(candidate_source_layer_id >= 0): it is where trimming starts; leave decoder_trimming off")
    layer = sources[0]
    for plan in plans[layer + 1 :]:
        owned = [name for name, has in (("a compressor", plan.role == "full"), ("Engram", plan.has_engram),
                                        ("the token-id pool", plan.holds_token_ids)) if has]
        if owned:
            raise ConfigError(f"decoder_trimming=True: layer {plan.index} comes after the trim point (layer {layer}) "
                              f"and owns {' and '.join(owned)}, whose state every row must write; leave "
                              "decoder_trimming off for this model")
    return layer


def first_kept_positions(num_prompt_tokens: int, wants_prompt_logprobs: bool, num_kept: int) -> int:
    """The first position of a request that runs the layers after the trim point: its prompt's last
    `num_kept` positions onwards (generated tokens, recomputed after a preemption too, always run them);
    0 for requests asking for prompt logprobs, which are never trimmed."""
    return 0 if wants_prompt_logprobs else max(0, num_prompt_tokens - num_kept)
