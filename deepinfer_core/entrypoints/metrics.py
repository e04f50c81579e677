"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated on the event loop; gauges (running and waiting requests, prefix
cache hit rate) are read from the engine's latest `stats()` when `/metrics` is scraped.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.kv.prefix_store import CORRUPTION_REASONS

PREFIX = "deepinfer"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """A cumulative-bucket histogram of seconds."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        """The `_bucket`, `_sum` and `_count` sample lines."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return out


@dataclass
class ServerMetrics:
    """Everything `/metrics` reports besides the engine gauges."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    """(api, outcome) -> count. `ok`; `error` (rejected, 4xx/5xx); `aborted`: the client left before
    the answer was complete, during its upload or during generation."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    e2e_latency: Histogram = field(default_factory=Histogram)
    kv_transfer_refused: dict[str, int] = field(default_factory=dict)
    """reason -> KV transfer handles a decode instance refused at the door (`pd.KvTransferGate`):
    `signature` (missing or wrong), `source` (not a configured prefill instance), `role` (not a decode
    instance). Its engine's own failures are `kv_transfer_failures_total`."""

    def count_kv_transfer_refused(self, reason: str) -> None:
        """Count one handle refused for `reason` (the request is then computed here)."""
        self.kv_transfer_refused[reason] = self.kv_transfer_refused.get(reason, 0) + 1

    def count_request(self, api: str, outcome: str) -> None:
        """Count one finished request of `api` with `outcome`."""
        self.requests[(api, outcome)] = self.requests.get((api, outcome), 0) + 1

    def record_request(self, api: str, outcome: str, num_prompt_tokens: int, last_output: Any,
                       arrival: float) -> None:
        """Count one request that reached the engine, with its tokens (from its last `RequestOutput`)."""
        self.count_request(api, outcome)
        self.prompt_tokens += num_prompt_tokens
        if last_output is not None:
            self.cached_prompt_tokens += int(last_output.num_cached_tokens or 0)
            self.generation_tokens += len(last_output.outputs[0].token_ids)
        if outcome == "ok":
            self.e2e_latency.observe(time.monotonic() - arrival)

    def render(self, engine_stats: dict[str, Any]) -> str:
        """The whole exposition text."""
        lines = [f"# HELP {PREFIX}_requests_total Requests served, by API and outcome.",
                 f"# TYPE {PREFIX}_requests_total counter"]
        lines += [f'{PREFIX}_requests_total{{api="{api}",outcome="{outcome}"}} {n}'
                  for (api, outcome), n in sorted(self.requests.items())]
        for name, value, text in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of served requests."),
            ("prompt_cached_tokens_total", self.cached_prompt_tokens, "Prompt tokens served from the prefix cache."),
            ("generation_tokens_total", self.generation_tokens, "Generated tokens."),
        ):
            lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} counter", f"{PREFIX}_{name} {value}"]
        if self.kv_transfer_refused:
            lines += [f"# HELP {PREFIX}_kv_transfer_refused_total KV transfer handles refused (prompt computed here).",
                      f"# TYPE {PREFIX}_kv_transfer_refused_total counter"]
            lines += [f'{PREFIX}_kv_transfer_refused_total{{reason="{reason}"}} {n}'
                      for reason, n in sorted(self.kv_transfer_refused.items())]
        for name, value, text in self._gauges(engine_stats):
            lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} gauge", f"{PREFIX}_{name} {value}"]
        lines += prefix_tier_lines(engine_stats)
        lines += _spec_decode_lines(engine_stats)
        for name, key, text in _ENCODER_COUNTERS:
            if key in engine_stats:
                lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} counter",
                          f"{PREFIX}_{name} {engine_stats[key]}"]
        for name, histogram, text in (
            ("time_to_first_token_seconds", self.time_to_first_token, "Seconds from arrival to the first token."),
            ("e2e_request_latency_seconds", self.e2e_latency, "Seconds from arrival to the last token."),
        ):
            lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} histogram"]
            lines += histogram.lines(f"{PREFIX}_{name}")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _gauges(stats: dict[str, Any]) -> list[tuple[str, float, str]]:
        hits = stats.get("prefix_cache_hit_tokens", 0) or 0
        queries = stats.get("prefix_cache_queried_tokens", 0) or 0
        return [
            ("num_requests_running", stats.get("num_running", 0), "Requests in the running batch."),
            ("num_requests_waiting", stats.get("num_waiting", 0), "Requests waiting to be scheduled."),
            ("prefix_cache_hit_rate", hits / queries if queries else 0.0,
             "Prompt tokens found in the prefix cache / prompt tokens looked up, since start."),
            *_eplb_gauges(stats.get("eplb")),
        ]


_TIERS = ("device", "host", "store", "remote")
# (metric, type, help, [(labels, engine stats key)])
_TIER_METRICS = (
    ("prefill_computed_tokens_total", "counter", "Prompt tokens the model computed (prefill chunks, replays, recomputes).",
     [("", "num_prefill_tokens")]),
    ("prefix_cache_replay_tokens_total", "counter", "Tokens below prefix hits recomputed to rebuild the windows.",
     [("", "prefix_cache_replay_tokens")]),
    ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache, by the tier each block came from.",
     [(f'tier="{t}"', f"prefix_cache_hit_tokens_{t}") for t in _TIERS]),
    ("prefix_cache_bytes_moved_total", "counter", "Bytes of cache blocks moved between the prefix tiers.",
     [('path="device_to_host"', "host_cache_bytes_in"), ('path="host_to_device"', "host_cache_bytes_out"),
      ('path="store_read"', "prefix_store_bytes_read"), ('path="store_write"', "prefix_store_bytes_written")]),
    ("prefix_cache_loaded_blocks_total", "counter", "Blocks loaded into the device cache, by source tier.",
     [(f'tier="{t}"', f"prefix_loaded_blocks_{t}") for t in ("host", "store", "remote")]),
    ("host_cache_evictions_total", "counter", "Blocks the host tier dropped (least recently used).",
     [("", "host_cache_evictions")]),
    ("host_cache_bytes", "gauge", "Bytes of blocks held in the host tier.", [("", "host_cache_bytes")]),
    ("prefix_store_size_bytes", "gauge", "Bytes in the prefix store (last garbage collection + writes since).",
     [("", "prefix_store_size_bytes")]),
    ("prefix_store_blocks", "gauge", "Block files in the prefix store.", [("", "prefix_store_blocks")]),
    ("prefix_store_evictions_total", "counter", "Block files the garbage collector deleted, by reason.",
     [('reason="ttl"', "prefix_store_evictions_ttl"), ('reason="capacity"', "prefix_store_evictions_capacity")]),
    ("prefix_store_corrupt_blocks_total", "counter", "Store files refused on read (deleted, recomputed), by reason.",
     [(f'reason="{r}"', f"prefix_store_corrupt_{r}") for r in CORRUPTION_REASONS]),
    ("prefix_store_load_seconds_total", "counter", "Seconds requests waited loading their prefix from the store.",
     [("", "prefix_store_load_seconds_total")]),
    ("prefix_store_loads_total", "counter", "Store loads requests waited for.", [("", "prefix_store_loads")]),
    ("prefix_store_load_seconds_max", "gauge", "Longest wait for a store load.", [("", "prefix_store_load_seconds_max")]),
    ("kv_transfer_blocks_in_total", "counter", "Blocks a decode instance read from prefill instances.",
     [("", "kv_transfer_blocks_in")]),
    ("kv_transfer_states_in_total", "counter", "Request states (windows, tails, partial block) read from prefill instances.",
     [("", "kv_transfer_states_in")]),
    ("kv_transfer_failures_total", "counter", "Reads from prefill instances that failed (prompt computed here).",
     [("", "kv_transfer_failures")]),
    ("kv_transfer_exports_pending", "gauge", "Exports of a prefill instance not yet read.",
     [("", "kv_transfer_exports_pending")]),
    ("prefix_saves_pending", "gauge", "Block saves whose device-to-host copy is still running.",
     [("", "prefix_saves_pending")]),
    ("num_requests_loading", "gauge", "Requests waiting for their prefix to load from the store.", [("", "num_loading")]),
)


def prefix_tier_lines(stats: dict[str, Any]) -> list[str]:
    """Exposition lines of the prefix tiers: per-tier hits and hit rates, bytes moved, store size,
    evictions, refused files and load latency (only the metrics whose stats the engine reports)."""
    lines = []
    queried = stats.get("prefix_cache_queried_tokens", 0) or 0
    if "prefix_cache_hit_tokens_device" in stats:
        lines += [f"# HELP {PREFIX}_prefix_cache_tier_hit_rate Prompt tokens served by a tier / prompt tokens looked up.",
                  f"# TYPE {PREFIX}_prefix_cache_tier_hit_rate gauge"]
        lines += [f'{PREFIX}_prefix_cache_tier_hit_rate{{tier="{t}"}} '
                  f'{stats.get(f"prefix_cache_hit_tokens_{t}", 0) / queried if queried else 0.0}' for t in _TIERS]
    for name, kind, text, samples in _TIER_METRICS:
        present = [(labels, stats[key]) for labels, key in samples if key in stats]
        if not present:
            continue
        lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} {kind}"]
        lines += [f"{PREFIX}_{name}{{{labels}}} {value}" if labels else f"{PREFIX}_{name} {value}"
                  for labels, value in present]
    return lines


_ENCODER_COUNTERS = (
    ("encoder_images_encoded_total", "encoder_images_encoded", "Images run through the vision encoder."),
    ("encoder_cache_hits_total", "encoder_cache_hits", "Images whose encoder rows came from the encoder cache."),
    ("encoder_seconds_total", "encoder_seconds", "Seconds the vision encoder ran."),
)

_SPEC_COUNTERS = (
    ("spec_decode_num_drafted_tokens_total", "spec_drafted_tokens", "Draft tokens proposed by the drafter."),
    ("spec_decode_num_verified_tokens_total", "spec_verified_tokens", "Draft tokens sent to the target to verify."),
    ("spec_decode_num_accepted_tokens_total", "spec_accepted_tokens", "Verified draft tokens the target accepted."),
    ("spec_decode_num_verify_steps_total", "spec_verify_steps", "Request steps that verified at least one draft."),
    ("spec_decode_num_overlapped_steps_total", "spec_overlapped_steps",
     "Steps left in flight (overlapped decode) because no request was expected to draft in the next."),
    ("spec_decode_num_probe_steps_total", "spec_probe_steps",
     "Steps that verified drafts of a request that had stopped drafting, to see whether acceptance came back."),
)


def _spec_decode_lines(stats: dict[str, Any]) -> list[str]:
    """Speculative decoding's counters, mean acceptance length and acceptance histogram (none without it)."""
    if "spec_verify_steps" not in stats:
        return []
    lines = []
    for name, key, text in _SPEC_COUNTERS:
        if key not in stats:
            continue
        lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} counter", f"{PREFIX}_{name} {stats[key]}"]
    name = f"{PREFIX}_spec_decode_mean_acceptance_length"
    lines += [f"# HELP {name} Tokens emitted per verify step (accepted drafts + 1).", f"# TYPE {name} gauge",
              f"{name} {stats['spec_mean_acceptance_length']}"]
    name = f"{PREFIX}_spec_decode_accepted_per_step"
    histogram = stats["spec_acceptance_histogram"]
    lines += [f"# HELP {name} Verify steps by drafts accepted.", f"# TYPE {name} histogram"]
    total = 0
    for accepted, count in enumerate(histogram):
        total += count
        lines.append(f'{name}_bucket{{le="{accepted}"}} {total}')
    lines += [f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_count {total}",
              f"{name}_sum {sum(a * c for a, c in enumerate(histogram))}"]
    return lines + _per_slot_lines(stats)


_SPEC_PER_SLOT = (  # (metric, stats key, kind, the count saying whether a slot has a value, help)
    ("spec_decode_num_verified_per_slot_total", "spec_verified_per_slot", "counter", "spec_verified_per_slot",
     "Drafts verified at each slot (the j-th draft of a step, from 0)."),
    ("spec_decode_num_accepted_per_slot_total", "spec_accepted_per_slot", "counter", "spec_verified_per_slot",
     "Drafts accepted at each slot."),
    ("spec_decode_acceptance_rate", "spec_acceptance_rate_per_slot", "gauge", "spec_verified_per_slot",
     "Accepted / verified drafts at each slot."),
    ("spec_decode_mean_confidence", "spec_mean_confidence_per_slot", "gauge", "spec_confidences_per_slot",
     ("Mean of the drafter's own confidence (DSpark: its head's raw output, before any sigmoid or "
      "calibration) over the drafts verified at each slot.")),
    ("spec_decode_mean_calibrated_confidence", "spec_mean_calibrated_confidence_per_slot", "gauge",
     "spec_calibrated_per_slot",
     ("Mean calibrated acceptance probability (the engine's online calibration of the raw confidence) over "
      "the drafts verified at each slot.")),
)


def _per_slot_lines(stats: dict[str, Any]) -> list[str]:
    """Speculative decoding's figures per draft slot, labelled `slot` (none before a slot was verified)."""
    lines = []
    for name, key, kind, count_key, text in _SPEC_PER_SLOT:
        counts = stats.get(count_key) or []
        present = [(slot, value) for slot, (value, count) in enumerate(zip(stats.get(key) or [], counts)) if count]
        if not present:
            continue
        lines += [f"# HELP {PREFIX}_{name} {text}", f"# TYPE {PREFIX}_{name} {kind}"]
        lines += [f'{PREFIX}_{name}{{slot="{slot}"}} {value}' for slot, value in present]
    return lines


def _eplb_gauges(eplb: dict[str, Any] | None) -> list[tuple[str, float, str]]:
    """Expert-parallel load balance figures of the latest rebalance (none without EPLB)."""
    if not eplb:
        return []
    return [
        ("eplb_balance", eplb["balance_before"],
         "Busiest EP rank's routed load / mean rank load over the EPLB window, measured before the latest rebalance."),
        ("eplb_balance_after_rebalance", eplb["balance_after"],
         "The same window's balance under the placement the latest rebalance chose."),
        ("eplb_rebalances", eplb["num_rebalances"], "Expert rebalances since start."),
        ("eplb_last_pause_seconds", eplb["pause_s"], "How long serving paused for the latest rebalance."),
    ]
