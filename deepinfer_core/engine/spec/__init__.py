"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

- `config.SpeculativeConfig`: what the user asks for (`LLM(speculative_config={...})`).
- `ngram`: prompt-lookup drafting over a request's prompt and output.
- `policy`: how many drafts each request sends to the target this step (fixed k, or confidence-scheduled).
- `verify`: the runner's side of a verification step (logits rows, the seeded-draw acceptance rule,
  rejection sampling through the `VerifyBackend`).
- `rollback`: rejected drafts leave no trace in the per-request rings and the compressed pools.
- `proposer`: the engine's side (drafts per sequence, acceptance statistics, metrics).

docs: a draft is accepted exactly when it equals the token the target itself draws at that position
(greedy: its argmax; sampled: its seeded Gumbel-max draw), so the output is token for token the output
without speculation, whatever the drafter proposed or the policy chose to verify.
"""
