"""How long `deepinfer --help` and `deepinfer serve --help` take to answer, and `import torch` beside them.

    python bench/cli_help.py [--repeats 5]

Runs each command `--repeats` times in a fresh interpreter (`python -m deepinfer_core.cli ...`) and prints
one JSON line per command: the median and the fastest wall seconds. Help imports no torch (tests/test_cli.py
checks what it imports); `import torch` is the figure it avoids. A figure, not a test: a loaded machine
slows everything alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "deepinfer --help": [sys.executable, "-m", "deepinfer_core.cli", "--help"],
    "deepinfer serve --help": [sys.executable, "-m", "deepinfer_core.cli", "serve", "--help"],
    "deepinfer router --help": [sys.executable, "-m", "deepinfer_core.cli", "router", "--help"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}


def wall_seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args(argv)
    for name, command in COMMANDS.items():
        wall_seconds(command)  # warm the file cache
        times = [wall_seconds(command) for _ in range(args.repeats)]
        print(json.dumps({"command": name, "median_s": round(statistics.median(times), 3),
                          "min_s": round(min(times), 3), "repeats": args.repeats}))


if __name__ == "__main__":
    main()
