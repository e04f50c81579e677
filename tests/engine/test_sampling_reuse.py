"""The runner reuses a step's sampling tensors for the next step of the same rows, sending only `steps`,
unless some row's tensors follow its history (penalties, banned ids)."""

from __future__ import annotations

import itertools

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.engine.engine import Engine
from tests.engine.test_spec_decode import CONFIG, VOCAB
from tests.engine.test_spec_decode import make_engine as spec_decode_engine

PROMPTS = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 6)]


def make_engine(path, spec=None) -> Engine:
    return spec_decode_engine(path, spec, num_kv_blocks=8)


def serve_recording(engine: Engine, params: list[SamplingParams], late: int | None = None):
    """Serve `PROMPTS` (the one at index `late` added after two steps); per step, the sampler's tensors;
    per request, its tokens."""
    seen, sample = [], engine.runner.sampler.sample
    engine.runner.sampler.sample = lambda logits, tensors: seen.append(tensors) or sample(logits, tensors)
    for i, p in enumerate(params):
        if i != late:
            engine.add_request(str(i), PROMPTS[i], p)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        steps += 1
        if steps == 2 and late is not None:
            engine.add_request(str(late), PROMPTS[late], params[late])
    return seen, done


def test_decode_steps_of_the_same_rows_share_tensors_but_steps(tmp_path):
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=4, max_tokens=8, ignore_eos=True)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    seen, done = serve_recording(make_engine(tmp_path / "a"), params, late=2)
    shared = [a.temperature is b.temperature for a, b in itertools.pairwise(seen)]
    # a row's seed names its request: reused exactly while the rows are the same requests in order (the
    # prefill's sampled rows and the decodes after it; not when the third joins or the first two end)
    same_rows = [a.seeds.tolist() == b.seeds.tolist() for a, b in itertools.pairwise(seen)]
    assert shared == same_rows and shared.count(False) == 2 and shared.count(True) >= 6
    for a, b in itertools.pairwise(seen):
        if a.temperature is b.temperature:
            assert torch.equal(b.steps, a.steps + 1)  # one more token each, sent fresh
    # the same tokens as a runner that rebuilds every step
    engine = make_engine(tmp_path / "b")
    rebuild = engine.runner._sampling_tensors

    def fresh(*args):
        engine.runner._kept_sampling = None
        return rebuild(*args)
    engine.runner._sampling_tensors = fresh
    again, expected = serve_recording(engine, params, late=2)
    assert done == expected and not any(a.temperature is b.temperature for a, b in itertools.pairwise(again))


def test_rows_whose_tensors_follow_their_history_are_rebuilt_every_step(tmp_path):
    """Penalties read the tokens so far, and `min_tokens` bans EOS until it is reached: those steps are
    rebuilt; once the ban is lifted, the rows' tensors are reused again."""
    eos = CONFIG.get("eos_token_id", 1)
    for i, p in enumerate([SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True,
                                          presence_penalty=0.5),
                           SamplingParams(temperature=0, max_tokens=8, min_tokens=4)]):
        (tmp_path / str(i)).mkdir()
        seen, _ = serve_recording(make_engine(tmp_path / str(i)), [p])
        shared = [a.temperature is b.temperature for a, b in itertools.pairwise(seen)]
        if p.presence_penalty:
            assert len(seen) == 6 and not any(shared)
        else:
            assert all(t.banned_token_ids for t in seen[:4]) and not any(shared[:3])  # EOS banned: rebuilt
            assert eos in seen[0].banned_token_ids[0]
            assert all(t.banned_token_ids is None for t in seen[4:]) and all(shared[4:])


class VaryingDrafter:
    """Proposes 2 copies of the last token for three output tokens, then 1 for three, and so on (mostly
    rejected: a token a step): requests out of phase give verify rows of one length in other layouts."""

    def propose(self, seq, max_drafts):
        return [seq.token_ids[-1]] * min(max_drafts, 2 - (seq.num_output_tokens // 3) % 2), None


def test_verify_rows_are_rebuilt_whenever_their_layout_changes(tmp_path):
    engine = make_engine(tmp_path, {"method": "ngram", "num_speculative_tokens": 2})
    engine.speculator.drafter = VaryingDrafter()
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2, 3)]
    seen, _ = serve_recording(engine, params, late=2)
    shared = [a.temperature is b.temperature for a, b in itertools.pairwise(seen)]
    same_rows = [a.seeds.tolist() == b.seeds.tolist() for a, b in itertools.pairwise(seen)]
    assert shared == same_rows and True in shared
    layouts = [tuple(t.seeds.tolist()) for t in seen]
    assert any(len(a) == len(b) and a != b for a, b in itertools.pairwise(layouts))  # same length, other rows
