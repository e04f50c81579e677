"""Steps broadcast over torch.distributed: one leader rank drives the other ranks of a group.

The leader broadcasts each step as two objects, `("model", plans)` then `("sample", grammar_rows)`,
runs its own share, and gathers every rank's answer at the second: its error (or None), its result
when it answers for a data-parallel rank, and its `RankReport`. A follower (`serve_plans`) runs plan
`plans[index]` of each step until the leader broadcasts `None`.

Two users: `TorchrunExecutor` (the leader is rank 0 and the group the whole world, one plan per DP
rank) and a data-parallel engine core whose DP rank spans several tensor-parallel ranks (the leader is
the DP rank's first rank and the group its ranks, one plan).
"""

from __future__ import annotations

import traceback

import torch.distributed as dist

from deepinfer_core.executor.protocol import WorkerError
from deepinfer_core.executor.worker import RankReport, host_result
from deepinfer_core.plan import StepResult


class StepLeader:
    """The leader's side: broadcast each step to `group` (None: the world) from global rank `src`."""

    def __init__(self, report: RankReport, group, src: int, ranks: list[int]) -> None:
        self.report, self.group, self.src, self.ranks = report, group, src, ranks
        """`ranks`: the group's global ranks, in group order (how an answer names its rank)."""
        self.rank_reports: list[dict | None] = [None] * len(ranks)
        self._error: str | None = None
        """The leader's own error in a step's first phase, reported at its second."""

    def execute_model(self, plans: list) -> None:
        """Broadcast the step's plans (each follower runs its own) and run the leader's, `plans[0]`."""
        dist.broadcast_object_list([("model", plans)], src=self.src, group=self.group)
        self._error = None
        try:
            self.report.execute_model(plans[0])
        except Exception as err:  # noqa: BLE001 -- reported with the other ranks' answers at `sample`
            self._error = f"{type(err).__name__}: {err}"

    def sample(self, grammar_rows) -> tuple[StepResult | None, list]:
        """Broadcast the grammar rows, sample the leader's step and gather every rank's answer: the
        leader's result and, per rank of the group, its result (None but for DP leaders). A rank's
        error ends the step with a `WorkerError` naming that rank."""
        dist.broadcast_object_list([("sample", grammar_rows)], src=self.src, group=self.group)
        error, result = self._error, None
        if error is None:
            try:
                result = self.report.sample(grammar_rows)
            except Exception as err:  # noqa: BLE001 -- the other ranks' answers are still collected
                error = f"{type(err).__name__}: {err}"
        answers = [None] * len(self.ranks)
        try:
            dist.gather_object((error, None, self.report.as_dict()), answers, dst=self.src, group=self.group)
        except Exception as err:
            raise WorkerError(f"a worker rank of {self.ranks} did not answer a step: {err}") from err
        for rank, (status, _, _) in zip(self.ranks, answers):
            if status is not None:
                raise WorkerError(f"worker rank {rank} raised during a step: {status}")
        self.rank_reports = [answer[2] for answer in answers]
        return result, [answer[1] for answer in answers]

    def stop(self) -> None:
        """Tell every follower to stop, and wait until each has read it (no transfer left in flight)."""
        dist.broadcast_object_list([None], src=self.src, group=self.group)
        dist.barrier(group=self.group)


def serve_plans(runner, rank: int, is_leader: bool, index: int, group=None, src: int = 0) -> None:
    """A follower: run plan `index` of every step `src` broadcasts over `group`; report errors (and the
    result when this rank answers for a DP rank, `is_leader`) at each step's second phase; stop at
    `None`. The runner is closed here; the caller destroys the process group."""
    report, error = RankReport(runner, rank), None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        if box[0] is None:
            break
        kind, payload = box[0]
        if kind == "model":
            error = _attempt(report.execute_model, payload[index])[0]
            continue
        result = None
        if error is None:
            error, result = _attempt(report.sample, payload)
        answer = host_result(result) if is_leader and result is not None else None
        dist.gather_object((error, answer, report.as_dict()), None, dst=src, group=group)  # after an error the leader stops everyone with `None`
        error = None
    runner.close()
    dist.barrier(group=group)  # the leader's `stop` waits here too, so neither side tears the group down mid-transfer


def _attempt(call, arg) -> tuple[str | None, object]:
    """`(None, call(arg))`, or `(its error, None)` (printed here, reported to the leader)."""
    try:
        return None, call(arg)
    except Exception as err:  # noqa: BLE001 -- reported to the leader
        traceback.print_exc()
        return f"{type(err).__name__}: {err}", None
