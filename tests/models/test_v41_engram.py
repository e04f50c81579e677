"""Engram: prime rule, pinned multipliers, the 99,092-id token map, hashes, lookup placements, gate."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer

from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.engram import (
    DEAD,
    EngramHasher,
    EngramTable,
    build_token_map,
    draw_multipliers,
    engram_gate,
    engram_primes,
)
from deepinfer_core.models.v41_tiny import tiny_v41_config, v41_tokenizer_json
from tests.models.test_v41_config import RELEASE


def test_the_prime_rule_gives_the_released_table_rows():
    primes = engram_primes(2, 3, 8, 16_000_000)
    assert [sum(sum(order) for order in layer) for layer in primes] == [384006168, 384016682]
    assert primes[0][0][0] == 16000057 and primes[1][2][7] == 16000889
    flat = [p for layer in primes for order in layer for p in order]
    assert len(set(flat)) == 48 and flat == sorted(flat)  # never reused, across both layers


def test_numpy_still_draws_the_pinned_multipliers():
    assert draw_multipliers(1, 4, 99092) == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert draw_multipliers(14, 4, 99092) == (67716810739261, 51510806800915, 30921347202721, 82619226485591)
    assert all(m % 2 == 1 and m * 99092 < 2**63 for m in draw_multipliers(14, 4, 99092))


def test_the_v41_tokenizer_compresses_to_99092_ids():
    document = json.loads(v41_tokenizer_json())
    added = {t["id"]: t for t in document["added_tokens"]}
    assert added[128799]["content"] == "<｜System｜>" and not added[128799]["special"]
    assert added[129264]["content"] == "<｜deepseek_image｜>"
    token_map, count = build_token_map(Tokenizer.from_str(json.dumps(document)))
    assert count == 99092 and len(token_map) == 129280
    assert max(token_map) == count - 1 and token_map[0] == 0  # numbered by first appearance
    tokenizer = Tokenizer.from_str(json.dumps(document))
    # " The", "the" and "THE" normalise alike; a lone space stays a space, distinct from the empty key
    ids = [tokenizer.token_to_id(t) for t in ("the", "ĠThe", "THE")]
    assert None not in ids and len({token_map[i] for i in ids}) == 1


def release_hasher() -> EngramHasher:
    config = V41Config.from_dict(RELEASE)
    token_map = [i % 99092 for i in range(129280)]  # any map with the release's 99,092 ids
    return EngramHasher(config, token_map)


def test_a_hash_equals_the_rule_computed_by_hand():
    hasher = release_hasher()
    ids = [5, 77, 1234, 99091]  # c_p, c_{p-1}, c_{p-2}, c_{p-3}
    got = hasher.hashes(torch.tensor([ids]))[0]
    primes = engram_primes(2, 3, 8, 16_000_000)
    for slot, layer in enumerate((1, 14)):
        m = draw_multipliers(layer, 4, 99092)
        rolling, offset, column = ids[0] * m[0], 0, 0
        for order in range(2, 5):
            rolling ^= ids[order - 1] * m[order - 1]
            for head in range(8):
                prime = primes[slot][order - 2][head]
                assert got[slot, column].item() == rolling % prime + offset
                offset, column = offset + prime, column + 1


def test_positions_before_the_start_and_at_or_behind_a_dead_one_use_the_pad():
    hasher = release_hasher()
    pad = hasher.pad_id
    got = hasher.hashes(torch.tensor([[5, 7, -2, -2], [5, 7, DEAD, 9], [5, 7, pad, pad], [5, DEAD, 3, 4], [5, pad, pad, pad]]))
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2])  # before the start / dead block look-back
    assert torch.equal(got[3], got[4])  # a dead step blocks every earlier one too


def test_the_hasher_refuses_a_tokenizer_of_other_weights():
    config = V41Config.from_dict(RELEASE)
    try:
        EngramHasher(config, [i % 1000 for i in range(129280)])
    except ValueError as err:
        assert "1000 ids" in str(err) and "99092" in str(err)
    else:
        raise AssertionError("a 1000-id map was accepted")


def test_host_and_device_tables_give_the_same_rows():
    weight = torch.randn(50, 64).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = torch.tensor([[127, 128]] * 50, dtype=torch.uint8)  # 2**0 and 2**1
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    device = EngramTable(weight, scale, torch.device("cpu"), "device").lookup(ids)
    host = EngramTable(weight, scale, torch.device("cpu"), "host").lookup(ids)
    assert torch.equal(device, host) and device.shape == (2, 3, 64) and device.dtype == torch.bfloat16
    expected = weight[3].view(torch.float8_e4m3fn).float() * torch.tensor([1.0] * 32 + [2.0] * 32)
    assert torch.equal(device[0, 0].float(), expected)


def test_the_gate_is_the_signed_sqrt_sigmoid_of_the_normalised_match():
    torch.manual_seed(0)
    streams, kv, weight = torch.randn(3, 2, 8), torch.randn(3, 3 * 8), torch.rand(2, 8) + 0.5
    out = engram_gate(streams, kv, weight, 1e-20, keep=torch.tensor([True, True, False]))
    key, value = kv[:, :16].view(3, 2, 8), kv[:, 16:]
    for t in range(2):
        for s in range(2):
            x, k = streams[t, s], key[t, s]
            d = (x * weight[s] * k).sum() / x.square().mean().sqrt() / k.square().mean().sqrt() / 8**0.5
            g = torch.sigmoid(torch.sign(d) * d.abs().clamp(min=1e-6).sqrt())
            assert torch.allclose(out[t, s], x + g * value[t], atol=1e-6)
    assert torch.equal(out[2], streams[2])  # an image position's gate is shut


def test_the_tiny_config_obeys_the_prime_rule():
    config = V41Config.from_dict(tiny_v41_config())
    primes = engram_primes(2, 3, config.engram_n_heads, config.engram_vocab_size)
    assert config.engram_num_embeddings == [sum(sum(o) for o in layer) for layer in primes]
