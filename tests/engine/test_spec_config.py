"""How a user asks for speculation: `LLM(speculative_config=...)`, `deepinfer serve --speculative-config`,
and what `/metrics` reports of it."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.entrypoints.metrics import ServerMetrics
from deepinfer_core.entrypoints.serve_cli import add_serve_parser, engine_config_of
from deepinfer_core.models.tiny import embedded_tiny_model_dir


def served_config(speculative_config: str):
    """The EngineConfig `deepinfer serve --speculative-config SPECULATIVE_CONFIG` builds."""
    parser = argparse.ArgumentParser(prog="deepinfer")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--speculative-config", speculative_config])
    return engine_config_of(args, str(embedded_tiny_model_dir()))


def test_serve_flag_reaches_the_engine_config():
    config = served_config('{"method": "ngram", "num_speculative_tokens": 3}')
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


def v41_config(**text):
    from deepinfer_core.models.deepseek_v41.config import V41Config
    from deepinfer_core.models.v41_tiny import tiny_v41_config

    config = tiny_v41_config()
    return V41Config.from_dict({**config, "text_config": {**config["text_config"], **text}})


def resolve(model_config, spec):
    return EngineConfig(model=str(embedded_tiny_model_dir()), speculative_config=spec).resolve(model_config)


def test_dspark_takes_one_draft_per_block_slot_on_v41():
    config = v41_config()  # dspark_block_size 5: the anchor and 4 noise tokens, each slot drafting one token
    spec = resolve(config, {"method": "dspark", "num_speculative_tokens": 5}).speculative_config
    assert spec.method == "dspark" and spec.draft_length_policy == "confidence"
    with pytest.raises(ConfigError, match="num_speculative_tokens <= 5"):
        resolve(config, {"method": "dspark", "num_speculative_tokens": 6})
    with pytest.raises(ConfigError, match=r"mtp\.\*` slot .* holds DSpark.*use method 'dspark'"):
        resolve(config, {"method": "mtp", "num_speculative_tokens": 1})
    assert resolve(config, {"method": "ngram", "num_speculative_tokens": 4}).speculative_config.method == "ngram"


def test_dspark_needs_a_checkpoint_that_carries_it():
    from deepinfer_core.config import ModelConfig

    bare = v41_config(num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1])
    with pytest.raises(ConfigError, match="carries no such drafter.*DSpark weights"):
        resolve(bare, {"method": "dspark", "num_speculative_tokens": 1})
    v4 = ModelConfig.from_dir(embedded_tiny_model_dir())
    with pytest.raises(ConfigError, match="deepseek_v4 carries no such drafter"):
        resolve(v4, {"method": "dspark", "num_speculative_tokens": 1})


def test_dspark_reaches_the_engine_through_serve_and_drafts_from_stored_raw_confidences():
    from deepinfer_core.speculative.proposer import Speculator, StoredDrafter

    config = served_config('{"method": "dspark", "num_speculative_tokens": 5}')
    assert config.speculative_config == SpeculativeConfig(method="dspark", num_speculative_tokens=5)
    drafter = Speculator.from_config(config.speculative_config).drafter
    assert isinstance(drafter, StoredDrafter) and drafter.has_raw_confidences and drafter.is_pausable
    mtp = Speculator.from_config(SpeculativeConfig(method="mtp", num_speculative_tokens=1)).drafter
    assert not mtp.has_raw_confidences and not mtp.is_pausable


def test_metrics_report_per_slot_rates_and_raw_and_calibrated_confidences_and_dp_ranks_merge_them():
    from deepinfer_core.engine.data_parallel import merge_stats
    from deepinfer_core.outputs import SpecDecodeMetrics

    one, two = SpecDecodeMetrics(), SpecDecodeMetrics()
    one.record(3, 3, 1, [0.5, -1.0, 2.0], [0.6, 0.3, 0.9])
    two.record(2, 2, 2, [1.5, -3.0])  # no calibrated probabilities
    stats = merge_stats([one.to_stats(), two.to_stats()])
    assert stats["spec_acceptance_rate_per_slot"] == [1.0, 0.5, 0.0]
    assert stats["spec_mean_confidence_per_slot"] == [1.0, -2.0, 2.0]
    assert stats["spec_mean_calibrated_confidence_per_slot"] == [0.6, 0.3, 0.9]
    assert stats["spec_mean_acceptance_length"] == (3 + 2) / 2
    text = ServerMetrics().render(stats)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['deepinfer_spec_decode_acceptance_rate{slot="1"}'] == "0.5"
    assert samples['deepinfer_spec_decode_mean_confidence{slot="1"}'] == "-2.0"
    assert samples['deepinfer_spec_decode_mean_calibrated_confidence{slot="2"}'] == "0.9"
    assert samples['deepinfer_spec_decode_num_verified_per_slot_total{slot="2"}'] == "1"
    ngram = SpecDecodeMetrics()
    ngram.record(2, 2, 1)  # a drafter without confidences: no confidence lines
    assert "mean_confidence" not in ServerMetrics().render(ngram.to_stats())
