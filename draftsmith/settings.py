"""Frozen settings objects: the configuration keys one stage reads, as attributes.

Each stage declares, beside the code that reads it, one :class:`StageSettings` subclass whose fields are config
sections, each a :class:`SectionSettings` subclass whose fields are the keys of that section the stage reads::

    @dataclass(frozen=True)
    class MergeOptions(SectionSettings):
        SECTION: ClassVar[str] = "merge"
        verify_sha256: bool

    @dataclass(frozen=True)
    class MergeSettings(StageSettings):
        STAGE: ClassVar[str] = "merge"
        merge: MergeOptions

    settings = MergeSettings.from_config({"merge": {"verify_sha256": True}})
    settings.merge.verify_sha256                                      # True

Defaults live only in the schema (``schemas/config.schema.yaml``): a key the caller leaves out takes the schema's
default; a key whose schema default is null with an ``x-by-architecture`` entry takes its value for the config's
``drafter.architecture`` (:meth:`StageSettings.from_config`; the workflow's config has them filled already,
:func:`draftsmith.config.fill_architecture_defaults`). A key the schema does not know for that section is refused,
with the closest known key. Values are frozen
too (mappings become read-only mappings, lists become tuples): :meth:`SectionSettings.to_dict` gives plain JSON-able
dicts and lists back.

Scripts build their stage's settings once from the rule (:meth:`StageSettings.from_rule`: the rule's output-key
``params`` plus the stage's runtime keys from the config, :func:`draftsmith.stages.stage_config`); library callers
and tests call :meth:`StageSettings.from_config` with whatever keys they want to set. ``tests/test_settings.py``
holds every stage's fields equal to its keys in :data:`draftsmith.stages.STAGE_KEYS`.

Importing this module does not import torch (the workflow is planned without it).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="SectionSettings")
T = TypeVar("T", bound="StageSettings")


def freeze(value: Any) -> Any:
    """``value`` made immutable, recursively: mappings -> read-only mappings (order kept), lists -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of :func:`freeze`: plain dicts and lists (JSON-able when the leaves are)."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


@lru_cache(maxsize=None)
def _section_defaults(section: str) -> MappingProxyType:
    from draftsmith.config import schema_defaults

    return MappingProxyType(schema_defaults(section))


def unknown_key_message(section: str, key: str, known: typing.Iterable[str]) -> str:
    """``"train.lr_warmup: no such key (did you mean 'warmup_ratio'?)"``-style message for a misspelled key."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{section}.{key}: no such key in schemas/config.schema.yaml{hint}"


@dataclasses.dataclass(frozen=True)
class SectionSettings:
    """The keys of one config section (:attr:`SECTION`) that one stage reads: one dataclass field per key.

    Subclasses are frozen dataclasses with no field defaults (the schema holds them) and may validate in
    ``__post_init__`` (raise ``ValueError`` naming ``section.key``).
    """

    SECTION: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys this object holds, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls: type[S], values: Mapping[str, Any] | None = None, **overrides: Any) -> S:
        """Build from a mapping of the section's keys (plus ``overrides``); missing keys take the schema default.

        Keys of the section that this stage does not read are ignored (a caller may pass the whole section).

        Raises:
            ValueError: a key the schema does not know for this section (with the closest known key), or a value
                ``__post_init__`` refuses.
        """
        given = {**(values or {}), **overrides}
        defaults = _section_defaults(cls.SECTION)
        for key in given:
            if key not in defaults:
                raise ValueError(unknown_key_message(cls.SECTION, key, defaults))
        return cls(**{key: freeze(given[key] if key in given else defaults[key]) for key in cls.keys()})

    def to_dict(self) -> dict[str, Any]:
        """``{key: value}`` as plain dicts and lists (JSON-able)."""
        return {key: thaw(getattr(self, key)) for key in self.keys()}

    def replace(self: S, **changes: Any) -> S:
        """A copy with some keys changed (values frozen, ``__post_init__`` run again)."""
        return dataclasses.replace(self, **{key: freeze(value) for key, value in changes.items()})


@dataclasses.dataclass(frozen=True)
class StageSettings:
    """Everything one stage (:attr:`STAGE`, a rule name of :data:`draftsmith.stages.STAGE_KEYS`) reads from the
    config: one field per config section, each a :class:`SectionSettings` (the field's name is the section's)."""

    STAGE: ClassVar[str] = ""

    @classmethod
    def section_types(cls) -> dict[str, type[SectionSettings]]:
        """``{section name: its SectionSettings class}`` in declaration order."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if not (isinstance(kind, type) and issubclass(kind, SectionSettings)) or kind.SECTION != f.name:
                raise TypeError(f"{cls.__name__}.{f.name} must be a SectionSettings of section {f.name!r}")
            out[f.name] = kind
        return out

    @classmethod
    def keys(cls) -> dict[str, tuple[str, ...]]:
        """``{section: keys}`` this stage reads."""
        return {name: kind.keys() for name, kind in cls.section_types().items()}

    @classmethod
    def from_config(cls: type[T], config: Mapping[str, Mapping[str, Any]] | None = None,
                    **sections: Mapping[str, Any]) -> T:
        """Build from ``{section: {key: value}}`` (a whole config works: other sections are ignored), plus
        ``section=mapping`` overrides merged over it; missing keys take the schema defaults.

        Raises:
            ValueError: an unknown key in a section this stage reads (see :meth:`SectionSettings.from_mapping`),
                or an override of a section it does not read (it would be lost).
        """
        config = config or {}
        types = cls.section_types()
        for name in sections:
            if name not in types:
                close = difflib.get_close_matches(name, list(types), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"{cls.__name__} reads no config section {name!r}{hint}; it reads "
                                 f"{', '.join(types)}")
        from draftsmith.config import fill_architecture_defaults

        merged = {name: {**(config.get(name) or {}), **(sections.get(name) or {})} for name in types}
        # a stage that does not read ``drafter`` (extraction) still gets its architecture's defaults
        arch = (sections.get("drafter") or {}).get("architecture") or (config.get("drafter") or {}).get("architecture")
        fill_architecture_defaults(merged, arch)
        return cls(**{name: kind.from_mapping(merged[name]) for name, kind in types.items()})

    @classmethod
    def from_rule(cls: type[T], params: Mapping, config: Mapping) -> T:
        """Build in a rule's script: ``snakemake.params.settings`` (the output keys) plus the stage's runtime keys
        from ``snakemake.config`` (:func:`draftsmith.stages.stage_config`)."""
        from draftsmith.stages import stage_config

        return cls.from_config(stage_config(cls.STAGE, params, config))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` as plain dicts and lists (JSON-able)."""
        return {f.name: getattr(self, f.name).to_dict() for f in dataclasses.fields(self)}
