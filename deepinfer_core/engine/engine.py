"""The engine: requests in, incremental `RequestOutput`s out, one `step()` at a time.

`add_request` validates (`engine/input.py`) and queues (`engine/requests.py`); `step` asks the scheduler
for a `StepPlan`, runs it through the executor (the model side: in this process, or worker ranks) and
reports every request that progressed. What is in flight between steps (an overlapped decode step, a
verification step read late) and how a plan runs is `engine/overlap.py`; what the sampled tokens mean
(stop rules, text, logprobs, the `RequestOutput`s) is `engine/output.py`.
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core import plugins
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine.input import InputProcessor, check_image_layout
from deepinfer_core.engine.output import OutputProcessor
from deepinfer_core.engine.overlap import InFlightSteps
from deepinfer_core.engine.requests import RequestRegistry
from deepinfer_core.executor.factory import make_executor
from deepinfer_core.executor.protocol import parallel_stats
from deepinfer_core.kv.blocks import layout_bytes
from deepinfer_core.kv.connector import KvConnector
from deepinfer_core.kv.nixl_transfer import first_token_output
from deepinfer_core.kv.tiers import make_prefix_tiers
from deepinfer_core.models import registry
from deepinfer_core.multimodal import ImageLimits, lay_images
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plan import ImageInput, StepPlan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.sched.block_pool import BlockPool
from deepinfer_core.sched.scheduler import Scheduler, SchedulerConfig
from deepinfer_core.speculative.proposer import Speculator
from deepinfer_core.structured_output.manager import StructuredOutputManager
from deepinfer_core.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def _show_info_logs() -> None:
    """Print the engine's INFO lines (cache size, graphs) unless the application configured logging."""
    package = logging.getLogger("deepinfer_core")
    if not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s deepinfer: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


def scheduler_config(config: EngineConfig, model_config: ModelConfig, block_size: int) -> SchedulerConfig:
    """What the scheduler needs of the resolved engine config and the model."""
    return SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                           max_model_len=config.max_model_len, block_size=block_size,
                           sliding_window=model_config.sliding_window,
                           enable_prefix_caching=config.enable_prefix_caching, swa_replay=config.swa_replay,
                           num_layers=model_config.num_hidden_layers)


class Engine:
    """Synchronous engine; not thread-safe (see `deepinfer_core.engine.async_engine` for serving).

    Its parts: `input` (validation), `requests` (the registry), `scheduler`, `steps` (runs plans, owns
    what is in flight) and `output` (stop rules, text, outputs). `validate_prompt`, `decode` and
    `make_output` are those parts' methods.
    """

    def __init__(self, engine_config: EngineConfig, weights: dict[str, torch.Tensor] | None = None,
                 executor=None) -> None:
        """`executor`: the model side to run on (a data-parallel rank's share); None builds one."""
        _show_info_logs()
        model_config = registry.load_model_config(engine_config.model)
        self.config = config = engine_config.resolve(model_config)
        self.model_config: ModelConfig = model_config
        device = torch.device(config.device) if config.device else plugins.select_device()
        self.executor = executor if executor is not None else make_executor(model_config, config, device, weights)
        info = self.executor.info
        self.tokenizer = load_tokenizer(config.model, model_config)
        self.eos_token_ids = model_config.eos_token_ids
        self.structured_output = StructuredOutputManager(self.tokenizer, model_config.vocab_size,
                                                         self.eos_token_ids, pin_memory=device.type == "cuda")
        self.prefix_tiers = make_prefix_tiers(config, info.cache_fingerprint, info.block_layout,
                                              layout_bytes(info.block_layout))
        self.block_manager = BlockPool(info.num_blocks, info.block_size, config.enable_prefix_caching,
                                       info.cache_fingerprint)
        self.kv_connector = KvConnector(self.block_manager, self.prefix_tiers)
        self.speculator = Speculator.from_config(config.speculative_config) if config.speculative_config is not None else None
        """Speculative decoding's drafts and statistics (None without `speculative_config`)."""
        self.scheduler = Scheduler(
            scheduler_config(config, model_config, info.block_size), self.block_manager, info.num_slots,
            # a constrained request waits for its grammar, one whose prefix is read from the store for it
            is_admissible=lambda seq: self.structured_output.is_ready(seq) and self.kv_connector.is_prefix_ready(seq),
            choose_drafts=self.speculator.choose_drafts if self.speculator is not None else None,
            connector=self.kv_connector,
        )
        self.input = InputProcessor(model_config.vocab_size, config.max_model_len, self.tokenizer, self.eos_token_ids,
                                    self.prefix_tiers, self.structured_output)
        self.requests = RequestRegistry(config.seed, self.structured_output, self.speculator)
        self.output = OutputProcessor(self.requests, self.scheduler, self.structured_output, self.tokenizer,
                                      self.eos_token_ids, config.max_model_len, config.deterministic)
        overlap = info.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        self.steps = InFlightSteps(self.executor, self.scheduler, self.output, self.structured_output,
                                   self.speculator, self.prefix_tiers, overlap, config.max_model_len)
        self.validate_prompt, self.decode, self.make_output = self.input.validate_prompt, self.output.decode, self.output.make_output

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None, images: tuple[ImageInput, ...] = ()) -> None:
        """Queue a request; raises `ValueError` on bad input before anything is queued.

        `images`: the prompt's images, already laid into `prompt_token_ids` (`prepare_images`)."""
        if request_id in self.requests.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        first, grammar = self.input.process(prompt_token_ids, sampling_params)
        if images:
            self.input.check_images(prompt_token_ids, images, sampling_params)
        request = self.requests.create(request_id, prompt, prompt_token_ids, sampling_params,
                                       defers_grammar_mask=self.steps.defers_grammar_masks, images=tuple(images))
        for completion in request.completions:  # all or nothing
            self.scheduler.add(completion.seq)
        self.requests.register(request, grammar)
        if first is not None:  # sampled by a prefill instance (kv_transfer): the answer goes on from it
            self.output.append_tokens([request.completions[0].seq], first_token_output(first), touched := {})
            if request.finished:  # else it is reported with the next token, once the prompt's cache is in
                self.requests.touched.update(touched)

    def prepare_images(self, prompt_token_ids: list[int], images: list) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Decode and process a prompt's images (encoded bytes or `PIL.Image`s, one per `image_token_id`
        in the ids) under this engine's limits, and lay them into the ids (`multimodal.lay_images`).

        :raises ImageError: (a `ValueError`) a model without vision, a bad or too large image, a count
            that does not match the placeholders.
        :raises NotImplementedError: image input under a parallel layout that does not carry it yet."""
        check_image_layout(self.config)
        return lay_images(prompt_token_ids, images, self.model_config, ImageLimits.from_config(self.config))

    def abort(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown ids are ignored."""
        request = self.requests.requests.get(request_id)
        if request is None:
            return
        for seq_id in request.seq_ids:
            self.scheduler.abort(seq_id)
        self.requests.remove(request_id)

    @property
    def runner(self):
        """The model runner, when it lives in this process (the "uni" executor); benches and tests read it."""
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError("the model runs in worker processes: this engine has no in-process runner")
        return runner

    def shutdown(self) -> None:
        """Stop the executor's workers (in-process: the model's own threads); the engine is unusable afterwards."""
        self.flush_cache_ops()
        if self.prefix_tiers is not None:
            self.prefix_tiers.close()
        self.executor.shutdown()
        self.structured_output.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for every request that progressed or finished.

        With overlapped decode a decode step's tokens are reported by the step after it. Once nothing is
        left to run, blocks still queued for the prefix tiers are saved (so they outlive the process)."""
        touched, self.requests.touched = self.requests.touched, {}  # added with their first token: progressed
        steps = self.steps
        steps.read(touched)
        if self.structured_output.has_pending:
            self.output.end_failed_grammars(touched)
        plan = self.scheduler.schedule()
        for seq in self.scheduler.pop_finished():
            request = self.requests.request_of(seq.request_id)
            touched[request.request_id] = request
        if plan is None:
            self.flush_cache_ops()  # loads and saves queued by an admission that did not fit
            if steps.in_flight is not None:  # everything running was preempted: nothing to launch
                steps.settle_in_flight(touched)
            elif not touched and self.structured_output.has_pending:
                self.structured_output.wait_pending(0.05)  # only grammars compiling: no busy loop
            elif not touched and self.prefix_tiers is not None:
                self.prefix_tiers.wait_loading(0.05)  # only prefixes loading from the store: no busy loop
            outputs = self.output.report(touched)
        else:
            seqs = [self.requests.seq_owner[r.request_id].seq for r in plan.requests]
            self.requests.note_scheduled(seqs)
            after_outputs = steps.run(plan, seqs, touched)
            outputs = self.output.report(touched)  # built before a step left in flight gets pending tokens
            if after_outputs is not None:
                after_outputs()
        if self.prefix_tiers is not None and steps.is_empty and not self.scheduler.has_unfinished():
            self.flush_cache_ops()
        return outputs

    def flush_cache_ops(self) -> None:
        """Run the queued prefix-tier transfers in a plan of their own (no tokens): afterwards every
        computed block is in the host tier and queued for the store. A verify step still launched is read
        first (its outputs come with the next `step()`)."""
        if self.steps.launched is not None:
            self.steps.read_launched(self.requests.touched)
        if self.prefix_tiers is None:
            return
        if self.prefix_tiers.has_cache_ops:
            ops = self.kv_connector.take_cache_ops()
            result = self.executor.execute(StepPlan((), cache_ops=ops))
            self.prefix_tiers.accept_saved(ops, result.saved)
        self.prefix_tiers.poll_saves(wait=True)

    def stats(self) -> dict:
        """Counters for monitoring: queue sizes, prefix-cache hits, preemptions, free blocks."""
        s = self.scheduler.stats
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.executor.info.num_blocks,
            "prefix_cache_hit_tokens": s.num_hit_tokens,
            "prefix_cache_queried_tokens": s.num_queried_tokens,
            "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_replay_tokens": s.num_replay_tokens,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "num_preemptions": s.num_preemptions,
            "num_loading": sum(seq.is_loading for seq in self.scheduler.waiting),
            **{f"prefix_cache_hit_tokens_{tier}": n for tier, n in self.kv_connector.hit_tokens.items()},
            **(self.prefix_tiers.stats() if self.prefix_tiers is not None else {}),
            **(_spec_stats(self.speculator) if self.speculator is not None else {}),
            "encoder_images_encoded": self.steps.encoder.num_encoded,
            "encoder_cache_hits": self.steps.encoder.num_cache_hits,
            "encoder_seconds": self.steps.encoder.seconds,
            **parallel_stats(self.executor),
        }


def _spec_stats(speculator: Speculator) -> dict:
    """The engine's speculative decoding counters, for `stats()` and `/metrics`."""
    return {
        **speculator.totals.to_stats(),  # drafts, acceptance, per slot: rates, raw and calibrated confidences
        "spec_overlapped_steps": speculator.num_overlapped_steps,
        "spec_probe_steps": speculator.num_probe_steps,
    }

