"""The settings base (draftsmith/settings.py): schema defaults, did-you-mean for unknown keys, frozen values,
whole-config input, validation in ``__post_init__``, ``replace``; and every stage's settings class against
the keys :data:`draftsmith.stages.STAGE_KEYS` lists for its rule."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, Mapping

import pytest
import yaml

from draftsmith.assets import FetchDatasetSettings, FetchTargetSettings, MaterializeTargetSettings
from draftsmith.config import check_config, schema_defaults
from draftsmith.curate import CurateSettings
from draftsmith.evaluate.settings import EvaluateSettings
from draftsmith.export import ExportError, ExportSettings
from draftsmith.extract.plan import ExtractPlanSettings
from draftsmith.extract.shard import ExtractHeldoutSettings, ExtractShardSettings, ExtractSliceSettings
from draftsmith.merge import MergeSettings, MergeSliceSettings
from draftsmith.regenerate.settings import RegenerateSettings, RegenerateShardSettings
from draftsmith.settings import SectionSettings, StageSettings
from draftsmith.stages import STAGE_KEYS, rule_params
from draftsmith.stream import DiskPlanSettings, StreamPlanSettings
from draftsmith.tokenize import TokenizeOptions, TokenizeSettings
from draftsmith.train.settings import TrainPhaseSettings, TrainSettings

REPO = Path(__file__).resolve().parents[1]

#: every StageSettings class declared beside the code that reads it
DECLARED = [FetchDatasetSettings, FetchTargetSettings, MaterializeTargetSettings, CurateSettings, DiskPlanSettings,
            RegenerateShardSettings, RegenerateSettings, TokenizeSettings, ExtractPlanSettings, ExtractShardSettings,
            MergeSettings, TrainSettings, StreamPlanSettings, ExtractHeldoutSettings, ExtractSliceSettings,
            MergeSliceSettings, TrainPhaseSettings, ExportSettings, EvaluateSettings]


def test_every_rule_has_one_settings_class():
    """Each rule of STAGE_KEYS reads its keys through exactly one declared settings class."""
    assert sorted(cls.STAGE for cls in DECLARED) == sorted(STAGE_KEYS)


# ------------------------------------------------------------------------------------------------
# test-only settings classes (module level: StageSettings resolves its fields' annotations here)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataKeys(SectionSettings):
    SECTION: ClassVar[str] = "data"
    seed: int
    sources: tuple


@dataclasses.dataclass(frozen=True)
class TokenizeKeys(SectionSettings):
    SECTION: ClassVar[str] = "tokenize"
    max_length: int
    chat_template_kwargs: Mapping[str, Any]

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"tokenize.max_length must be >= 2, got {self.max_length}")


@dataclasses.dataclass(frozen=True)
class Probe(StageSettings):
    data: DataKeys
    tokenize: TokenizeKeys


@dataclasses.dataclass(frozen=True)
class Misnamed(StageSettings):
    data: TokenizeKeys  # the field names the section: a tokenize class cannot hold data


SOURCES = [{"name": "a", "path": "a.jsonl", "adapter": "openai", "options": {"languages": ["en", "fr"]}}]


@pytest.fixture(scope="module")
def config() -> dict:
    """``config.yaml`` as the workflow sees it: validated, every schema default filled in."""
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    check_config(config, str(REPO / "schemas" / "config.schema.yaml"))
    return config


# ------------------------------------------------------------------------------------------------
# the base
# ------------------------------------------------------------------------------------------------


def test_missing_keys_take_the_schema_defaults():
    data = schema_defaults("data")
    tok = schema_defaults("tokenize")
    assert DataKeys.from_mapping() == DataKeys(seed=data["seed"], sources=tuple(data["sources"]))
    got = TokenizeKeys.from_mapping({"max_length": 7})
    assert (got.max_length, dict(got.chat_template_kwargs)) == (7, tok["chat_template_kwargs"])
    probe = Probe.from_config({"tokenize": {"max_length": 9}})
    assert probe.data.seed == data["seed"] and probe.tokenize.max_length == 9
    assert Probe.keys() == {"data": ("seed", "sources"), "tokenize": ("max_length", "chat_template_kwargs")}


def test_an_unknown_key_is_refused_naming_the_closest_one():
    with pytest.raises(ValueError, match=r"tokenize\.max_lenght: no such key .*\(did you mean 'max_length'\?\)"):
        TokenizeKeys.from_mapping({"max_lenght": 64})
    with pytest.raises(ValueError, match=r"data\.eval_fractoin: .*did you mean 'eval_fraction'"):
        Probe.from_config({"data": {"eval_fractoin": 0.1}})
    with pytest.raises(ValueError, match=r"tokenize\.overflwo: .*did you mean 'overflow'"):
        Probe.from_config(tokenize={"overflwo": "drop"})  # a key of the section this stage does not read: known
    with pytest.raises(ValueError, match=r"tokenize\.zzz: no such key in schemas/config.schema.yaml$"):
        TokenizeKeys.from_mapping(zzz=1)  # nothing close: no hint
    # an override of a section the stage does not read would be lost: refused too
    with pytest.raises(ValueError, match=r"Probe reads no config section 'tokenise' \(did you mean 'tokenize'\?\)"):
        Probe.from_config(tokenise={"max_length": 64})


def test_values_are_frozen_and_to_dict_round_trips():
    given = {"max_length": 64, "chat_template_kwargs": {"enable_thinking": False, "extra": {"tags": ["a", "b"]}}}
    keys = TokenizeKeys.from_mapping(given)
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.max_length = 3
    with pytest.raises(TypeError):
        keys.chat_template_kwargs["enable_thinking"] = True
    with pytest.raises(TypeError):
        keys.chat_template_kwargs["extra"]["tags"] = []
    assert keys.chat_template_kwargs["extra"]["tags"] == ("a", "b")
    given["chat_template_kwargs"]["extra"]["tags"].append("c")  # the caller's dicts are copied, not aliased
    assert keys.chat_template_kwargs["extra"]["tags"] == ("a", "b")
    given["chat_template_kwargs"]["extra"]["tags"].pop()

    data = DataKeys.from_mapping(seed=3, sources=SOURCES)
    assert isinstance(data.sources, tuple) and data.sources[0]["options"]["languages"] == ("en", "fr")
    with pytest.raises(TypeError):
        data.sources[0]["name"] = "b"

    plain = keys.to_dict()
    assert plain == given and json.loads(json.dumps(plain)) == given
    assert type(plain["chat_template_kwargs"]) is dict and type(plain["chat_template_kwargs"]["extra"]["tags"]) is list
    assert data.to_dict() == {"seed": 3, "sources": SOURCES} and type(data.to_dict()["sources"]) is list
    probe = Probe(data=data, tokenize=keys)
    assert probe.to_dict() == {"data": {"seed": 3, "sources": SOURCES}, "tokenize": given}
    assert Probe.from_config(probe.to_dict()) == probe


def test_a_whole_config_ignores_other_sections_and_keys(config):
    probe = Probe.from_config(config)
    assert probe.data.seed == config["data"]["seed"]
    assert probe.tokenize.max_length == config["tokenize"]["max_length"] == 512
    assert probe.to_dict()["data"]["sources"] == config["data"]["sources"]
    assert not hasattr(probe, "extract") and not hasattr(probe.tokenize, "threads")
    # overrides merge over the config, key by key
    over = Probe.from_config(config, tokenize={"max_length": 99})
    assert over.tokenize.max_length == 99 and over.tokenize.chat_template_kwargs == probe.tokenize.chat_template_kwargs
    assert over.data == probe.data


def test_post_init_validation_runs():
    with pytest.raises(ValueError, match="tokenize.max_length must be >= 2, got 1"):
        TokenizeKeys.from_mapping(max_length=1)
    with pytest.raises(ValueError, match="tokenize.max_length must be >= 2, got 0"):
        Probe.from_config(tokenize={"max_length": 0})
    # the stages' own checks
    with pytest.raises(ValueError, match="tokenize.max_length must be >= 2, got 1"):
        TokenizeOptions.from_mapping(max_length=1)
    with pytest.raises(ValueError, match="tokenize.overflow must be 'truncate' or 'drop', got 'cut'"):
        TokenizeSettings.from_config(tokenize={"overflow": "cut"})
    with pytest.raises(ExportError, match="unknown export dtype 'int8'"):
        ExportSettings.from_config(drafter={"export_dtype": "int8"})


def test_replace_refreezes_and_validates_again():
    keys = TokenizeKeys.from_mapping(max_length=64)
    other = keys.replace(chat_template_kwargs={"enable_thinking": True, "tags": ["x"]})
    assert keys.chat_template_kwargs == {} and other.max_length == 64
    with pytest.raises(TypeError):
        other.chat_template_kwargs["enable_thinking"] = False
    assert other.chat_template_kwargs["tags"] == ("x",)
    assert other.to_dict() == {"max_length": 64, "chat_template_kwargs": {"enable_thinking": True, "tags": ["x"]}}
    with pytest.raises(ValueError, match="tokenize.max_length must be >= 2, got 1"):
        keys.replace(max_length=1)


def test_a_field_must_hold_its_own_section():
    with pytest.raises(TypeError, match="Misnamed.data must be a SectionSettings of section 'data'"):
        Misnamed.from_config()


# ------------------------------------------------------------------------------------------------
# the stages' settings classes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", DECLARED, ids=lambda cls: cls.STAGE)
def test_stage_settings_hold_exactly_the_stage_keys(cls):
    """Fields: per section, the output plus the runtime keys STAGE_KEYS lists for the rule (no more, no less)."""
    expected = {section: sorted(kinds.get("output", ()) + kinds.get("runtime", ()))
                for section, kinds in STAGE_KEYS[cls.STAGE].items()}
    got = cls.keys()
    assert {section: sorted(keys) for section, keys in got.items()} == expected
    assert all(len(set(keys)) == len(keys) for keys in got.values())


@pytest.mark.parametrize("cls", DECLARED, ids=lambda cls: cls.STAGE)
def test_from_rule_sees_the_config(cls, config):
    """What a script builds from the rule's params and the config is what the config says."""
    settings = cls.from_rule(rule_params(config, cls.STAGE), config)
    assert settings == cls.from_config(config)
    for section, keys in cls.keys().items():
        assert settings.to_dict()[section] == {key: config[section][key] for key in keys}
