"""The messages between the data-parallel front end and its engine cores (pyzmq frames, msgspec msgpack).

The front end sends each core `AddRequest`, `Abort`, `QueryStats` and `Stop`; a core answers with
`Ready` once built, `Outputs` after a step that produced any, `Stats` when asked, `Alive` while it has
requests (a heartbeat), and `Failed` when it raises (then it exits). Only the start-up arguments (configs and weights, tensors included) travel
pickled, once, before any of these.
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    """Queue a request on the core (its seed already drawn by the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class QueryStats(msgspec.Struct, tag="query_stats"):
    """Ask for the core's `Engine.stats()`."""


class Stop(msgspec.Struct, tag="stop"):
    """Shut the core down (every core of a lockstep group stops at the same round)."""


class Ready(msgspec.Struct, tag="ready"):
    dp_rank: int
    num_free_blocks: int


class Outputs(msgspec.Struct, tag="outputs"):
    """One step's outputs of core `dp_rank`, and its free cache blocks after it (for routing)."""

    dp_rank: int
    num_free_blocks: int
    outputs: list[RequestOutput]


class Stats(msgspec.Struct, tag="stats"):
    dp_rank: int
    stats: dict[str, Any]


class Failed(msgspec.Struct, tag="failed"):
    """A rank of DP rank `dp_rank` raised `message` (global `rank`, when known); it exits after sending this."""

    dp_rank: int
    message: str
    rank: int | None = None


class Alive(msgspec.Struct, tag="alive"):
    """Core `dp_rank` is working (a heartbeat, sent from its own thread while it has requests): the front
    end tells a slow core (beating) from one that hangs or is stopped (silent)."""

    dp_rank: int


ToCore = AddRequest | Abort | QueryStats | Stop
FromCore = Ready | Outputs | Stats | Failed | Alive

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_from_core = msgspec.msgpack.Decoder(FromCore).decode
