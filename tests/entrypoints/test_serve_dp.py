"""`deepinfer serve` over data-parallel engine cores: started by the CLI itself (`--data-parallel-size 2`),
and under torchrun as two local "machines" of one rank each (rank 0 fronts the API, rank 1's core runs
beside it). Both answer as one single-process instance does, on the embedded tiny model on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from deepinfer_core.executor.mp import _free_port as free_port
from tests.entrypoints.live import SERVED_NAME, tiny_engine

SERVE = ["serve", "--max-model-len", "512", "--max-num-seqs", "2", "--served-model-name", SERVED_NAME,
         "--data-parallel-size", "2"]
REQUESTS = [{"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0},
            {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 5, "temperature": 0}]


def answers(base_url: str) -> list[str]:
    with httpx.Client(base_url=base_url, timeout=180) as client:
        return [client.post("/v1/completions", json={"model": SERVED_NAME, **body}).json()["choices"][0]["text"]
                for body in REQUESTS]


@pytest.fixture(scope="module")
def single() -> list[str]:
    with running_server(build_app(tiny_engine(max_model_len=512), served_model_name=SERVED_NAME)) as base_url:
        return answers(base_url)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 420.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s:g} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def env_without_torchrun() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONPATH": os.pathsep.join(sys.path)}


def test_serve_with_data_parallel_size_answers_as_one_instance(single):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", *SERVE, "--port", str(port)],
                            env=env_without_torchrun(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        assert answers(url) == single
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        stop([proc])
    assert proc.returncode == 0 or proc.returncode == -15, proc.stderr.read()[-3000:]
    assert "deepinfer_" in metrics


def test_torchrun_serve_over_two_machines_of_one_rank_each(single):
    port, master = free_port(), free_port()
    procs = []
    for node in (0, 1):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                  "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master)]
        procs.append(subprocess.Popen([*launch, "-m", "deepinfer_core.cli", *SERVE, "--port", str(port)],
                                      env=env_without_torchrun(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(procs[0], url)
        assert answers(url) == single
        assert procs[1].poll() is None  # machine 1's rank runs its engine core beside rank 0's front end
    finally:
        stop(procs)
