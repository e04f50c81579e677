"""`deepinfer-ascend950 doctor` (or `python -m deepinfer_ascend950.check`): the first run on an Ascend 950.

Runs, on the NPU, every check that only the chip can answer and prints one line per check: the
environment (torch, torch_npu, SoC, cann_ops_transformer), which backend each factory hook builds for
DeepSeek-V4-Flash-shaped specs (the plugin's op path, or the reference with the decline reason), the
core's conformance suite for each plugin backend, attention again with block ids that exclude 0 (so
every call takes `sparse_flash_mla`), whether the chip accepts block id 0 (informational), whether
seeded draws stay on the device, an `NPUGraph` capture and replay, and the whole embedded tiny model's
greedy tokens against the CPU reference (naming the backends it ran on). Exit status 0 when every check
passed, 1 otherwise, 2 when there is no usable NPU.

`run_checks` takes the device and the two modules, so the same code runs in the plugin's CPU tests
over test doubles (which proves the plumbing of the doctor, not the chip).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec, SamplingSpec
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import AttentionCase, random_attention_case
from deepinfer_core.testing.compare import assert_close, tolerances

ATTENTION_SPECS = {  # V4-Flash's head_dim and window; fewer heads and a small top-k keep the run short
    "swa": AttentionSpec(num_heads=8, head_dim=512, sliding_window=128, compress_rate=0, dtype=torch.bfloat16),
    "hca": AttentionSpec(num_heads=8, head_dim=512, sliding_window=128, compress_rate=128, dtype=torch.bfloat16),
    "csa": AttentionSpec(num_heads=8, head_dim=512, sliding_window=128, compress_rate=4, index_n_heads=8,
                         index_head_dim=128, index_topk=32, dtype=torch.bfloat16),
}
MOE_SPEC = MoESpec(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=10.0, dtype=torch.bfloat16)
LAYER_OPS_SPEC = LayerOpsSpec(hidden_size=256, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                              dtype=torch.bfloat16)
CPU = torch.device("cpu")


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    informational: bool = False
    """Answers a question for the next step (e.g. may the block-0 fallback go); never fails the run."""

    @property
    def status(self) -> str:
        if self.informational:
            return "YES " if self.passed else "NO  "
        return "PASS" if self.passed else "FAIL"


def without_block_zero(case: AttentionCase, spec: AttentionSpec) -> AttentionCase:
    """`case` with every block id one higher over pools grown by one leading (NaN) block, so no table
    holds block 0 -- what the engine gives once it reserves block 0."""
    meta = case.metadata
    moved = dataclasses.replace(case, metadata=dataclasses.replace(
        meta, block_tables=torch.where(meta.block_tables >= 0, meta.block_tables + 1, -1)))
    for name in ("compressed", "index_keys"):
        pool = getattr(case, name)
        if pool is not None:
            lead = torch.full((spec.entries_per_block, pool.shape[1]), float("nan"))
            setattr(moved, name, torch.cat((lead, pool)))
    return moved


def check_attention_on_op_path(backend, device: torch.device, seed: int = 5) -> str:
    """Every conformance scenario with positive block ids; raises `AssertionError` unless each call took
    `sparse_flash_mla` and matched the reference. Returns the path counts."""
    from deepinfer_core.reference.attention import ReferenceAttention

    spec = backend.spec
    reference = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), CPU)
    before = dict(backend.path_counts)
    scenarios = conformance.attention_scenarios(spec)
    for scenario, (lens, starts) in scenarios.items():
        case = without_block_zero(random_attention_case(spec, lens, starts, seed=seed), spec)
        c, r = case.to(device, spec.dtype), conformance._rounded_case(case, spec.dtype)
        got = backend.forward(c.q, c.kv, c.window, c.compressed, c.sinks, c.metadata, c.topk_indices, c.num_entries)
        want = reference.forward(r.q, r.kv, r.window, r.compressed, r.sinks, r.metadata, r.topk_indices,
                                 r.num_entries)
        assert_close(got, want, *tolerances(spec.dtype), f"attention {scenario}, {spec}")
        if spec.is_sparse:
            conformance.check_indexer_selection(backend, c, r, *tolerances(spec.dtype), scenario)
    primary = backend.path_counts["sparse_flash_mla"] - before["sparse_flash_mla"]
    if primary != len(scenarios):
        raise AssertionError(f"only {primary} of {len(scenarios)} calls took sparse_flash_mla")
    return f"{primary}/{len(scenarios)} calls on sparse_flash_mla"


def check_block_zero_accepted(backend, device: torch.device) -> str:
    """Call the op directly on an HCA step whose block tables hold block 0 (bypassing the fallback)."""
    spec = backend.spec
    case = random_attention_case(spec, [1, 1], [260, 300], seed=11)
    case.metadata.block_tables[0, 0] = 0
    case.compressed[: spec.entries_per_block] = torch.randn(spec.entries_per_block, spec.head_dim)
    c, r = case.to(device, spec.dtype), conformance._rounded_case(case, spec.dtype)
    backend.needs_fallback = lambda metadata, has_cmp: False  # this instance only
    backend.sends_block_zero = True
    got = backend.forward(c.q, c.kv, c.window, c.compressed, c.sinks, c.metadata, None, c.num_entries)
    from deepinfer_core.reference.attention import ReferenceAttention

    want = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), CPU).forward(
        r.q, r.kv, r.window, r.compressed, r.sinks, r.metadata, None, r.num_entries)
    assert_close(got, want, *tolerances(spec.dtype), "sparse_flash_mla with block id 0")
    return "the op gave the reference's output with block id 0: the block-0 fallback could be dropped"


def check_graph_capture(torch_npu: ModuleType, device: torch.device) -> str:
    from deepinfer_ascend950.graphs import capture, npu_graph_api

    api = npu_graph_api(torch_npu)
    x = torch.randn(8, 8, device=device)
    weight = torch.randn(8, 8, device=device)
    graph, out = capture(api, lambda: x @ weight)
    x.copy_(torch.randn(8, 8, device=device))
    graph.replay()
    api.synchronize()
    torch.testing.assert_close(out.cpu(), (x @ weight).cpu())
    return "NPUGraph captured a matmul and replayed it on new input"


def check_model_parity(device: torch.device, num_tokens: int = 8) -> str:
    """The embedded tiny V4 model (head_dim 512, all three attention kinds) on `device` through whatever
    the plugins build there, against the reference engine on the CPU: greedy tokens must be equal. The
    detail names the backends and whether decode ran as graphs, so a fallback is visible."""
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.models.tiny import embedded_tiny_model_dir

    prompts = [[5 + i, 17, 230 + 3 * i, 99] * (3 + 20 * i) for i in range(4)]  # 12 to 252 tokens
    outputs = {}
    for where in (CPU, device):
        engine = Engine(EngineConfig(model=str(embedded_tiny_model_dir()), device=str(where), dtype="float16",
                                     max_model_len=512, max_num_seqs=4, num_kv_blocks=16))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        outputs[where.type] = done
        runner = engine.runner
    backends = sorted({type(b).__name__ for b in runner.model.backends()})
    diverged = [i for i in outputs["cpu"] if outputs["cpu"][i] != outputs[device.type][i]]
    if diverged:
        raise AssertionError(f"greedy tokens differ from the CPU reference for requests {diverged}; "
                             f"backends {backends}")
    graphs = runner.graphs.sizes if runner.graphs is not None else "eager"
    return f"{len(prompts)} requests x {num_tokens} tokens equal; backends {backends}; decode graphs {graphs}"


def run_checks(device: torch.device, torch_npu: ModuleType, cann_ops: ModuleType | None,
               graphs: bool = True, parity: bool = True) -> list[CheckResult]:
    """Every check, in order; a failing check is recorded with its error and the rest still run."""
    from deepinfer_ascend950.attention import AscendAttention
    from deepinfer_ascend950.layer_ops import AscendLayerOps
    from deepinfer_ascend950.moe import AscendMoE
    from deepinfer_ascend950.sampling import AscendSampler

    results: list[CheckResult] = []

    def run(name: str, check: Callable[[], str | None], informational: bool = False) -> None:
        try:
            results.append(CheckResult(name, True, check() or "", informational))
        except Exception as err:  # noqa: BLE001 -- the report lists every failure
            detail = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            results.append(CheckResult(name, False, detail, informational))
            if not informational:
                traceback.print_exc(file=sys.stderr)

    for name, spec in ATTENTION_SPECS.items():
        if cann_ops is None:
            results.append(CheckResult(f"attention {name}", False, "cann_ops_transformer not importable"))
            continue
        backend = AscendAttention(spec, device, cann_ops)
        run(f"attention {name}: conformance suite",
            lambda b=backend: conformance.check_attention(b, device) or f"paths {b.path_counts}")
        run(f"attention {name}: every call on sparse_flash_mla", lambda b=backend: check_attention_on_op_path(b, device))
        if spec.compress_rate == 128:
            run("attention hca: does the op accept block id 0?",
                lambda s=spec: check_block_zero_accepted(AscendAttention(s, device, cann_ops), device), True)
    for scoring, is_hash in (("sqrtsoftplus", False), ("sqrtsoftplus", True), ("sigmoid", False)):
        spec = dataclasses.replace(MOE_SPEC, scoring_func=scoring, is_hash=is_hash)
        run(f"moe {scoring}{' hash' if is_hash else ''}: conformance suite",
            lambda s=spec: conformance.check_moe(AscendMoE(s, device, torch_npu), device))
    run("layer ops: conformance suite", lambda: conformance.check_layer_ops(AscendLayerOps(LAYER_OPS_SPEC, torch_npu),
                                                                            device))
    sampler = AscendSampler(SamplingSpec(vocab_size=4096), device)
    run("sampler: conformance suite", lambda: conformance.check_sampler(sampler, device))
    run("sampler: do seeded draws stay on the device?",
        lambda: None if sampler.draws_on_device else sampler.host_draw_reason(), True)
    if graphs:
        run("decode graphs: NPUGraph capture and replay", lambda: check_graph_capture(torch_npu, device))
    if parity:
        run("whole model: greedy tokens equal the CPU reference", lambda: check_model_parity(device))
    return results


def format_report(header: list[str], results: list[CheckResult]) -> str:
    width = max(len(r.name) for r in results) if results else 0
    lines = [*header, ""]
    lines += [f"{r.status}  {r.name:<{width}}  {r.detail}" for r in results]
    checks = [r for r in results if not r.informational]
    failed = sum(not r.passed for r in checks)
    lines += ["", f"{len(checks) - failed} passed, {failed} failed"]
    return "\n".join(lines)


def environment(torch_npu: ModuleType | None) -> list[str]:
    from deepinfer_ascend950.platform import cann_problem

    lines = [f"torch {torch.__version__}"]
    if torch_npu is not None:
        lines.append(f"torch_npu {getattr(torch_npu, '__version__', '?')}, SoC {torch_npu.npu.get_soc_version()}")
    lines.append(f"cann_ops_transformer: {cann_problem() or 'importable'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer-ascend950", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="doctor", choices=["doctor"])
    parser.add_argument("--no-graphs", action="store_true", help="skip the NPUGraph capture check")
    parser.add_argument("--no-parity", action="store_true", help="skip the whole-model parity run")
    args = parser.parse_args(argv)
    from deepinfer_ascend950.platform import (
        AscendUnavailableError,
        load_cann_ops,
        load_torch_npu,
        npu_problem,
    )

    problem = npu_problem()
    if problem is not None:
        print(f"no usable Ascend 950: {problem}")
        return 2
    torch_npu = load_torch_npu()
    try:
        cann_ops = load_cann_ops()
    except AscendUnavailableError:
        cann_ops = None
    device = torch.device("npu", torch_npu.npu.current_device() if hasattr(torch_npu.npu, "current_device") else 0)
    results = run_checks(device, torch_npu, cann_ops, graphs=not args.no_graphs, parity=not args.no_parity)
    print(format_report(environment(torch_npu), results))
    return 0 if all(r.passed or r.informational for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
