"""Specification of angel_ptm.config: defaults, YAML, overrides, sizes, validation and round trips."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from angel_ptm.config import (
    Config,
    MemoryConfig,
    ModelConfig,
    config_to_dict,
    format_bytes,
    load_config,
    parse_bytes,
    save_config,
)
from angel_ptm.errors import ConfigError, ConfigTypeError, ConfigValueError, UnknownKeyError

MiB = 1024**2


# --- defaults ---------------------------------------------------------------------------------------------------
def test_no_source_gives_the_documented_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.n_layer == 4 and cfg.model.n_kv_head is None
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.memory.page_bytes == 64 * MiB
    assert cfg.memory.device_budget == "auto"
    assert cfg.memory.disk_dir is None
    assert cfg.trainer.dtype == "float32"
    assert cfg.run.name == "default"


# --- YAML files -------------------------------------------------------------------------------------------------
def test_yaml_file_sets_fields_and_leaves_the_rest_default(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("model:\n  n_layer: 2\n  dim: 128\nmemory:\n  page_bytes: 4MiB\n  host_budget: 2GB\n")
    cfg = load_config(path)
    assert cfg.model.n_layer == 2
    assert cfg.model.dim == 128
    assert cfg.memory.page_bytes == 4194304
    assert cfg.memory.host_budget == 2000000000
    assert cfg.model.n_head == 4


def test_yaml_path_may_be_a_string(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  steps: 7\n")
    assert load_config(str(path)).trainer.steps == 7


def test_missing_yaml_file_raises_config_error_naming_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        load_config(path)


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(path)


# --- overrides --------------------------------------------------------------------------------------------------
def test_overrides_are_read_as_yaml_into_the_field_types():
    cfg = load_config(overrides=["trainer.steps=10", "memory.disk_dir=/tmp/x", "optimizer.betas=[0.9,0.99]"])
    assert cfg.trainer.steps == 10
    assert cfg.memory.disk_dir == "/tmp/x"
    assert cfg.optimizer.betas == (0.9, 0.99)


def test_override_in_exponent_notation_without_a_dot_becomes_a_float():
    # PyYAML reads "3e-4" as a string; a float field must still get 0.0003.
    lr = load_config(overrides=["optimizer.lr=3e-4"]).optimizer.lr
    assert lr == 0.0003
    assert type(lr) is float


def test_override_of_a_size_parses_the_unit():
    assert load_config(overrides=["memory.host_budget=8GiB"]).memory.host_budget == 8 * 1024**3


def test_override_of_a_text_field_keeps_the_text_even_when_it_looks_numeric():
    assert load_config(overrides=["run.name=2024"]).run.name == "2024"


def test_overrides_apply_on_top_of_a_dict_source_without_changing_it():
    source = {"optimizer": {"lr": 0.01}}
    cfg = load_config(source, overrides=["optimizer.lr=0.5"])
    assert cfg.optimizer.lr == 0.5
    assert source == {"optimizer": {"lr": 0.01}}


def test_overrides_apply_to_a_config_source():
    cfg = load_config(Config(), overrides=["model.n_layer=8"])
    assert cfg.model.n_layer == 8


def test_override_without_equals_sign_is_a_config_error():
    with pytest.raises(ConfigError, match="override 'optimizer.lr'"):
        load_config(overrides=["optimizer.lr"])


# --- sizes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4MiB", 4194304),
        ("2GB", 2000000000),
        ("512KiB", 524288),
        ("1.5GiB", 1610612736),
        ("4096", 4096),
        ("64 MiB", 67108864),
        ("2g", 2147483648),
        ("3kb", 3000),
        ("1tib", 1099511627776),
    ],
)
def test_size_strings_parse_to_bytes(text, expected):
    assert parse_bytes(text, "k") == expected


def test_sizes_accept_ints_and_whole_floats():
    assert parse_bytes(4096, "k") == 4096
    assert parse_bytes(4096.0, "k") == 4096


def test_negative_size_is_a_value_error_naming_the_key():
    with pytest.raises(ConfigValueError, match=r"^memory\.page_bytes: must be a size >= 0, got -1$"):
        parse_bytes(-1, "memory.page_bytes")


@pytest.mark.parametrize("text", ["4XB", "MiB", "", "4 Mi B", "1.5B"])
def test_malformed_size_string_is_a_value_error_naming_the_key(text):
    with pytest.raises(ConfigValueError, match=r"^memory\.page_bytes: "):
        parse_bytes(text, "memory.page_bytes")


def test_size_of_wrong_type_is_a_type_error():
    with pytest.raises(ConfigTypeError, match=r"^k: expected a byte size"):
        parse_bytes(True, "k")


def test_sizes_up_to_one_exbibyte_are_accepted():
    assert parse_bytes(2**60, "k") == 2**60
    assert parse_bytes("1048576TiB", "k") == 2**60


@pytest.mark.parametrize("value", [2**60 + 1, "1e400", "1.0e400", "1048577TiB"])
def test_a_size_past_one_exbibyte_is_a_value_error_naming_the_key(value):
    with pytest.raises(ConfigValueError) as info:
        parse_bytes(value, "memory.page_bytes")
    assert str(info.value) == f"memory.page_bytes: must be at most 2**60 bytes (1 EiB), got {value!r}"


@pytest.mark.parametrize("override", ["memory.device_budget=1e400", "memory.host_budget=1.0e400",
                                      "memory.disk_budget=1152921504606846977"])
def test_a_budget_past_one_exbibyte_is_refused_naming_the_key(override):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigValueError) as info:
        load_config(overrides=[override])
    shown = repr(int(value)) if value.isdigit() else repr(value)
    assert str(info.value) == f"{key}: must be at most 2**60 bytes (1 EiB), got {shown}"


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_an_infinite_or_nan_budget_is_refused_naming_the_key(value):
    with pytest.raises(ConfigValueError) as info:
        load_config({"memory": {"device_budget": value}})
    assert str(info.value) == f'memory.device_budget: must be "auto" or a finite size, got {value!r}'


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=2**50))
def test_plain_and_kib_sizes_round_trip(n):
    assert parse_bytes(str(n), "k") == n
    assert parse_bytes(f"{n}KiB", "k") == n * 1024


def test_format_bytes_uses_the_largest_binary_unit():
    assert format_bytes(64 * MiB) == "64.0 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(512) == "512 B"


# --- unknown keys -----------------------------------------------------------------------------------------------
def test_misspelled_key_suggests_the_right_one():
    with pytest.raises(UnknownKeyError) as info:
        load_config({"memory": {"host_budgt": "1GiB"}})
    assert str(info.value) == "unknown config key 'memory.host_budgt' (did you mean memory.host_budget?)"


def test_key_in_the_wrong_section_suggests_where_it_belongs():
    with pytest.raises(UnknownKeyError) as info:
        load_config({"host_budget": "1GiB"})
    assert str(info.value) == "unknown config key 'host_budget' (did you mean memory.host_budget?)"


def test_unknown_override_key_suggests_the_right_one():
    with pytest.raises(UnknownKeyError, match=r"\(did you mean trainer\.steps\?\)$"):
        load_config(overrides=["trainer.stpes=5"])


def test_unknown_key_without_a_close_match_lists_the_section():
    with pytest.raises(UnknownKeyError, match=r"valid keys in optimizer: name, lr, betas"):
        load_config({"optimizer": {"learning_rate": 1}})


# --- types ------------------------------------------------------------------------------------------------------
def test_wrong_type_names_the_key_the_expected_type_and_the_value():
    with pytest.raises(ConfigTypeError) as info:
        load_config({"model": {"n_layer": "abc"}})
    assert str(info.value) == "model.n_layer: expected int, got 'abc' (str)"


def test_int_field_rejects_bools():
    with pytest.raises(ConfigTypeError, match=r"^trainer\.steps: expected int, got True"):
        load_config({"trainer": {"steps": True}})


def test_int_field_accepts_a_whole_float_and_float_field_accepts_an_int():
    cfg = load_config({"model": {"n_layer": 3.0}, "optimizer": {"lr": 1}})
    assert cfg.model.n_layer == 3 and type(cfg.model.n_layer) is int
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float


def test_tuple_field_needs_the_right_length():
    with pytest.raises(ConfigTypeError, match=r"^optimizer\.betas: expected list of 2 floats, got \[0\.9\]"):
        load_config({"optimizer": {"betas": [0.9]}})


def test_optional_field_accepts_null():
    assert load_config({"trainer": {"grad_clip": None}}).trainer.grad_clip is None


def test_choice_outside_its_choices_is_a_value_error():
    with pytest.raises(ConfigValueError) as info:
        load_config({"trainer": {"dtype": "float64"}})
    assert str(info.value) == "trainer.dtype: must be one of \"float32\", \"bfloat16\", \"float16\", got 'float64'"


# --- values -----------------------------------------------------------------------------------------------------
def test_negative_budget_is_a_value_error_naming_memory_device_budget():
    with pytest.raises(ConfigValueError) as info:
        load_config({"memory": {"device_budget": -5}})
    assert str(info.value) == 'memory.device_budget: must be "auto" or a size >= 0, got -5'


def test_page_bytes_not_a_multiple_of_4096_is_rejected():
    with pytest.raises(ConfigValueError, match=r"^memory\.page_bytes: must be a positive multiple of 4096, got 5000$"):
        load_config({"memory": {"page_bytes": 5000}})


def test_dim_not_divisible_by_n_head_is_rejected():
    with pytest.raises(ConfigValueError, match=r"^model\.dim: must be divisible by model\.n_head \(4\), got 250$"):
        load_config({"model": {"dim": 250}})


def test_n_head_not_divisible_by_n_kv_head_is_rejected():
    with pytest.raises(ConfigValueError, match=r"^model\.n_kv_head: must be a divisor of model\.n_head \(4\), got 3$"):
        load_config({"model": {"n_kv_head": 3}})


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("model", "n_layer", 0),
        ("data", "batch_size", -1),
        ("data", "val_fraction", 1.0),
        ("optimizer", "lr", -1e-3),  # (0 is allowed, as torch.optim.AdamW allows it)
        ("optimizer", "eps", float("inf")),
        ("optimizer", "betas", [0.9, 1.0]),
        ("optimizer", "weight_decay", -0.1),
        ("memory", "io_threads", 0),
        ("trainer", "grad_accum", 0),
        ("parallel", "moe_a2a", "hierarchical"),  # (with ep 1: nothing exchanges tokens)
        ("parallel", "moe_rebalance_every", 4),
    ],
)
def test_impossible_values_are_value_errors_naming_the_key(section, name, value):
    with pytest.raises(ConfigValueError, match=rf"^{section}\.{name}: must be "):
        load_config({section: {name: value}})


@pytest.mark.parametrize(("name", "value", "bound"), [("io_threads", 65, 64), ("io_threads", 1_000_000, 64),
                                                     ("queue_depth", 1025, 1024), ("queue_depth", 0, 1024)])
def test_io_threads_and_queue_depth_are_bounded_naming_the_key(name, value, bound):
    with pytest.raises(ConfigValueError) as info:
        load_config({"memory": {name: value}})
    assert str(info.value) == f"memory.{name}: must be from 1 to {bound}, got {value}"


def test_the_largest_io_threads_and_queue_depth_are_accepted():
    memory = load_config({"memory": {"io_threads": 64, "queue_depth": 1024}}).memory
    assert (memory.io_threads, memory.queue_depth) == (64, 1024)


def test_trace_max_bytes_defaults_to_256_mib_and_may_be_null():
    assert load_config().trace.max_bytes == 256 * MiB
    assert load_config(overrides=["trace.max_bytes=1GiB"]).trace.max_bytes == 1024 * MiB
    assert load_config(overrides=["trace.max_bytes=null"]).trace.max_bytes is None
    with pytest.raises(ConfigValueError, match=r"^trace\.max_bytes: must be a size >= 0, got -1$"):
        load_config({"trace": {"max_bytes": -1}})


def test_sections_built_in_python_are_validated_too():
    with pytest.raises(ConfigValueError, match=r"^model\.dim: "):
        ModelConfig(dim=250)
    assert MemoryConfig(page_bytes="8MiB").page_bytes == 8 * MiB


# --- round trips ------------------------------------------------------------------------------------------------
def test_config_to_dict_is_plain_data_and_loads_back_equal():
    cfg = load_config(overrides=["memory.host_budget=3GiB", "model.n_kv_head=2", "run.dir=/tmp/run"])
    data = config_to_dict(cfg)
    assert data["optimizer"]["betas"] == [0.9, 0.95]
    assert data["memory"]["page_bytes"] == 67108864
    assert load_config(data) == cfg


def test_save_config_writes_a_file_that_loads_back_equal(tmp_path):
    cfg = load_config(overrides=["optimizer.lr=3e-4", "memory.device_budget=1GiB", "trainer.grad_clip=null"])
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert os.listdir(path.parent) == ["config.yaml"]  # no temporary file left behind


def test_osdp_needs_zero_3_and_staleness_0(tmp_path):
    with pytest.raises(ConfigValueError, match=r"^parallel\.osdp: must be false unless zero is 3"):
        load_config(None, ["parallel.zero=2", "parallel.osdp=true"])
    assert load_config(None, ["parallel.osdp=true"]).parallel.osdp is True
    import angel_ptm
    from torch import nn

    config = {"parallel": {"osdp": True}, "optimizer": {"staleness": 1}, "memory": {"disk_dir": str(tmp_path)}}
    with pytest.raises(ConfigValueError, match=r"^parallel\.osdp: true needs optimizer\.staleness 0"):
        angel_ptm.initialize(nn.Linear(4, 4), config)


def test_checkpoint_async_is_another_spelling_of_async_save():
    assert load_config({"checkpoint": {"async": True}}).checkpoint.async_save is True
    assert load_config(None, ["checkpoint.async=true"]).checkpoint.async_save is True
    with pytest.raises(ConfigError, match="checkpoint.async and checkpoint.async_save"):
        load_config({"checkpoint": {"async": True, "async_save": False}})


def test_checkpoint_async_max_gbps_is_positive_auto_or_null():
    assert load_config({"checkpoint": {"async_max_gbps": 0.5}}).checkpoint.async_max_gbps == 0.5
    assert load_config(None, ["checkpoint.async_max_gbps=2"]).checkpoint.async_max_gbps == 2.0
    assert load_config({"checkpoint": {"async_max_gbps": "Auto"}}).checkpoint.async_max_gbps == "auto"
    assert load_config(None).checkpoint.async_max_gbps == "auto"  # (the default)
    assert load_config({"checkpoint": {"async_max_gbps": None}}).checkpoint.async_max_gbps is None
    for bad in (0, -1, "fast", [1]):
        with pytest.raises(ConfigError, match="checkpoint.async_max_gbps"):
            load_config({"checkpoint": {"async_max_gbps": bad}})


def test_keys_without_effect_in_this_job_are_said_once_and_a_null_lr_schedule_spells_out_nothing(caplog,
                                                                                                  monkeypatch):
    import dataclasses
    import logging

    from angel_ptm.config import combinations

    monkeypatch.setattr(combinations, "_warned", set())  # (said once per process: other tests said some already)

    from angel_ptm.lr import schedule_given

    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        config = load_config({"optimizer": {"loss_scale": 512}, "trainer": {"dtype": "bfloat16"},
                              "data": {"token_dtype": "uint32"}})
        dataclasses.replace(config, run=dataclasses.replace(config.run, name="again"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["optimizer.loss_scale 512.0 has no effect: loss scaling is for trainer.dtype float16 only "
                        "(this job: bfloat16)",
                        "data.token_dtype uint32 has no effect: it is the element type of a data.kind tokens file "
                        "(this job reads text)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):  # the dynamic scale's keys, where nothing is dynamic
        load_config({"optimizer": {"loss_scale": 64, "loss_scale_growth": 3}, "trainer": {"dtype": "float16"}})
        load_config({"optimizer": {"loss_scale_backoff": 0.25}, "trainer": {"dtype": "bfloat16"}})
        load_config({"optimizer": {"loss_scale_initial": 8}, "trainer": {"dtype": "float16"}})  # (it acts here)
    assert [r.getMessage() for r in caplog.records] == [
        "optimizer.loss_scale_growth 3 has no effect: it drives the dynamic loss scale of trainer.dtype float16 "
        "(this job: float16, optimizer.loss_scale 64.0)",
        "optimizer.loss_scale_backoff 0.25 has no effect: it drives the dynamic loss scale of trainer.dtype float16 "
        "(this job: bfloat16, optimizer.loss_scale dynamic)"]
    caplog.clear()
    # (checkpoint.async_max_gbps without async_save is no such key: it paces save_checkpoint(background=True))
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):  # keys whose section does not run in this job
        load_config({"activations": {"offload_min_bytes": "1KiB"}, "memory": {"lookahead": 3, "scheduler": "on_demand"},
                     "checkpoint": {"async_max_gbps": 1}, "trainer": {"eval_every": 0, "eval_steps": 2},
                     "optimizer": {"overlap_updates": False}})
        load_config({"model": {"moe": {"experts": 4, "gate": "hash", "z_loss_weight": 1, "groups": 4,
                                       "dts_threshold": 0.3}}})
    assert [r.getMessage().split(" has no effect")[0] for r in caplog.records] == [
        "activations.offload_min_bytes 1024", "memory.lookahead 3",
        "optimizer.overlap_updates false", "model.moe.dts_threshold", "model.moe.groups",
        "model.moe.z_loss_weight"]
    assert not schedule_given(load_config({"lr_schedule": None}))
    assert schedule_given(load_config({"lr_schedule": {"warmup_steps": 3}}))
    # a schedule set in code on a loaded config (given_sections says the source had none) is spelled out too
    loaded = load_config({"optimizer": {"lr": 0.01}})
    assert not schedule_given(loaded)
    loaded.lr_schedule = type(loaded.lr_schedule)(warmup_steps=4, decay="constant")
    assert schedule_given(loaded)


def test_async_save_without_periodic_checkpoints_is_said_and_reserves_nothing(caplog):
    import logging

    from angel_ptm.config import combinations
    from angel_ptm.config.combinations import engine_config_for_trainer

    combinations._warned.clear()  # (said once per process: another test may have said it)
    config = load_config({"checkpoint": {"async_save": True, "every": 0}})
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        assert engine_config_for_trainer(config).checkpoint.async_save is False
    assert any("checkpoint.async_save has no effect: checkpoint.every is 0" in r.getMessage() for r in caplog.records)
    kept = load_config({"checkpoint": {"async_save": True, "every": 5}})
    assert engine_config_for_trainer(kept) is kept


def test_initialize_says_once_which_keys_only_the_trainers_loop_uses(caplog, tmp_path):
    """A script's `angel_ptm.initialize` given trainer-only keys (a job.yaml shared with `angel-ptm train`) warns
    that they change nothing; keys the engine uses, defaults, and the trainer's own engine say nothing."""
    import logging

    from torch import nn

    import angel_ptm
    from angel_ptm.config import combinations

    combinations._warned.clear()
    memory = {"disk_dir": str(tmp_path / "pages"), "page_bytes": "4KiB"}
    given = {"memory": memory, "trainer": {"device": "cpu", "seed": 7, "steps": 50}, "model": {"dim": 64},
             "data": {"batch_size": 2, "path": "/data"}, "checkpoint": {"keep": 5, "every": 10},
             "run": {"name": "mine", "dir": str(tmp_path / "run")}}
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        engine = angel_ptm.initialize(nn.Linear(4, 4), given)
        engine.close()
        angel_ptm.initialize(nn.Linear(4, 4), {"memory": memory, "trainer": {"device": "cpu"}}).close()
    said = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    assert said == ["angel_ptm.initialize does not use model.dim, data.path, trainer.seed, run.name, checkpoint.keep: "
                    "only `angel-ptm train`'s loop acts on them (its model, data, evaluation, logging, seeding, run "
                    "and checkpoint rotation); set here they change nothing"]
    assert combinations.warn_trainer_only(load_config({"trainer": {"steps": 9, "grad_accum": 2}})) == []


@pytest.mark.parametrize("job, message", [
    ({"model": {"n_layer": 2, "moe": {"experts": 4, "every": 3}}},
     r"model.moe.every: 3 is more than model.n_layer \(2\): no block would be an MoE layer"),
    ({"model": {"moe": {"gate": "dts", "dts_start_temperature": 0}}}, "model.moe.dts_start_temperature: must be > 0"),
    ({"model": {"moe": {"gate": "dts", "dts_decay_steps": 0}}}, "model.moe.dts_decay_steps: must be > 0"),
    ({"model": {"moe": {"gate": "dts", "dts_threshold": -1}}}, "model.moe.dts_threshold: must be >= 0 and < 1"),
    ({"model": {"moe": {"aux_loss_weight": -100}}}, "model.moe.aux_loss_weight: must be >= 0"),
    ({"optimizer": {"staleness": 1}, "parallel": {"osdp": True}}, "parallel.osdp: true needs optimizer.staleness 0"),
    ({"model": {"seq_len": 33}, "parallel": {"tp": 2, "sequence_parallel": True}},
     "parallel.sequence_parallel: model.seq_len 33 does not divide over tp 2"),
])
def test_settings_that_cannot_train_as_asked_are_refused_when_the_config_loads(job, message):
    """A dense model where MoE was asked (every > n_layer), a division by a zero temperature at the first forward,
    a negative aux loss weight trained on (loss -194), OSDP with staleness 1 accepted by estimate: now refused by
    load_config, so estimate, train and initialize all refuse them."""
    with pytest.raises(ConfigValueError, match=message):
        load_config(job)


def test_moe_keys_are_said_unused_only_where_the_job_sets_them(caplog, monkeypatch):
    """A completed model.moe mapping (every field, as moe_settings returns it) is read again as a job is set up:
    its keys at their defaults are not keys the user set (every MoE job used to warn of dts_* and groups). BASE
    gives each expert exactly its share, so a capacity factor does nothing there; the rebalancing's knobs do
    nothing with it off."""
    import logging

    from angel_ptm.config import combinations
    from angel_ptm.models.moe import moe_settings

    monkeypatch.setattr(combinations, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        moe_settings(moe_settings({"experts": 4, "gate": "gshard"}))
        load_config({"model": {"moe": {"experts": 4}}})
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="angel_ptm"):
        moe_settings({"experts": 4, "gate": "base", "capacity_factor": 0.5})
        load_config({"parallel": {"moe_rebalance_threshold": 2.0, "moe_rebalance_ema": 0.9}})
        load_config({"parallel": {"moe_rebalance_threshold": 2.0, "moe_rebalance_every": 4, "ep": 2}})  # (acts)
    assert [r.getMessage().split(" has no effect")[0] for r in caplog.records] == [
        "model.moe.capacity_factor", "parallel.moe_rebalance_threshold 2", "parallel.moe_rebalance_ema 0.9"]
