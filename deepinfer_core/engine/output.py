"""Output processing: what a step's sampled tokens mean for each request. Stop rules (stop ids, EOS,
length, stop strings, a completed grammar), detokenisation (incremental while generating, exact once
finished), logprob records (sampled and prompt), the `RequestOutput`s, and the final-text rule for
`skip_special_tokens` and `include_stop_str_in_output` (`apply_final_text`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch

from deepinfer_core.backends.sampling import SamplerOutput
from deepinfer_core.engine.requests import Completion, Request, RequestRegistry
from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_core.plan import NONFINITE_TOKEN
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.sequence import Sequence as Seq
from deepinfer_core.sched.sequence import SequenceStatus
from deepinfer_core.structured_output.manager import GrammarError

if TYPE_CHECKING:
    from deepinfer_core.sched.scheduler import Scheduler
    from deepinfer_core.structured_output.manager import StructuredOutputManager
    from deepinfer_core.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_FINISH_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}
_INCOMPLETE = "\ufffd"  # what a tokenizer yields for a UTF-8 sequence cut in the middle
TOKEN_TEXTS_ENTRIES = 16384
"""Single-token decodes an engine keeps (per cache): the most frequent tokens, not the whole vocabulary."""


class TokenTexts(dict):
    """A cache of single-token decodes that holds at most `max_entries` (the oldest one leaves first): a
    long-running server sees most of a 129K vocabulary in time, and none of it needs to stay."""

    def __init__(self, max_entries: int = TOKEN_TEXTS_ENTRIES) -> None:
        super().__init__()
        self.max_entries = max_entries

    def decoded(self, token_id: int, decode: Callable[[int], str]) -> str:
        """`token_id`'s text, from the cache or `decode(token_id)`."""
        text = self.get(token_id)
        if text is None:
            if len(self) >= self.max_entries:
                del self[next(iter(self))]
            text = self[token_id] = decode(token_id)
        return text


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_generated_after: int,
    eos_token_ids: Sequence[int],
    max_model_len_reached: bool,
) -> str | None:
    """Decide whether a completion ends with the token just appended.

    A stop token or EOS wins over length, as in vLLM; neither counts before `min_tokens`. When the
    result is "stop" and `token_id` is in `params.stop_token_ids`, that id is the `stop_reason`.

    :param params: the request's parameters.
    :param token_id: the token just appended.
    :param num_generated_after: tokens generated including `token_id`.
    :param eos_token_ids: the model's end-of-sequence ids.
    :param max_model_len_reached: the sequence now fills the context.
    :returns: "stop", "length" or None to continue.
    """
    if num_generated_after >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop"
    return "length" if ends_by_length(params, num_generated_after, max_model_len_reached) else None


def ends_by_length(params: SamplingParams, num_generated: int, max_model_len_reached: bool) -> bool:
    """Whether a completion with `num_generated` tokens is done by length (`max_tokens` or the context)."""
    return max_model_len_reached or (params.max_tokens is not None and num_generated >= params.max_tokens)


def build_logprobs_entry(
    output: SamplerOutput,
    row: int,
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Turn row `row` of a sampler output into vLLM's per-step logprobs dict.

    The sampled token comes first, then the `num_logprobs` most likely tokens (rank 1 first); a
    sampled token that is among them appears once. Bring `output` to the host once before calling this
    for every row: as CPU tensors, or faster, with every field as lists (`tensor.tolist()`).

    :param output: the step's `SamplerOutput` (tensors or lists).
    :param row: the batch row.
    :param num_logprobs: this request's `SamplingParams.logprobs` (0 for the sampled token only).
    :param decode: token id -> text, to fill `Logprob.decoded_token`; None leaves it None.
    :returns: token id -> `Logprob`.
    """
    sampled_id = int(output.token_ids[row])
    entries = {sampled_id: (float(output.logprobs[row]), int(output.ranks[row]))}
    if num_logprobs > 0:
        top_token_ids, top_logprobs = output.top_token_ids, output.top_logprobs
        if top_token_ids is None or top_logprobs is None or len(top_token_ids[row]) < num_logprobs:
            raise ValueError(f"sampler output holds fewer than the {num_logprobs} top logprobs requested")
        top_ids, top_values = _as_list(top_token_ids[row][:num_logprobs]), _as_list(top_logprobs[row][:num_logprobs])
        for rank, (token_id, value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
            entries.setdefault(token_id, (value, rank))
    return {
        token_id: Logprob(logprob=value, rank=rank, decoded_token=decode(token_id) if decode else None)
        for token_id, (value, rank) in entries.items()
    }


def _as_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else values


def apply_final_text(output: RequestOutput, params: SamplingParams, tokenizer: Tokenizer | None) -> RequestOutput:
    """`output`'s completions with their final texts (`finished_text`); `output` is changed in place."""
    if tokenizer is None or (params.skip_special_tokens and not params.include_stop_str_in_output):
        return output
    for completion in output.outputs:
        completion.text = finished_text(completion.text, completion.token_ids, completion.stop_reason, params,
                                        lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip))
    return output


def finished_text(text: str, token_ids: list[int], stop_reason: int | str | None, params: SamplingParams,
                  decode: Callable[[list[int], bool], str]) -> str:
    """A finished completion's text under `skip_special_tokens` and `include_stop_str_in_output`.

    :param text: the engine's text: special tokens skipped, cut before a matched stop string.
    :param token_ids: the completion's ids.
    :param stop_reason: the matched stop string (or stop id, or None).
    :param params: the request's parameters.
    :param decode: `(ids, skip_special_tokens) -> text`.
    """
    stop = stop_reason if isinstance(stop_reason, str) else None
    if not params.skip_special_tokens:
        full = decode(token_ids, False)
        cut = full.find(stop) if stop is not None else -1
        text = full if cut < 0 else full[:cut]
    return text + stop if stop is not None and params.include_stop_str_in_output else text


class IncrementalText:
    """Decodes only a short window (`prefix`..end) of the ids each time, and appends what is new.

    Text whose last character is incomplete UTF-8 is held back until the next token completes it.
    `update` takes the same list grown by appends only; a call with no new id returns the text as is.

    :param tokenizer: decodes with `skip_special_tokens=True`.
    :param token_texts: a cache of single-token decodes, shared by every instance on the same
        tokenizer (a step usually decodes one token alone, then it and the new token together).
    """

    def __init__(self, tokenizer: Tokenizer, token_texts: TokenTexts | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts() if token_texts is None else token_texts
        self.text = ""
        self.prefix = self.read = 0
        self.num_ids = 0

    def update(self, ids: list[int]) -> str:
        if len(ids) == self.num_ids:
            return self.text
        self.num_ids = len(ids)
        decode = self.tokenizer.decode
        if self.read - self.prefix == 1:
            before = self.token_texts.decoded(ids[self.prefix], lambda token: decode([token], skip_special_tokens=True))
        else:
            before = decode(ids[self.prefix : self.read], skip_special_tokens=True)
        after = decode(ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(ids)
        return self.text


class OutputProcessor:
    """Takes a step's sampled tokens into the requests they belong to and reports them.

    :param registry: the engine's requests (finished ones are removed when reported).
    :param scheduler: finishes sequences that stop.
    :param structured_output: advances constrained sequences' grammars by their tokens.
    :param tokenizer: the checkpoint's tokenizer (None: no text, no stop strings).
    :param eos_token_ids: the model's end-of-sequence ids.
    :param max_model_len: a sequence this long ends by length.
    :param deterministic: prompt logprobs reduced on the host (`EngineConfig.deterministic`).
    """

    def __init__(self, registry: RequestRegistry, scheduler: Scheduler, structured_output: StructuredOutputManager,
                 tokenizer: Tokenizer | None, eos_token_ids: Sequence[int], max_model_len: int,
                 deterministic: bool) -> None:
        self.registry, self.scheduler, self.structured_output = registry, scheduler, structured_output
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.deterministic = deterministic
        self._token_texts = TokenTexts()
        """Single-token decodes (special tokens kept), for logprobs."""
        self._plain_token_texts = TokenTexts()
        """Single-token decodes (special tokens skipped), shared by every incremental detokenizer."""

    # -- tokens in ----------------------------------------------------------------------------------

    def append_tokens(self, seqs: list[Seq], output, touched: dict[str, Request], pending: bool = False) -> None:
        """Add each row's token to its sequence and apply the stop rules; `pending`: the tokens replace
        the sequences' `PENDING_TOKEN`s, and sequences that finished meanwhile are skipped."""
        host_output = None  # the logprob tensors come to the host only when some row reports them
        tokens = output.token_ids.tolist()  # one device read: it waits for the step to finish
        now = time.time()  # the tokens exist from here (stamped before the read, a prefill's TTFT read short)
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.is_finished:
                continue  # stopped (by the step settled before this one) or aborted: the token is dropped
            completion = self.registry.seq_owner[seq.request_id]
            if token == NONFINITE_TOKEN:  # a pending placeholder stays: outputs never show it
                self._end_with_error(completion, touched, "the model's logits are not finite")
                continue
            is_grammar_complete = False
            if seq.sampling_params.structured_outputs is not None:
                try:  # before the token is added: a rejected one is never shown
                    position = seq.num_output_tokens - 1 if pending else seq.num_output_tokens
                    is_grammar_complete = self.structured_output.accept(seq.request_id, token, position)
                except GrammarError as err:
                    self._end_with_error(completion, touched, str(err))
                    continue
            if pending:
                seq.resolve_pending(token)
            else:
                seq.append_token(token)
            if completion.logprobs is not None:
                if host_output is None:
                    host_output = _host_lists(output)
                entry = build_logprobs_entry(host_output, row, completion.request.params.logprobs, self.decode_token)
                completion.logprobs.append(entry)
                completion.cumulative_logprob += entry[token].logprob
            self._stop_or_continue(completion, token, now, is_grammar_complete)
            touched[completion.request.request_id] = completion.request

    def _stop_or_continue(self, completion: Completion, token: int, now: float, is_grammar_complete: bool) -> None:
        """Count the token appended to `completion` and finish its sequence if a stop rule says so."""
        seq, request = completion.seq, completion.request
        params, metrics = request.params, request.metrics
        if not metrics.first_token_time:
            metrics.first_token_time = now
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1
        reason = check_stop(params, token, seq.num_output_tokens, self.eos_token_ids,
                            seq.num_tokens >= self.max_model_len)
        if (params.stop and reason != "stop" and seq.num_output_tokens >= params.min_tokens
                and self._match_stop_string(completion)):
            reason = "stop"
        elif reason == "stop" and token in params.stop_token_ids:
            completion.stop_reason = token
        if is_grammar_complete and reason is None:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, _FINISH_STATUS[reason])

    def _end_with_error(self, completion: Completion, touched: dict[str, Request], why: str) -> None:
        logger.error("request %s: %s; it ends with finish_reason 'error'", completion.seq.request_id, why)
        self.scheduler.finish(completion.seq, SequenceStatus.FINISHED_ERROR)
        touched[completion.request.request_id] = completion.request

    def end_failed_grammars(self, touched: dict[str, Request]) -> None:
        """End, with finish_reason "error", the sequences whose grammar failed to compile or timed out."""
        for seq_id, why in self.structured_output.pop_failed():
            self._end_with_error(self.registry.seq_owner[seq_id], touched, why)

    def _match_stop_string(self, completion: Completion) -> bool:
        """Whether the text now contains a stop string (only matches ending in the new text are searched)."""
        stops = completion.seq.sampling_params.stop
        seen = len(completion.partial_text.text) if completion.partial_text is not None else 0
        text = self._text(completion, completion.seq.output_token_ids)  # incremental: the seq is not finished
        start = max(0, seen - max(map(len, stops)) + 1)
        hits = [(i, stop) for stop in stops if (i := text.find(stop, start)) >= 0]
        if not hits:
            return False
        completion.text_end, completion.stop_reason = min(hits)
        return True

    def record_prompt_logprobs(self, seq: Seq, first: int, logits: torch.Tensor) -> None:
        """Fill prompt positions `first ..` (a recomputed chunk overwrites them with equal values)."""
        request = self.registry.request_of(seq.request_id)
        if request.seq_ids[0] != seq.request_id:
            return  # the n completions share one prompt
        logits = logits.float()
        # deterministic mode: on the host, whose log-softmax reduces each row in an order fixed by the
        # vocabulary size (`SamplingSpec.deterministic`), so a position's logprobs ignore its step's shape
        logprobs = logits.cpu().log_softmax(-1) if self.deterministic else logits.log_softmax(-1).cpu()
        targets = torch.tensor(seq.token_ids[first : first + logprobs.shape[0]])
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        k = request.params.prompt_logprobs
        top = logprobs.topk(k, dim=-1) if k else None
        for j, token in enumerate(targets.tolist()):
            entry = {token: Logprob(float(chosen[j]), int(ranks[j]), self.decode_token(token))}
            if top is not None:
                for rank, (t, v) in enumerate(zip(top.indices[j].tolist(), top.values[j].tolist()), start=1):
                    entry.setdefault(t, Logprob(v, rank, self.decode_token(t)))
            request.prompt_logprobs[first + j] = entry

    # -- outputs ------------------------------------------------------------------------------------

    def report(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """An output for every request in `touched`; finished ones are stamped and removed from the registry."""
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished:
                request.metrics.finished_time = time.time()
                self.registry.remove(request.request_id)
            outputs.append(self.make_output(request, finished))
        return outputs

    def make_output(self, request: Request, finished: bool | None = None) -> RequestOutput:
        """Everything `request` produced so far; `finished` (computed when None) is `request.finished`."""
        outputs = []
        for index, completion in enumerate(request.completions):  # positional: built per request and step
            seq, logprobs = completion.seq, completion.logprobs
            ids = seq.output_token_ids
            outputs.append(CompletionOutput(
                index, self._text(completion, ids), ids,
                completion.cumulative_logprob if logprobs is not None else None,
                list(logprobs) if logprobs is not None else None,
                _FINISH_REASON.get(seq.status), completion.stop_reason,  # None: unfinished
            ))
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs,
            request.finished if finished is None else finished, request.num_cached_tokens,
            request.metrics, list(request.prompt_logprobs) if request.prompt_logprobs else None,
        )

    # -- text ---------------------------------------------------------------------------------------

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated ids (special tokens skipped); empty without a tokenizer."""
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _text(self, completion: Completion, ids: list[int]) -> str:
        """Exact full decode once finished; while generating, an incremental decode (O(1) a step)."""
        if completion.seq.is_finished or self.tokenizer is None:
            return self.decode(ids)[: completion.text_end]
        if completion.partial_text is None:
            completion.partial_text = IncrementalText(self.tokenizer, self._plain_token_texts)
        return completion.partial_text.update(ids)

    def decode_token(self, token_id: int) -> str | None:
        """One token's text with special tokens kept (cached), for logprob entries; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self._token_texts.decoded(token_id, lambda token: self.tokenizer.decode([token]))


def _host_lists(output: SamplerOutput) -> SamplerOutput:
    """`output` with every field as host lists, which `build_logprobs_entry` reads fast row by row."""
    values = {f.name: getattr(output, f.name) for f in fields(output)}
    return replace(output, **{name: value.tolist() for name, value in values.items() if value is not None})
