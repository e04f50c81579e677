"""Plugin loading, selection, declining, allow/block lists and the typed hook functions."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
import torch

from deepinfer_core import plugins
from deepinfer_core.backends import (
    AttentionSpec,
    EplbSpec,
    LayerOpsSpec,
    LinearSpec,
    MoESpec,
    SamplingSpec,
    VerifySpec,
)
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.eplb import ReferenceEplb
from deepinfer_core.reference.layer_ops import ReferenceLayerOps
from deepinfer_core.reference.linear import ReferenceLinear
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.reference.verify import ReferenceVerifier

CPU = torch.device("cpu")
ATTENTION = AttentionSpec(num_heads=2, head_dim=8, sliding_window=4, compress_rate=4, index_n_heads=2,
                          index_head_dim=4, index_topk=2)
MOE = MoESpec(hidden_size=8, intermediate_size=4, num_experts=4, top_k=2, scoring_func="sqrtsoftplus",
              routed_scaling_factor=1.5, swiglu_limit=10.0)
EPLB = EplbSpec(num_layers=2, num_experts=4, num_slots=6, num_ranks=2)
SAMPLING = SamplingSpec(vocab_size=16)
VERIFY = VerifySpec(vocab_size=16, max_draft_tokens=2)
LAYER_OPS = LayerOpsSpec(hidden_size=8, hc_mult=2, hc_sinkhorn_iters=3, hc_eps=1e-6, rms_norm_eps=1e-6)
LINEAR = LinearSpec(in_features=256, out_features=128)


class ChipAttention(ReferenceAttention):
    """Stands for a hardware backend: a distinct type the tests can recognise."""


class ChipPlugin:
    """Serves attention only for specs with a sliding window of 4; declines everything else."""

    @hookimpl
    def platforms(self):
        return ["chip"]

    @hookimpl
    def make_attention(self, spec, device, decline):
        if spec.sliding_window != 4:
            decline("only sliding_window=4 is supported")
            return None
        return ChipAttention(spec, device)


class DecliningPlugin:
    @hookimpl
    def make_attention(self, decline):
        decline("no attention kernels here")

    @hookimpl
    def make_moe(self, spec, device, decline):
        decline(f"no {spec.scoring_func} routing kernel")

    @hookimpl
    def make_sampler(self):
        return None  # declines without a reason

    @hookimpl
    def detect_device(self, decline):
        decline("no chip on this machine")


def _fake_entry_point(monkeypatch: pytest.MonkeyPatch, name: str, module: types.ModuleType):
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return importlib.metadata.EntryPoint(name=name, value=module.__name__, group="deepinfer")


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    for function_name, function in functions.items():
        setattr(module, function_name, function)
    return module


# ------------------------------------------------------------------------------------------------ selection


def test_reference_serves_every_factory_hook(isolated_plugin_manager):
    assert type(plugins.make_attention(ATTENTION, CPU)) is ReferenceAttention
    assert type(plugins.make_moe(MOE, CPU)) is ReferenceMoE
    assert type(plugins.make_eplb(EPLB, CPU)) is ReferenceEplb
    assert type(plugins.make_layer_ops(LAYER_OPS, CPU)) is ReferenceLayerOps
    assert type(plugins.make_sampler(SAMPLING, CPU)) is ReferenceSampler
    assert type(plugins.make_verifier(VERIFY, CPU)) is ReferenceVerifier
    assert type(plugins.make_linear(LINEAR, CPU)) is ReferenceLinear


def test_plugin_beats_the_reference(isolated_plugin_manager):
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    backend = plugins.make_attention(ATTENTION, CPU)
    assert type(backend) is ChipAttention
    assert backend.spec == ATTENTION
    # a hook the plugin does not implement still comes from the reference
    assert type(plugins.make_moe(MOE, CPU)) is ReferenceMoE


def test_plugin_wins_eplb_and_verifier(isolated_plugin_manager):
    class ChipEplb(ReferenceEplb):
        pass

    class ChipVerifier(ReferenceVerifier):
        pass

    class Chip:
        @hookimpl
        def make_eplb(self, spec, device):
            return ChipEplb(spec, device)

        @hookimpl
        def make_verifier(self, spec, device):
            return ChipVerifier(spec, device)

    isolated_plugin_manager.register(Chip(), name="chip")
    assert type(plugins.make_eplb(EPLB, CPU)) is ChipEplb
    assert type(plugins.make_verifier(VERIFY, CPU)) is ChipVerifier
    assert type(plugins.make_sampler(SAMPLING, CPU)) is ReferenceSampler


def test_plugin_wins_layer_ops_for_its_dtype_only(isolated_plugin_manager):
    class ChipLayerOps(ReferenceLayerOps):
        pass

    class Chip:
        @hookimpl
        def make_layer_ops(self, spec, device, decline):
            if spec.dtype != torch.bfloat16:
                decline("bf16 only")
                return None
            return ChipLayerOps(spec)

    isolated_plugin_manager.register(Chip(), name="chip")
    bf16 = LayerOpsSpec(**{**LAYER_OPS.__dict__, "dtype": torch.bfloat16})
    assert type(plugins.make_layer_ops(bf16, CPU)) is ChipLayerOps
    assert plugins.make_layer_ops(bf16, CPU).spec == bf16
    assert type(plugins.make_layer_ops(LAYER_OPS, CPU)) is ReferenceLayerOps


def test_plugin_wins_linear_for_its_block_only(isolated_plugin_manager):
    class ChipLinear(ReferenceLinear):
        pass

    class Chip:
        @hookimpl
        def make_linear(self, spec, device, decline):
            if spec.block != (128, 128):
                decline("128x128 scale tiles only")
                return None
            return ChipLinear(spec, device)

    isolated_plugin_manager.register(Chip(), name="chip")
    assert type(plugins.make_linear(LINEAR, CPU)) is ChipLinear
    small_tiles = LinearSpec(in_features=64, out_features=64, block=(32, 32))
    outcome = plugins.ask("make_linear", spec=small_tiles, device=CPU)
    assert outcome.winner == "reference" and outcome.declines == {"chip": "128x128 scale tiles only"}
    assert type(outcome.result) is ReferenceLinear


def test_declining_plugin_falls_through_to_the_reference(isolated_plugin_manager):
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    wide = AttentionSpec(num_heads=2, head_dim=8, sliding_window=16, compress_rate=0)
    assert type(plugins.make_attention(wide, CPU)) is ReferenceAttention


def test_everyone_declining_names_each_plugin_and_reason(isolated_plugin_manager):
    isolated_plugin_manager.set_blocked("reference")
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    isolated_plugin_manager.register(DecliningPlugin(), name="decliner")
    wide = AttentionSpec(num_heads=2, head_dim=8, sliding_window=16, compress_rate=0)
    with pytest.raises(plugins.BackendUnavailableError) as info:
        plugins.make_attention(wide, CPU)
    message = str(info.value)
    assert "chip: only sliding_window=4 is supported" in message
    assert "decliner: no attention kernels here" in message
    with pytest.raises(plugins.BackendUnavailableError, match="decliner: no sqrtsoftplus routing kernel"):
        plugins.make_moe(MOE, CPU)
    with pytest.raises(plugins.BackendUnavailableError, match="decliner: returned None without a reason"):
        plugins.make_sampler(SAMPLING, CPU)
    with pytest.raises(plugins.BackendUnavailableError, match="no installed plugin implements it"):
        plugins.make_verifier(VERIFY, CPU)
    with pytest.raises(plugins.BackendUnavailableError, match="no installed plugin implements it"):
        plugins.make_eplb(EPLB, CPU)


def test_decline_reasons_belong_to_the_plugin_whose_code_declines(isolated_plugin_manager):
    def explain(decline, why):  # a helper of the plugin, not its hook function, calls decline
        decline(why)

    class Picky:
        def __init__(self, why):
            self.why = why

        @hookimpl
        def make_moe(self, decline):
            explain(decline, self.why)

    isolated_plugin_manager.set_blocked("reference")
    isolated_plugin_manager.register(Picky("too few experts"), name="first")
    isolated_plugin_manager.register(Picky("wrong dtype"), name="second")
    with pytest.raises(plugins.BackendUnavailableError) as info:
        plugins.make_moe(MOE, CPU)
    assert "Declined: second: wrong dtype; first: too few experts" in str(info.value)


def test_result_not_satisfying_the_protocol_is_rejected(isolated_plugin_manager):
    class Broken:
        @hookimpl
        def make_sampler(self):
            return object()

    isolated_plugin_manager.register(Broken(), name="broken")
    with pytest.raises(plugins.PluginError, match="'broken' returned object from make_sampler.*SamplingBackend"):
        plugins.make_sampler(SAMPLING, CPU)


def test_plugin_exception_names_the_plugin(isolated_plugin_manager):
    class Crashing:
        @hookimpl
        def make_verifier(self, spec):
            raise RuntimeError("driver too old")

    isolated_plugin_manager.register(Crashing(), name="crashing")
    with pytest.raises(RuntimeError, match="driver too old") as info:
        plugins.make_verifier(VERIFY, CPU)
    assert "raised by plugin 'crashing' in make_verifier" in info.value.__notes__


# ------------------------------------------------------------------------------------------------ devices


def test_platforms_by_plugin(isolated_plugin_manager):
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    assert plugins.platforms() == {"chip": ["chip"], "reference": ["cpu"]}


def test_detect_device_falls_back_to_cpu(isolated_plugin_manager):
    isolated_plugin_manager.register(DecliningPlugin(), name="decliner")
    assert plugins.select_device() == CPU


def test_detect_device_prefers_a_plugin(isolated_plugin_manager):
    class Meta:
        @hookimpl
        def detect_device(self):
            return torch.device("meta")

    isolated_plugin_manager.register(Meta(), name="meta")
    assert plugins.select_device() == torch.device("meta")


@pytest.mark.parametrize(("accelerator", "extra"), [("nvidia", "nvidia"), ("ascend", "ascend")])
def test_accelerator_without_its_plugin_names_the_extra(isolated_plugin_manager, monkeypatch, accelerator, extra):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", accelerator)
    with pytest.raises(plugins.PluginError, match=rf'pip install --find-links dist "deepinfer\[{extra}\]"'):
        plugins.select_device()


def test_accelerator_cpu_and_unknown_values(isolated_plugin_manager, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "CPU")
    assert plugins.select_device() == CPU
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    with pytest.raises(plugins.PluginError, match="'tpu' is not one of"):
        plugins.select_device()


class NvidiaPlatform:
    @hookimpl
    def platforms(self):
        return ["nvidia"]


def test_accelerator_served_by_a_plugin_maps_to_its_device_type(isolated_plugin_manager, monkeypatch):
    isolated_plugin_manager.register(NvidiaPlatform(), name="nvidia_sm100")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugins.select_device() == torch.device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_nvidia_accelerator_without_cuda_fails_at_once(isolated_plugin_manager, monkeypatch):
    nvidia_hooks = pytest.importorskip("deepinfer_nvidia_sm100.hooks")
    isolated_plugin_manager.register(nvidia_hooks, name="nvidia_sm100")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    with pytest.raises(plugins.PluginError) as info:
        plugins.select_device()
    message = str(info.value)
    assert "DEEPINFER_ACCELERATOR=nvidia but this machine cannot run 'cuda' devices" in message
    assert f"torch {torch.__version__} finds no 'cuda' device" in message
    assert "Unset DEEPINFER_ACCELERATOR" in message and "DEEPINFER_ACCELERATOR=cpu" in message


def test_ascend_accelerator_without_torch_npu_fails_at_once(isolated_plugin_manager, monkeypatch):
    class Ascend:
        @hookimpl
        def platforms(self):
            return ["ascend"]

    isolated_plugin_manager.register(Ascend(), name="ascend950")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    monkeypatch.setitem(plugins.DEVICE_EXTENSIONS, "npu", "no_such_torch_extension_for_test")
    with pytest.raises(plugins.PluginError, match="cannot run 'npu' devices: .*no_such_torch_extension_for_test"):
        plugins.select_device()


# ------------------------------------------------------------------------------------------------ registries


def test_tokenizer_loaders_are_ordered_by_priority(isolated_plugin_manager):
    def load_json(model_dir, config):
        return None

    def load_recipe(model_dir, config):
        return None

    class Tokenizers:
        @hookimpl
        def register_tokenizers(self, register):
            register("tokenizer.json", load_json)
            register("recipe", load_recipe, priority=10)

    isolated_plugin_manager.register(Tokenizers(), name="tokenizers")
    loaders = plugins.tokenizer_loaders()
    assert [(loader.name, loader.load, loader.priority) for loader in loaders] == [
        ("recipe", load_recipe, 10), ("tokenizer.json", load_json, 0)]


def test_chat_encodings_first_registration_wins(isolated_plugin_manager):
    def first(tokenizer, config):
        return None

    def second(tokenizer, config):
        return None

    class Early:
        @hookimpl(tryfirst=True)
        def register_chat_encodings(self, register):
            register("deepseek_v4", first)

    class Late:
        @hookimpl
        def register_chat_encodings(self, register):
            register("deepseek_v4", second)
            register("other", second)

    isolated_plugin_manager.register(Late(), name="late")
    isolated_plugin_manager.register(Early(), name="early")
    assert plugins.chat_encodings() == {"deepseek_v4": first, "other": second}


def test_model_entries_come_from_register_models(isolated_plugin_manager):
    class Family:
        @hookimpl
        def register_models(self, register):
            register("my_model", ["MyForCausalLM"], "my_pkg.model:MyForCausalLM")

    isolated_plugin_manager.register(Family(), name="family")
    (entry,) = plugins.model_entries()
    assert entry == ("my_model", ("MyForCausalLM",), "my_pkg.model:MyForCausalLM", "deepinfer_core.config:ModelConfig")


def test_prefix_store_backends_come_from_register_prefix_stores(isolated_plugin_manager, tmp_path):
    from deepinfer_core.kv.store_backends import PosixBackend, open_backend

    class Usrbio:
        @hookimpl
        def register_prefix_stores(self, register):
            register("3fs", lambda location: PosixBackend(tmp_path / location.removeprefix("3fs://")))

    isolated_plugin_manager.register(Usrbio(), name="usrbio")
    assert set(plugins.prefix_store_backends()) == {"3fs"}
    backend = open_backend("3fs://cluster/kv")
    assert isinstance(backend, PosixBackend) and backend.root == tmp_path / "cluster" / "kv"


# ------------------------------------------------------------------------------------------------ loading


def test_entry_point_plugins_load_after_the_reference(monkeypatch):
    module = _module("chip_hooks_for_test", platforms=hookimpl(lambda: ["chip"]))
    pm = plugins.build_plugin_manager(entry_points=[_fake_entry_point(monkeypatch, "chip", module)])
    assert [name for name, _ in pm.list_name_plugin()] == ["reference", "chip"]


def test_blocked_plugin_is_ignored(monkeypatch):
    module = _module("blocked_hooks_for_test", platforms=hookimpl(lambda: ["chip"]))
    pm = plugins.build_plugin_manager(entry_points=[_fake_entry_point(monkeypatch, "chip", module)],
                                      block=["chip"])
    assert [name for name, plugin in pm.list_name_plugin() if plugin is not None] == ["reference"]


def test_blocking_the_reference(monkeypatch):
    pm = plugins.build_plugin_manager(entry_points=[], block=["reference"])
    assert pm.get_plugins() == set()


def test_allow_list_loads_only_named_plugins(monkeypatch):
    chip = _module("allowed_hooks_for_test", platforms=hookimpl(lambda: ["chip"]))
    other = _module("other_hooks_for_test", platforms=hookimpl(lambda: ["other"]))
    entry_points = [_fake_entry_point(monkeypatch, "chip", chip), _fake_entry_point(monkeypatch, "other", other)]
    pm = plugins.build_plugin_manager(entry_points=entry_points, allow=["chip"])
    assert [name for name, _ in pm.list_name_plugin()] == ["reference", "chip"]


def test_allow_list_naming_a_missing_plugin_fails(monkeypatch):
    with pytest.raises(plugins.PluginError, match=r"names \['nvidai'\], which are not installed"):
        plugins.build_plugin_manager(entry_points=[], allow=["nvidai"])


def test_misspelt_hook_is_rejected_with_plugin_and_hook_named(monkeypatch):
    module = _module("typo_hooks_for_test", make_atention=hookimpl(lambda spec, device: None))
    with pytest.raises(plugins.PluginError) as info:
        plugins.build_plugin_manager(entry_points=[_fake_entry_point(monkeypatch, "typo", module)])
    message = str(info.value)
    assert "plugin 'typo' implements unknown hook 'make_atention'" in message
    assert "did you mean 'make_attention'?" in message
    assert "DEEPINFER_PLUGINS_BLOCK=typo" in message


def test_hookimpl_with_an_unknown_argument_is_rejected(monkeypatch):
    module = _module("badarg_hooks_for_test", make_moe=hookimpl(lambda spec, devise: None))
    with pytest.raises(plugins.PluginError, match="plugin 'badarg' is invalid.*devise"):
        plugins.build_plugin_manager(entry_points=[_fake_entry_point(monkeypatch, "badarg", module)])


def test_wrapper_on_a_factory_hook_is_rejected(isolated_plugin_manager):
    class Wrapper:
        @hookimpl(wrapper=True)
        def make_attention(self, spec, device):
            return (yield)

    isolated_plugin_manager.register(Wrapper(), name="wrapper")
    with pytest.raises(plugins.PluginError, match="'wrapper' wraps 'make_attention'"):
        plugins.check_plugins(isolated_plugin_manager)


def test_plugin_failing_to_import_is_named(monkeypatch):
    entry_point = importlib.metadata.EntryPoint(name="ghost", value="no_such_module_for_test", group="deepinfer")
    with pytest.raises(plugins.PluginError, match="plugin 'ghost' .* failed to import"):
        plugins.build_plugin_manager(entry_points=[entry_point])


def test_manager_is_built_once_per_process_and_reads_the_env(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLUGINS_BLOCK", "ascend950, recipe")
    plugins.reset_plugin_manager()
    try:
        manager = plugins.get_plugin_manager()
        assert plugins.get_plugin_manager() is manager
        assert manager.has_plugin("reference")
        assert not manager.has_plugin("ascend950")
        assert not manager.has_plugin("recipe")
    finally:
        plugins.reset_plugin_manager()
    monkeypatch.delenv("DEEPINFER_PLUGINS_BLOCK")
    assert plugins.get_plugin_manager() is not manager


# ------------------------------------------------------------------------------------------------ report, tracing


def test_no_trace_without_the_switch(isolated_plugin_manager, capsys):
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    plugins.make_attention(ATTENTION, CPU)
    assert capsys.readouterr().err == ""


def test_trace_prints_each_call_and_its_answer(monkeypatch, capsys):
    # the switch is read when the process-wide manager is built; allow no entry-point plugin here
    monkeypatch.setenv("DEEPINFER_TRACE_PLUGINS", "1")
    monkeypatch.setenv("DEEPINFER_PLUGINS_ALLOW", "")
    plugins.reset_plugin_manager()
    wide = AttentionSpec(num_heads=2, head_dim=8, sliding_window=16, compress_rate=0)
    try:
        plugins.get_plugin_manager().register(ChipPlugin(), name="chip")
        plugins.make_attention(ATTENTION, CPU)
        plugins.make_attention(wide, CPU)
    finally:
        plugins.reset_plugin_manager()
    err = capsys.readouterr().err
    assert err.count("make_attention [hook]") == 2
    assert f"spec: {ATTENTION}" in err and f"spec: {wide}" in err
    assert "finish make_attention --> <" in err
    assert "ChipAttention object" in err and "ReferenceAttention object" in err
    assert "make_attention answered by chip; declined: none [hook]" in err
    assert "make_attention answered by reference; declined: chip: only sliding_window=4 is supported [hook]" in err


def test_graph_api_comes_from_a_plugin_for_its_device_and_the_reference_serves_cuda(isolated_plugin_manager):
    from deepinfer_core.backends import GraphApi

    mine = GraphApi(Graph=object, graph=None, Stream=object, stream=None, current_stream=None, synchronize=None)

    class Chip:
        @hookimpl
        def graph_api(self, device, decline):
            if device.type != "meta":
                decline("only meta graphs here")
                return None
            return mine

    isolated_plugin_manager.register(Chip(), name="chip")
    assert plugins.graph_api(torch.device("meta")) is mine
    assert plugins.graph_api(torch.device("cpu")) is None  # everyone declines: decode runs eagerly
    outcome = plugins.ask("graph_api", device=torch.device("cpu"))
    assert outcome.declines == {"chip": "only meta graphs here",
                                "reference": "the reference captures graphs only on CUDA devices, not 'cpu'"}
    assert plugins.graph_api(torch.device("cuda")).Graph is torch.cuda.CUDAGraph


def test_memory_counters_come_from_the_first_plugin_that_offers_them(isolated_plugin_manager):
    from deepinfer_core.backends import MemoryCounters

    mine = MemoryCounters(mem_get_info=lambda: (1, 2), allocated=int, reserved=int, peak_allocated=int,
                          reset_peak=lambda: None, synchronize=lambda: None, empty_cache=lambda: None)

    class Chip:
        @hookimpl
        def memory_counters(self, device, decline):
            if device.type != "meta":
                decline("only meta memory here")
                return None
            return mine

    isolated_plugin_manager.register(Chip(), name="chip")
    assert plugins.memory_counters(torch.device("meta")) is mine
    assert plugins.memory_counters(CPU) is None  # everyone declines: the peak is not measured
    assert plugins.ask("memory_counters", device=CPU).declines == {
        "chip": "only meta memory here",
        "reference": "the reference reads no allocator counters (a hardware plugin offers its device's)"}


def test_memory_counters_must_be_memory_counters(isolated_plugin_manager):
    class Broken:
        @hookimpl
        def memory_counters(self, device, decline):
            return {"peak": 1}

    isolated_plugin_manager.register(Broken(), name="broken")
    with pytest.raises(plugins.PluginError, match="'broken' returned dict from memory_counters"):
        plugins.memory_counters(CPU)


def test_graph_api_must_be_a_graph_api(isolated_plugin_manager):
    class Broken:
        @hookimpl
        def graph_api(self, device, decline):
            return "a string"

    isolated_plugin_manager.register(Broken(), name="broken")
    with pytest.raises(plugins.PluginError, match="'broken' returned str from graph_api"):
        plugins.graph_api(torch.device("cpu"))
