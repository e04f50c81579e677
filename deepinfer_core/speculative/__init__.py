"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

- `config.SpeculativeConfig`: what the user asks for (`LLM(speculative_config={...})`).
- `ngram`: prompt-lookup drafting over a request's prompt and output.
- `mtp_drafter`: drafting with the checkpoint's MTP layer (`deepinfer_core.models.deepseek_v4.mtp`), on the model side.
- `policy`: how many drafts each request sends to the target this step (fixed k, or confidence-scheduled).
- `gate`: per request, online acceptance estimates and when to probe a request that stopped drafting
  (the confidence policy decides from them, before a step's tokens are read, whether the next drafts,
  and whether a pausable model drafter such as DSpark runs after a step: `StepPlan.propose_drafts`).
- `calibration`: per draft slot, a drafter's raw confidence (DSpark's head) -> acceptance probability,
  learnt online from verification.
- `proposer`: the engine's side (drafts per sequence for the scheduler, acceptance statistics, metrics).
- `verify`: the runner's side of a verification step (logits rows, the seeded-draw acceptance rule,
  rejection sampling through the `VerifyBackend`); `runner_side` wires it (and the rollback) into the runner.
- `rollback`: rejected drafts leave no trace in the per-request rings and the compressed pools.

A draft is accepted exactly when it equals the token the target itself draws at that position (greedy:
its argmax; sampled: its seeded Gumbel-max draw), so the output is token for token the output without
speculation, whatever the drafter proposed or the policy chose to verify.
"""
