"""The bench scripts' record: each run appends one JSON object a measured point to
`bench/results/<script>.jsonl` (`../shared/BENCH.md`), beside the readable account in RESULTS.md.

Each object holds `script`, `card`, `commit`, `date` (UTC), the fields the script gives (workload, batch,
figures) and nothing else. `DEEPINFER_BENCH_RESULTS` names another folder (the GPU machine writes where
its output is collected); smoke runs on the CPU (`--tiny`) record nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def current_commit() -> str:
    """The checkout's short commit, or "?" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip() or "?"


def record(script: str, points: list[dict], card: str, commit: str = "?") -> Path | None:
    """Append `points` to `<results>/<script>.jsonl` and return the file (None when there is no point)."""
    if not points:
        return None
    folder = Path(os.environ.get("DEEPINFER_BENCH_RESULTS") or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{script}.jsonl"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    commit = commit if commit != "?" else current_commit()
    with path.open("a") as f:
        for point in points:
            f.write(json.dumps({"script": script, "card": card, "commit": commit, "date": stamp, **point}) + "\n")
    return path
