"""The typed config: a bad value or an unknown key fails at load time, naming the key."""

from __future__ import annotations

import pytest

from actors.app.config import ConfigError, EngineConfig, parse_overrides


def test_defaults_load_and_overrides_apply():
    cfg = EngineConfig.load(overrides={"kv.num_pages": 64, "scheduler.policy": "lpm"})
    assert cfg.kv.num_pages == 64 and cfg.scheduler.policy == "lpm"
    assert EngineConfig.load(kv__page_size=4).kv.page_size == 4
    assert EngineConfig.load(overrides={"engine.groups.runner": "gpu"}).engine.groups == {
        "runner": "gpu"
    }


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"kv.num_pages": "abc"}, "kv.num_pages"),
        ({"kv.no_such_key": 1}, "unknown config key kv.no_such_key"),
        ({"nosection.key": 1}, "unknown config key nosection.key"),
        ({"model.dtype": "int3"}, "model.dtype"),
        ({"engine.debug_checks": "sometimes"}, "engine.debug_checks"),
        ({"kv.max_rows": 2}, "kv.max_rows"),
        ({"scheduler.max_batch_tokens": 8}, "scheduler.max_batch_tokens"),
    ],
)
def test_bad_values_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        EngineConfig.load(overrides=overrides)


def test_unknown_key_in_a_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[kv]\npage_size = 16\nnum_pagez = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key kv\.num_pagez"):
        EngineConfig.load(path)


def test_parse_overrides_reads_toml_scalars_and_keeps_raw_strings():
    assert parse_overrides(
        [
            "kv.num_pages=64",
            "engine.debug_checks=true",
            "model.path=/x/y.gguf",
            'server.model_name="m"',
        ]
    ) == {
        "kv.num_pages": 64,
        "engine.debug_checks": True,
        "model.path": "/x/y.gguf",
        "server.model_name": "m",
    }
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["num_pages"])


def test_a_tensor_parallel_pool_is_sized_by_pages_not_memory():
    EngineConfig.load(parallel__tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor-parallel pool"):
        EngineConfig.load(parallel__tensor_parallel_size=2, kv__memory_fraction=0.5)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig.load(parallel__tensor_parallel_size=0)
