"""`signalled_peer`: which rank's death the others' failures echo."""

from __future__ import annotations

import signal
import subprocess
import sys

from deepinfer_core.executor.protocol import signalled_peer


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


def test_names_the_rank_killed_by_a_signal():
    quiet, killed = subprocess.Popen([sys.executable, "-c", "pass"]), _sleeper()
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    assert signalled_peer({0: quiet, 1: killed}, grace_s=5.0) == (1, -signal.SIGKILL)


def test_none_when_every_peer_exits_otherwise_or_time_is_up():
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    done.wait(10)
    assert signalled_peer({0: done}, grace_s=5.0) is None
    running = _sleeper()
    try:
        assert signalled_peer({0: running}, grace_s=0.2) is None
    finally:
        running.kill()
        running.wait(10)
