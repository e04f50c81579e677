"""How a user asks for speculation: `LLM(speculative_config=...)`, `deepinfer serve --speculative-config`,
and what `/metrics` reports of it."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from deepinfer_core.config import EngineConfig
from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.entrypoints.metrics import ServerMetrics
from deepinfer_core.entrypoints.serve_cli import add_serve_parser, engine_config_of
from deepinfer_core.models.tiny import embedded_tiny_model_dir


def test_serve_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser(prog="deepinfer")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = engine_config_of(args, str(embedded_tiny_model_dir()))
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_llm_rejects_a_bad_speculative_config_before_loading():
    from deepinfer_core import LLM

    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        LLM(str(embedded_tiny_model_dir()), speculative_config={"method": "mtp", "num_speculative_tokens": -1})
    config = EngineConfig(model=str(embedded_tiny_model_dir()), speculative_config={"method": "mtp",
                                                                                     "num_speculative_tokens": 1})
    assert config.speculative_config.method == "mtp" and config.speculative_config.draft_length_policy == "confidence"


def test_metrics_report_drafts_acceptance_and_its_histogram():
    stats = {"spec_drafted_tokens": 9, "spec_verified_tokens": 6, "spec_accepted_tokens": 4, "spec_verify_steps": 3,
             "spec_mean_acceptance_length": 7 / 3, "spec_acceptance_histogram": [1, 0, 2]}
    text = ServerMetrics().render(stats)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples["deepinfer_spec_decode_num_accepted_tokens_total"] == "4"
    assert samples["deepinfer_spec_decode_num_verified_tokens_total"] == "6"
    assert samples['deepinfer_spec_decode_accepted_per_step_bucket{le="1"}'] == "1"
    assert samples['deepinfer_spec_decode_accepted_per_step_bucket{le="2"}'] == "3"
    assert samples["deepinfer_spec_decode_accepted_per_step_sum"] == "4"
    assert "spec_decode" not in ServerMetrics().render({})
