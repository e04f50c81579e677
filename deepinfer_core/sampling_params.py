"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`.

DeepInfer 0.1's spellings are accepted too, so its users switch without edits: `seq_seed` (alias of
`seed`), `top_logprobs` (sets `logprobs`), `logprobs=True/False` and `prompt_logprobs=True/False`, and
`first_n_token_no_eos` (raises `min_tokens` to at least that count). Structured output is vLLM's
`structured_outputs=StructuredOutputsParams(...)` (its older `guided_decoding=GuidedDecodingParams(...)`
is the same thing).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real

MAX_LOGPROBS = 20
"""Largest number of top logprobs a request may ask for, per generated (or prompt) token."""

MAX_N = 128
"""Most completions one request may ask for (OpenAI's bound for `n`)."""

MAX_TOKEN_ID = 2**31 - 1
"""Largest token id (or `top_k`) a request may name; the model's vocabulary bounds ids further when the
request reaches the engine (`deepinfer_core.engine.input.check_sampling_params`)."""

MAX_PENALTY = 2.0
"""`presence_penalty` and `frequency_penalty` lie in [-MAX_PENALTY, MAX_PENALTY], as in vLLM."""

REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Allowed `repetition_penalty` values (1 turns it off); the bounds keep fp32 logits finite."""

MAX_LOGIT_BIAS = 100.0
"""`logit_bias` values are clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as vLLM and OpenAI do."""

MAX_SEED = 2**64 - 1
"""Largest seed; seeds are unsigned 64-bit integers, as in DeepInfer 0.1."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (argmax), as in vLLM; DeepInfer 0.1 clamped them to this value."""


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "grammar", "choice", "json_object")
"""The constraints `StructuredOutputsParams` offers; a request names exactly one."""


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's `StructuredOutputsParams`; set exactly one).

    The engine compiles it with xgrammar off the step loop and masks every disallowed token before
    sampling; the output ends (finish reason "stop") when the grammar is complete. In thinking mode
    (a prompt ending inside `<think>`) the reasoning is free and the grammar starts after `</think>`.
    An invalid schema, pattern or grammar raises `ValueError` with xgrammar's message.
    """

    json: str | dict | None = None
    """A JSON Schema (a dict, or its JSON text): the output is one JSON value that validates."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    grammar: str | None = None
    """An EBNF grammar (GBNF style, rule `root` first) the output is a sentence of."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's `json_object`)."""
    disable_any_whitespace: bool = False
    """JSON only: no free whitespace between tokens (compact `", "`/`": "` separators)."""

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if _is_set(getattr(self, kind))]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"structured outputs json is not valid JSON text: {err}") from None
            self.json = parsed
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured outputs json must be a JSON Schema (a dict or its JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured outputs json_object must be True (or None), got {self.json_object!r}")
        _check_bool("disable_any_whitespace", self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `STRUCTURED_OUTPUT_KINDS`."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if _is_set(getattr(self, kind)))

    @property
    def key(self) -> str:
        """A canonical text of the constraint, equal for equal constraints (the compile cache's key)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, separators=(",", ":"))


def _is_set(value: object) -> bool:
    return value is not None and value is not False


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name of `StructuredOutputsParams`."""


@dataclass(frozen=True)
class KvTransferParams:
    """Prefill/decode disaggregation's handle (vLLM's `kv_transfer_params`), typed. On the wire (HTTP
    header and JSON bodies) it is the JSON object `{"prefill": url, "id": str, "first_token": int}` a
    prefill instance answers; `{"export": true}` marks a prefill instance's own run, whose state is
    exported when its first token is sampled. Parse it once at the edge (`from_json`)."""

    prefill: str | None = None
    """The prefill instance's base URL the decode instance reads the blocks from."""
    id: str | None = None
    """The export handle's id on that instance."""
    first_token: int | None = None
    """The first token the prefill instance sampled (the decode instance continues from it), or None."""
    export: bool = False
    """This run's prompt state is exported when it finishes (a prefill instance's request)."""

    def __post_init__(self) -> None:
        if (self.prefill is None) != (self.id is None):
            raise ValueError('kv_transfer_params needs both "prefill" (a URL) and "id" (a handle id), or neither')
        for name in ("prefill", "id"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"kv_transfer_params {name} must be a string, got {type(value).__name__}")
        token = self.first_token
        if token is not None and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
            raise ValueError(f"kv_transfer_params first_token must be a token id (an int >= 0), got {token!r}")
        if not isinstance(self.export, bool):
            raise ValueError(f"kv_transfer_params export must be true or false, got {self.export!r}")  # noqa: TRY004

    @property
    def source(self) -> bool:
        """It names a prefill instance's blocks to read (a decode instance's request)."""
        return self.prefill is not None

    @classmethod
    def from_json(cls, value: object) -> KvTransferParams:
        """Parse the wire form (a JSON object, already decoded). :raises ValueError: not an object, an
        unknown key, or a field of the wrong type."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be a JSON object (a prefill instance's handle), "  # noqa: TRY004
                             f"got {type(value).__name__}")
        unknown = set(value) - {"prefill", "id", "first_token", "export"}
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown keys {sorted(unknown)}; expected prefill, id, "
                             "first_token (or export)")
        return cls(**value)

    def to_json(self) -> dict:
        """The wire form: the keys that are set, as `from_json` reads them."""
        out: dict = {}
        if self.prefill is not None:
            out.update(prefill=self.prefill, id=self.id)
            out["first_token"] = self.first_token
        elif self.first_token is not None:
            out["first_token"] = self.first_token
        if self.export:
            out["export"] = True
        return out


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Validated on construction; an invalid value raises `ValueError` saying what is allowed. Attributes
    assigned afterwards are not validated again.
    `SamplingParams()` samples at temperature 1 for at most 16 tokens; `temperature=0` is greedy.
    """

    n: int = 1
    """Completions to return for the prompt, at most `MAX_N`."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below `GREEDY_TEMPERATURE`) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches `top_p`; in (0, 1]."""
    top_k: int = 0
    """Keep only the `top_k` most likely tokens; 0 or -1 turns the filter off; at most `MAX_TOKEN_ID`."""
    min_p: float = 0.0
    """Drop tokens whose probability is below `min_p` times the most likely token's; in [0, 1]."""
    seed: int | None = None
    """Seed of this request's draws, in [0, 2**64). Draws depend only on (seed, token index), never on
    the batch. None: the engine picks a random seed."""
    stop: str | list[str] | None = None
    """Stop strings: the completion ends (finish reason "stop", `stop_reason` the string) as soon as its
    text contains one; the text is cut before it. Needs the checkpoint's tokenizer."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion (finish reason "stop", `stop_reason` the id); each below the
    model's vocabulary size."""
    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None generates until the context is full."""
    min_tokens: int = 0
    """End-of-sequence and `stop_token_ids` are banned until this many tokens are generated."""
    logprobs: int | bool | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the top k, per step. DeepInfer 0.1's
    `True` means k = 0 and `False` means None."""
    prompt_logprobs: int | bool | None = None
    """Like `logprobs`, for each prompt token after the first (`RequestOutput.prompt_logprobs`). Such a
    request takes no prefix-cache hit, since every prompt position must be computed."""

    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (at least once), in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of the token in the generated text, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in the prompt or the output; 1 is off."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (clamped to [-100, 100])."""
    bad_words: list[str] | None = None
    """Words never generated: a word's last token is banned whenever the output ends with the rest of it
    (with and without a leading space). Needs the checkpoint's tokenizer."""
    allowed_token_ids: list[int] | None = None
    """When given (non-empty), only these token ids may be generated."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (k >= 1); -1 keeps as many as `max_model_len` allows."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON Schema, regex, EBNF grammar or list of choices (see
    `StructuredOutputsParams`; a dict of its fields is accepted too)."""
    guided_decoding: StructuredOutputsParams | None = None
    """vLLM's older name of `structured_outputs`; kept equal to it."""
    traffic_class: str | None = None
    """Retention class of the prompt's blocks in the prefix store ("agent", "chat", or another class the
    engine's `prefix_store_ttl_s` names); None: the engine's `default_traffic_class`."""
    kv_transfer_params: KvTransferParams | None = None
    """Prefill/decode disaggregation (vLLM's name): the handle a prefill instance returned for this
    prompt's blocks (`deepinfer_core.kv.nixl_transfer`); a decode instance reads them before admitting
    the request. None: computed here. A dict of its wire form is parsed (`KvTransferParams.from_json`)."""

    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    """`bad_words` as token-id sequences; set when the request reaches the engine, which has the
    tokenizer (`deepinfer_core.engine.input.check_sampling_params`)."""

    # DeepInfer 0.1 spellings, folded into the fields above by __post_init__.
    seq_seed: int | None = None
    """DeepInfer 0.1's name for `seed`; kept equal to it."""
    top_logprobs: int | None = None
    """DeepInfer 0.1's name for the top-logprob count; `top_logprobs=k` (k > 0) sets `logprobs=k`."""
    first_n_token_no_eos: int = 0
    """DeepInfer 0.1: ban end-of-sequence for this many first tokens; raises `min_tokens` to it."""

    def __post_init__(self) -> None:
        self._fold_aliases()
        self._validate_sampling()
        self._validate_lengths()
        self._validate_stops()
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_token_sets()
        self._validate_output_options()
        self._validate_structured_outputs()
        if self.kv_transfer_params is not None:
            self.kv_transfer_params = KvTransferParams.from_json(self.kv_transfer_params)
        if self.traffic_class is not None and not (isinstance(self.traffic_class, str) and self.traffic_class):
            raise ValueError(f"traffic_class must be a non-empty string (e.g. 'agent', 'chat'), got {self.traffic_class!r}")

    @property
    def is_greedy(self) -> bool:
        """True when every token is the argmax (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self) -> SamplingParams:
        """Return an independent deep copy (attributes set after construction are copied as they are)."""
        return copy.deepcopy(self)

    # -- phases of __post_init__ ----------------------------------------------------------------

    def _fold_aliases(self) -> None:
        if self.seq_seed is not None and self.seed is not None and self.seq_seed != self.seed:
            raise ValueError(
                f"seed={self.seed} and seq_seed={self.seq_seed} disagree; "
                "seq_seed is an alias of seed, give one"
            )
        self.seed = self.seq_seed = self.seed if self.seed is not None else self.seq_seed
        if self.top_logprobs is not None:
            self.top_logprobs = _check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_LOGPROBS)
            if self.top_logprobs > 0:
                if _is_int(self.logprobs) and self.logprobs != self.top_logprobs:
                    raise ValueError(
                        f"logprobs={self.logprobs} and top_logprobs={self.top_logprobs} disagree; "
                        "top_logprobs is an alias of logprobs, give one"
                    )
                self.logprobs = self.top_logprobs
        self.logprobs = _bool_to_count(self.logprobs)
        self.prompt_logprobs = _bool_to_count(self.prompt_logprobs)
        self.top_logprobs = self.logprobs if self.logprobs is not None else 0

    def _validate_sampling(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        self.top_k = _check_int("top_k", self.top_k, low=-1, high=MAX_TOKEN_ID, hint=" (0 or -1 turns it off)")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p!r}")
        if self.seed is not None:
            self.seed = self.seq_seed = _check_int("seed", self.seed, low=0, high=MAX_SEED)
        self.n = _check_int("n", self.n, low=1, high=MAX_N)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            self.max_tokens = _check_int(
                "max_tokens", self.max_tokens, low=1, hint=" (None generates until the context is full)"
            )
        self.min_tokens = _check_int("min_tokens", self.min_tokens, low=0)
        self.first_n_token_no_eos = _check_int("first_n_token_no_eos", self.first_n_token_no_eos, low=0)
        self.min_tokens = max(self.min_tokens, self.first_n_token_no_eos)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens"
            )

    def _validate_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            self.stop = list(self.stop) or None
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _check_int(name, value, low=0, high=MAX_LOGPROBS, hint=" (None for no logprobs)"))

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 turns it off), got {value!r}")
            setattr(self, name, float(value))
        low, high = REPETITION_PENALTY_RANGE
        if not _is_real(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (1 turns it off), got {self.repetition_penalty!r}"
            )
        self.repetition_penalty = float(self.repetition_penalty)

    def _validate_token_sets(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for token_id, value in self.logit_bias.items():
                token_id = _check_int("every logit_bias key", _int_key(token_id), low=0, high=MAX_TOKEN_ID)
                if not _is_real(value) or not math.isfinite(value):
                    raise ValueError(f"logit_bias[{token_id}] must be a finite number, got {value!r}")
                bias[token_id] = min(max(float(value), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: give at least one id, or None to allow every token")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words) or None

    def _validate_output_options(self) -> None:
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            self.truncate_prompt_tokens = _check_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, low=1,
                hint=" (-1 keeps what max_model_len allows, None keeps the whole prompt)")

    def _validate_structured_outputs(self) -> None:
        given = [_structured(name, getattr(self, name)) for name in ("structured_outputs", "guided_decoding")]
        given = [g for g in given if g is not None]
        if len(given) == 2 and given[0] != given[1]:
            raise ValueError("structured_outputs and guided_decoding disagree; guided_decoding is an alias of "
                             "structured_outputs, give one")
        self.structured_outputs = self.guided_decoding = given[0] if given else None


def _structured(name: str, value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as err:
            raise ValueError(f"{name}: {err}") from None
    raise ValueError(f"{name} must be a StructuredOutputsParams (or a dict of its fields), got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _int_key(value: object) -> object:
    """JSON objects carry logit_bias keys as strings ("42"); read those as ids."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


# Wrong types raise ValueError like wrong values: the README promises one error type for bad parameters.
def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")  # noqa: TRY004


def _check_token_ids(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")  # noqa: TRY004
    return [_check_int(f"every {name} entry", t, low=0, high=MAX_TOKEN_ID) for t in value]


def _bool_to_count(value: int | bool | None) -> int | None:
    """DeepInfer 0.1 passes booleans: True asks for the token's own logprob (k = 0), False for none."""
    if isinstance(value, bool):
        return 0 if value else None
    return value


def _check_int(name: str, value: object, *, low: int, high: int | None = None, hint: str = "") -> int:
    """`value` as a plain `int` (numpy integers included), or `ValueError` naming the bounds."""
    in_range = _is_int(value) and value >= low and (high is None or value <= high)
    if not in_range:
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bounds}{hint}, got {value!r}")
    return int(value)


def needs_token_history(params: SamplingParams) -> bool:
    """Whether the sampler needs the request's generated ids (penalties, bad words of several tokens):
    the runner passes them to `prepare_sampling_tensors`, and overlapped decode must not leave the
    last one on the device only. Call after `check_sampling_params` (it resolves `bad_words`)."""
    return any(history_fields(params))


def history_fields(params: SamplingParams) -> list[str]:
    return [
        "presence_penalty" if params.presence_penalty else "",
        "frequency_penalty" if params.frequency_penalty else "",
        "repetition_penalty" if params.repetition_penalty != 1 else "",
        "bad_words of several tokens" if any(len(ids) > 1 for ids in params.bad_words_token_ids or []) else "",
    ]
