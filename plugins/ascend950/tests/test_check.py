"""The doctor's plumbing over the op doubles (on the CPU: this proves the report, not the chip)."""

from __future__ import annotations

import types

import pytest
import torch
from deepinfer_ascend950 import check
from deepinfer_ascend950.graphs import capture, npu_graph_api

CPU = torch.device("cpu")


def test_every_check_passes_over_the_doubles(doubles):
    results = check.run_checks(CPU, doubles.torch_npu_module(), doubles.cann_ops_module(), graphs=False, parity=False)
    assert [(r.name, r.detail) for r in results if not r.passed and not r.informational] == []
    by_name = {r.name: r for r in results}
    assert by_name["attention hca: every call on sparse_flash_mla"].detail == "3/3 calls on sparse_flash_mla"
    assert by_name["attention csa: every call on sparse_flash_mla"].detail == "4/4 calls on sparse_flash_mla"
    refused = by_name["attention hca: does the op accept block id 0?"]  # the doubles follow the doc: no
    assert not refused.passed and "positive integers" in refused.detail
    assert by_name["sampler: do seeded draws stay on the device?"].passed  # the CPU is the reference
    report = check.format_report(["header"], results)
    assert "NO    attention hca: does the op accept block id 0?" in report
    assert report.endswith(f"{sum(not r.informational for r in results)} passed, 0 failed")


def test_a_broken_op_is_reported_not_raised(doubles):
    broken = doubles.cann_ops_module()
    broken.sparse_flash_mla = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("EZ9999 aicore error"))
    results = check.run_checks(CPU, doubles.torch_npu_module(), broken, graphs=False, parity=False)
    failed = {r.name: r.detail for r in results if not r.passed}
    assert failed["attention swa: conformance suite"] == "RuntimeError: EZ9999 aicore error"
    assert "moe sqrtsoftplus: conformance suite" not in failed


def test_without_an_npu_the_doctor_says_so(capsys):
    assert check.main([]) == 2
    assert capsys.readouterr().out.startswith("no usable Ascend 950: torch_npu is not importable")


def test_graph_api_names_what_torch_npu_lacks():
    with pytest.raises(AttributeError, match="torch_npu.npu has no NPUGraph, graph"):
        npu_graph_api(types.SimpleNamespace(npu=types.SimpleNamespace(Stream=object, stream=object,
                                                                      current_stream=object, synchronize=object)))


def test_capture_warms_up_on_a_side_stream_then_records_once():
    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("wait")

    class Graph:
        pass

    class Context:
        def __init__(self, label):
            self.label = label

        def __enter__(self):
            calls.append(f"enter {self.label}")

        def __exit__(self, *exc):
            calls.append(f"exit {self.label}")

    api = types.SimpleNamespace(Graph=Graph, Stream=Stream, stream=lambda s: Context("stream"),
                                graph=lambda g, pool=None: Context("graph"), current_stream=Stream,
                                synchronize=lambda: None)
    graph, _ = capture(api, lambda: calls.append("forward") or len(calls))
    assert isinstance(graph, Graph)
    assert calls == ["wait", "enter stream", "forward", "forward", "exit stream", "wait", "enter graph", "forward",
                     "exit graph"]


def test_model_parity_compares_greedy_tokens_and_names_the_backends():
    detail = check.check_model_parity(CPU, num_tokens=3)  # CPU against CPU: the plumbing, not the chip
    assert detail.startswith("4 requests x 3 tokens equal; backends [") and "ReferenceAttention" in detail
    assert detail.endswith("decode graphs eager")
