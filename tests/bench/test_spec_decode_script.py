"""`bench/spec_decode.py --tiny` runs every case on the CPU and its runs keep the greedy tokens."""

from __future__ import annotations

from tests.bench.test_cpu_scripts import run_script


def test_spec_decode_tiny_reports_every_case_with_unchanged_tokens():
    rows = run_script("bench/spec_decode.py", "--tiny", "--layers", "2", "--batches", "1", "--ks", "2",
                      "--new-tokens", "4", "--profile", "1", "--mtp")
    cases = [row["case"] for row in rows if "case" in row]
    assert cases == ["none", "oracle", "always_wrong", "always_wrong", "ngram_agent_trace", "ngram_agent_trace",
                     "mtp_echo"]
    [mtp] = [row for row in rows if row.get("case") == "mtp_echo"]
    # the echo model's MTP layer drafts what the target emits: the one verify step (3 tokens left after the
    # prefill's) accepts its 2 drafts
    assert (mtp["request_verify_steps"], mtp["mean_acceptance_length"]) == (1, 3.0)
    ngram = [row for row in rows if row.get("case") == "ngram_agent_trace"]
    assert [row["policy"] for row in ngram] == ["fixed", "confidence"]
    assert ngram[0]["overlapped_steps"] == 0  # fixed k: every step waits for its tokens to look drafts up
    assert all(row["tokens_equal"] for row in rows if "tokens_equal" in row)
    assert [row["profile"] for row in rows if "profile" in row] == ["none", "oracle_k3"]
    oracle = [row for row in rows if row.get("case") == "oracle"]
    assert [row["k"] for row in oracle] == [2] and all(row["allowed_speedup"] > 1 for row in oracle)


def test_a_divergence_is_reported_with_its_step_and_reference_logprob_gap(tmp_path, monkeypatch):
    from pathlib import Path

    from deepinfer_core import SamplingParams
    from deepinfer_core.testing.serving import serve
    from tests.engine.test_spec_decode import MIXED, make_engine

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import spec_decode

    engine, batch = make_engine(tmp_path), MIXED[:2]
    done = serve(engine, batch, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
    reference = [list(out.outputs[0].token_ids) for out in done]
    assert spec_decode.compare(engine, batch, reference, [list(r) for r in reference]) == {"tokens_equal": True}
    entry = done[1].outputs[0].logprobs[3]  # the top token and one more: swap in the runner-up at step 3
    runner_up = next(t for t, lp in entry.items() if lp.rank == 2)
    out = [list(r) for r in reference]
    out[1][3:] = [runner_up] * 3
    row = spec_decode.compare(engine, batch, reference, out)
    gap = entry[reference[1][3]].logprob - entry[runner_up].logprob
    assert row["tokens_equal"] is False and row["first_divergence"]["rerun_equals_reference"]
    assert (row["first_divergence"]["request"], row["first_divergence"]["step"]) == (1, 3)
    assert abs(row["first_divergence"]["reference_logprob_gap"] - gap) < 1e-4 and gap > 0
