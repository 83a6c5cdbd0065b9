"""The family registry: one :class:`~blockloop.families.spec.FamilySpec` per paper family, and the named presets.

Each family module (``decoder``, ``double_decoder``, ``encoder_decoder``, ``block``, ``recursive``,
``staircase``, ``ladder``) owns its config, presets, model class, batching and cost formulas; this module
maps names to them. Everything that depends on the family asks :func:`spec_of` instead of branching on
``config.family``. Adding a family means adding its module and one line to :data:`FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from blockloop.config import ModelConfig, check_fields, read_config_dict, shared_defaults
from blockloop.data.collate import Collate
from blockloop.errors import BlockloopError, ConfigError
from blockloop.families import block, decoder, double_decoder, encoder_decoder, ladder, recursive, staircase
from blockloop.families.spec import FamilySpec, Preset

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (decoder.SPEC, double_decoder.SPEC, encoder_decoder.SPEC, block.SPEC, recursive.SPEC,
                 staircase.SPEC, ladder.SPEC)
}


def _preset_families() -> dict[str, FamilySpec]:
    table: dict[str, FamilySpec] = {}
    for spec in FAMILIES.values():
        for preset in spec.presets:
            if preset.name in table:
                raise ValueError(f"preset {preset.name!r} defined twice")
            table[preset.name] = spec
    return table


_PRESET_FAMILY = _preset_families()
PRESETS: dict[str, Preset] = {p.name: p for spec in FAMILIES.values() for p in spec.presets}


def family(name: str) -> FamilySpec:
    """The spec registered under ``name``."""
    spec = FAMILIES.get(name)
    if spec is None:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return spec


def spec_of(config: ModelConfig) -> FamilySpec:
    """The spec of ``config``'s family."""
    return family(config.family)


def build_model(config: ModelConfig) -> nn.Module:
    """The model for ``config``'s family."""
    if isinstance(config, str):  # a preset's name: its config first, as the README's examples build one
        raise BlockloopError(f"build_model takes a config, not a name; build_model(from_name({config!r}))")
    config.check()  # a field set by hand since (config.replace derives the sizes that follow it again)
    return spec_of(config).model_class(config)


def collate_for(config: ModelConfig, objective: str = "lm") -> Collate:
    """``(inputs, targets, generator) -> forward kwargs`` of ``config``'s family for ``objective``."""
    return spec_of(config).collate(config, objective)


def from_name(name: str, /, **overrides: Any) -> ModelConfig:
    """The preset's config with ``overrides`` applied (e.g. ``vocab_size`` from the tokenizer)."""
    if not isinstance(name, str):
        raise ConfigError(f"a preset name is a string, got {name!r}; run `blockloop presets` to list them")
    preset = PRESETS.get(name)
    if preset is None:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}run `blockloop presets` to list them")
    spec = _PRESET_FAMILY[name]
    check_fields(spec.config_class, overrides)
    return spec.config_class(**spec.config_class.settled({**preset.fields, "name": name}, overrides))


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """Rebuild any family's config from :meth:`~blockloop.config.ModelConfig.to_dict` output.

    A field the family does not have is refused by name, except a shared field at its default value: a
    ``config.json`` written before the family's config dropped that field group holds those.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config is a mapping of field names to values (as to_dict gives), got {type(data).__name__}")
    data = dict(data)
    data.pop("extra", None)  # older config.json files hold this field, which no model ever read
    cls = family(data.pop("family", "decoder")).config_class
    known = {f.name for f in dataclasses.fields(cls)}
    defaults = shared_defaults()
    data = {k: v for k, v in data.items() if k in known or k not in defaults or v != defaults[k]}
    check_fields(cls, data)
    return cls(**cls.saved_fields(data))


def load_config(path: Path) -> ModelConfig:
    """The config in a checkpoint's ``config.json``."""
    return config_from_dict(read_config_dict(path))


__all__ = ["FAMILIES", "PRESETS", "FamilySpec", "Preset", "build_model", "collate_for", "config_from_dict", "family",
           "from_name", "load_config", "spec_of"]
