"""The padded static-buffer decode step that CUDA graphs capture, run eagerly on the CPU."""

from __future__ import annotations

import torch

from deepinfer_core.engine.cuda_graph import DecodeGraphs, batch_ladder
from tests.oracle import FakeSeq, all_position_logprobs, make_runner, parity_config, random_state_dict

CONFIG = parity_config("sliding_csa_hca")
WEIGHTS = random_state_dict(CONFIG, seed=5)


def test_batch_ladder_covers_every_size():
    for max_batch in (1, 3, 16, 40, 256):
        ladder = batch_ladder(max_batch)
        assert ladder[-1] == max_batch and ladder == sorted(set(ladder))
        assert all(any(size >= n for size in ladder) for n in range(1, max_batch + 1))


def test_padded_decode_equals_plain_decode(tmp_path):
    plain, padded = make_runner(tmp_path, CONFIG, WEIGHTS), make_runner(tmp_path, CONFIG, WEIGHTS)
    graphs = DecodeGraphs(padded, max_batch=6, max_blocks=4, max_seq_len=512)
    prompts = [list(range(2, 2 + n)) for n in (3, 15, 16, 70)]  # windows close at different steps
    pairs = []
    for runner in (plain, padded):
        seqs = [FakeSeq(list(p), slot=i, block_table=[i]) for i, p in enumerate(prompts)]
        all_position_logprobs(runner, seqs, [len(p) for p in prompts])
        pairs.append(seqs)
    for step in range(20):  # crosses CSA (4) and HCA (16) window closes for every request
        token = 5 + step
        for seqs in pairs:
            for s in seqs:
                s.token_ids.append(token)
        expected = torch.cat(all_position_logprobs(plain, pairs[0], [1] * 4))
        seqs = pairs[1]
        tables = torch.tensor([s.block_table + [0] * 3 for s in seqs])
        logits = graphs.run([s.token_ids[-1] for s in seqs], [s.num_computed_tokens for s in seqs],
                            [s.slot for s in seqs], tables, [0] * 4, [0] * 4)
        for s in seqs:
            s.num_computed_tokens += 1
        assert logits.shape[0] == 4  # padded to a ladder size of 4 here, padding rows dropped
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-5, step
    for a, b in zip(plain.kv_cache.layers, padded.kv_cache.layers):
        assert torch.equal(a.window[:4], b.window[:4])
        if a.compressed is not None:  # real blocks only: the scratch block and row may differ
            rows = 4 * (a.compressed.shape[0] - 1) // (plain.num_blocks + 1)
            assert torch.allclose(a.compressed[:rows], b.compressed[:rows], atol=1e-6)
