"""Every config value is checked where the config is read (issue 31): a wrong type or a value out of range stops the
load with one `config:` line naming the key, never a TypeError or a job that breaks later (`hang_timeout_s: 0` once
declared every engine hung at once)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from conftest import DEMO_CONFIG

from job.config import (
    LIMITS,
    ConfigError,
    GenerateConfig,
    HiddenStatesConfig,
    QualityConfig,
    RunConfig,
    load_config,
    value_kinds,
)
from job.storage import StorageConfig

SECTIONS = {"": RunConfig, "generate": GenerateConfig, "quality": QualityConfig, "hidden_states": HiddenStatesConfig,
            "storage": StorageConfig}


def numeric_keys() -> list[str]:
    """Every int or float setting of every section, as a dotted key."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds, _ = value_kinds(hints[f.name])
            if kinds & {int, float} and bool not in kinds:
                out.append(f"{section}.{f.name}".lstrip("."))
    return out


KEYS = numeric_keys()


def test_every_numeric_setting_is_walked():
    names = set(KEYS)
    assert {"generate.hang_timeout_s", "quality.canary_rows", "hidden_states.batch_tokens", "storage.retry_base_s",
            "limit"} <= names
    assert set(LIMITS) <= names, "a LIMITS entry names no setting"


@pytest.mark.parametrize("key", KEYS)
def test_zero_negative_and_wrong_type_are_refused_naming_the_key(key):
    low, _ = LIMITS.get(key, (0, None))
    for bad in (-1, "seven", True, [3]):
        with pytest.raises(ConfigError, match=rf"^config: {key.replace('.', '[.]')} must be"):
            load_config(DEMO_CONFIG, **{key: bad})
    if low is not None and low > 0:  # 0 is out of this setting's range
        with pytest.raises(ConfigError, match=rf"^config: {key.replace('.', '[.]')} must be"):
            load_config(DEMO_CONFIG, **{key: 0})
    else:  # 0 means something (its docstring says what): it loads, as 0 (this used to pass refused or not)
        section, _, name = key.rpartition(".")
        loaded = load_config(DEMO_CONFIG, **{key: 0})
        assert getattr(getattr(loaded, section) if section else loaded, name) == 0


def test_booleans_and_combinations():
    with pytest.raises(ConfigError, match="generate.enable_thinking must be true or false"):
        load_config(DEMO_CONFIG, **{"generate.enable_thinking": "yes"})
    with pytest.raises(ConfigError, match="hidden_states.min_rms .* must be below max_rms"):
        load_config(DEMO_CONFIG, **{"hidden_states.min_rms": 1e5})
    with pytest.raises(ConfigError, match="batch_tokens .* must be at least max_length"):
        load_config(DEMO_CONFIG, **{"hidden_states.batch_tokens": 8, "hidden_states.max_length": 16})
    assert load_config(DEMO_CONFIG, **{"generate.hang_timeout_s": 0}).generate.hang_timeout_s == 0  # no watchdog


def test_max_num_seqs_is_a_positive_int_or_auto():
    for bad in (0, "lots", True, 2.5):
        with pytest.raises(ConfigError, match="^config: engine_kwargs.max_num_seqs must be a positive int or 'auto'"):
            load_config(DEMO_CONFIG, **{"engine_kwargs.max_num_seqs": bad})
    assert load_config(DEMO_CONFIG, **{"engine_kwargs.max_num_seqs": "auto"}).engine_kwargs["max_num_seqs"] == "auto"


def test_regenerate_modes_and_sampling_variants():
    assert load_config(DEMO_CONFIG, **{"generate.regenerate": "conversation"}).generate.regenerate == "conversation"
    with pytest.raises(ConfigError, match="^config: generate.regenerate must be one of last_turn, "
                                          "every_assistant_turn, conversation, none, got 'turns'"):
        load_config(DEMO_CONFIG, **{"generate.regenerate": "turns"})
    variants = [{"temperature": 0.6}, {"temperature": 1.0, "enable_thinking": False}]
    assert load_config(DEMO_CONFIG, **{"generate.sampling_variants": variants}).generate.sampling_variants == variants
    key = "^config: generate.sampling_variants"
    for bad, words in [({"temperature": 0.6}, " must be a list of sampling settings"),
                       ([{"temperature": 0.6}, {}], r"\[1\] must be a non-empty mapping"),
                       (["hot"], r"\[0\] must be a non-empty mapping"),
                       ([{"enable_thinking": "no"}], r"\[0\].enable_thinking must be true or false, got 'no'"),
                       ([{"n": 2}], r"\[0\] may not set 'n'"), ([{"seed": 3}], r"\[0\] may not set 'seed'")]:
        with pytest.raises(ConfigError, match=key + words):
            load_config(DEMO_CONFIG, **{"generate.sampling_variants": bad})
    with pytest.raises(ConfigError, match=f"{key} varies sampling, and generate.regenerate: none samples nothing"):
        load_config(DEMO_CONFIG, **{"generate.sampling_variants": variants, "generate.regenerate": "none"})
