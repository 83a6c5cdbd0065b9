"""The shared parts of every model configuration, and their JSON round-trip.

A family's config (in its module under :mod:`blockloop.families`) is a dataclass composed of the field
groups here: :class:`ModelConfig` (identity, vocabulary, context and the style of every layer) plus
whichever of :class:`TransformerShape`, :class:`PretrainedFeatures` and :class:`LocalAttention` its model
honours, and its own fields. A config has exactly the fields its model reads, so a field the family would
ignore is refused by name instead of silently doing nothing. :class:`DecoderConfig` composes all of them: it
is the vanilla decoder's config and the plain transformer every stack or core is built from
(:meth:`TransformerShape.stack`).

Configs validate themselves on construction so that an impossible shape fails with a sentence
("n_head=5 does not divide d_model=128") instead of a reshape error deep inside a forward pass. Each group's
``validate`` fills its derived defaults, calls the next group's (cooperatively, along the MRO) and adds its
checks. Layer choices (norm, MLP) are stored as strings so a config round-trips through ``config.json``;
reading one back needs the family registry (:func:`blockloop.families.load_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from blockloop.errors import BlockloopError, ConfigError

NORMS = ("layernorm", "rmsnorm", "rmsnorm1p")
MLPS = ("gelu", "gelu_tanh", "swiglu", "geglu")
INITS = ("normal", "xavier_uniform")

LAYER_STYLE = ("norm", "norm_eps", "mlp", "bias", "qkv_bias", "rotary_pct", "rope_base", "parallel_residual", "dropout",
               "embed_dropout", "init", "init_std")


@dataclass
class ModelConfig:
    """What every family's config has: identity, vocabulary, context, and the style of its layers.

    ``vocab_size`` is the tokenizer's; embedding tables and LM heads have ``padded_vocab_size`` rows
    (rounded up for matmul-friendly shapes, as Pythia's 50,304) and generation never samples the padding
    ids. The layer style (norm, MLP, bias, rotary fraction, parallel residual, dropout, init) applies to
    every transformer inside a model.
    """

    family: ClassVar[str]
    # Off unless a family composes InputEmbedding (which turns them into fields): the embedding reads them.
    learned_positions: ClassVar[bool] = False
    embed_scale: ClassVar[bool] = False

    name: str = "custom"
    vocab_size: int = 50304
    padded_vocab_size: int | None = None
    context_length: int = 2048
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    bias: bool = True
    qkv_bias: bool | None = None  # the attention's q/k/v projections' own (Qwen2 has them alone); None: ``bias``
    rotary_pct: float = 1.0
    rope_base: float = 10000.0
    parallel_residual: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    embed_dropout: float | None = None  # on the input embeddings; None: ``dropout`` (Staircase's Table 5 sets both)
    init: str = "normal"
    init_std: float = 0.02
    mup_base_width: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.name, str) and not self.name.strip():  # every other refusal starts with the name
            raise ConfigError("name is empty; give the model a name (it names the model in logs and on a server)")
        # Types and signs first: the groups' validate() computes with the fields (head_dim = d_model // n_head).
        check_types(self, f"{self.name}: ", "field ")
        negative = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                    if isinstance(getattr(self, f.name), (int, float)) and getattr(self, f.name) < 0]
        self._check((not negative, f"{', '.join(negative)}: no size, count, id, rate or scale is negative"))
        unset = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]
        self.check()
        # Sizes validate() worked out from others (head_dim, d_ff, padded_vocab_size, ...): replace() works them
        # out again from the new fields instead of keeping values sized for the old shape.
        self._derived = frozenset(name for name in unset if getattr(self, name) is not None)

    def check(self) -> None:
        """:meth:`validate`, then refuse a field no part of the model would read (:meth:`unread_fields`): at
        construction, and again where a config may have been set by hand since (``build_model``)."""
        self.validate()
        defaults = field_defaults(type(self))
        for name, why in self.unread_fields(vars(self)).items():
            value = getattr(self, name)
            self._check((value == defaults[name], f"{name}={value!r} {why}, so it would change nothing; leave it out"))

    def validate(self) -> None:
        """Fill derived defaults and check every field (groups extend this cooperatively)."""
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.embed_dropout is None:
            self.embed_dropout = self.dropout
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        self._check(
            (self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}"),
            (
                self.padded_vocab_size >= self.vocab_size,
                f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}",
            ),
            (self.context_length > 0, f"context_length must be positive, got {self.context_length}"),
            (0.0 <= self.rotary_pct <= 1.0, f"rotary_pct must be in [0, 1], got {self.rotary_pct}"),
            (self.rope_base > 0, f"rope_base must be positive, got {self.rope_base}"),
            (self.norm_eps > 0, f"norm_eps must be positive (it keeps a norm's division finite), got {self.norm_eps}"),
            (self.init_std > 0, f"init_std must be positive (0 starts every weight at zero), got {self.init_std}"),
            (self.norm in NORMS, f"norm={self.norm!r} is not one of {NORMS}"),
            (self.mlp in MLPS, f"mlp={self.mlp!r} is not one of {MLPS}"),
            (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}"),
            (0.0 <= self.embed_dropout < 1.0, f"embed_dropout must be in [0, 1), got {self.embed_dropout}"),
            (self.init in INITS, f"init={self.init!r} is not one of {INITS}"),
            (
                self.mup_base_width is None or self.mup_base_width > 0,
                f"mup_base_width must be positive, got {self.mup_base_width}",
            ),
        )

    @property
    def mup_width(self) -> int:
        """The width muP scales against (single-width families)."""
        raise ConfigError(f"{self.name}: muP width scaling is not defined for {self.family} models")

    @property
    def logit_multiplier(self) -> float:
        """muP readout scale sqrt(d0/d) (double-decoder paper, section 4), or 1 without muP."""
        return 1.0 if self.mup_base_width is None else math.sqrt(self.mup_base_width / self.mup_width)

    @property
    def hidden_lr_multiplier(self) -> float:
        """muP learning-rate factor d0/d for hidden matrices (paper section 4, Table 1), or 1 without muP."""
        return 1.0 if self.mup_base_width is None else self.mup_base_width / self.mup_width

    @property
    def reserved_ids(self) -> int:
        """Token ids a family needs beyond the tokenizer's (span-corruption sentinels); none by default."""
        return 0

    @classmethod
    def unread_fields(cls, fields: Mapping[str, Any]) -> dict[str, str]:
        """The fields no part of the model reads, given the others' values in ``fields`` (every field), each with
        what it is for; the groups and families extend this cooperatively. One set to anything but its default is
        refused (it would change nothing, silently), and dropped from an older config.json (:meth:`saved_fields`)."""
        return {}

    @classmethod
    def saved_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The fields of a ``config.json`` as this version reads them: a family whose checks grew stricter drops
        here what an earlier version wrote and its model never read (so that checkpoint still loads)."""
        unread = cls.unread_fields({**field_defaults(cls), **data})
        return {name: value for name, value in data.items() if name not in unread}

    def _check(self, *checks: tuple[bool, str]) -> None:
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{self.name}: {message}")

    def style(self) -> dict[str, Any]:
        """The layer-style fields, to build a sub-transformer in the same style."""
        return {k: getattr(self, k) for k in LAYER_STYLE}

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed, validated again; a field this family does not have is refused.

        Derived sizes that were not given (``head_dim`` = d_model / n_head, ``d_ff``, ``padded_vocab_size``, ...)
        are derived again, so ``replace(d_model=128)`` is the config built with d_model=128 from the start.
        """
        check_fields(type(self), changes)
        rederive = {name: None for name in self._derived if name not in changes}
        return type(self)(**self.settled({**dataclasses.asdict(self), **rederive}, changes))

    @classmethod
    def settled(cls, fields: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
        """``fields`` (a preset's, a config's) with ``changes`` applied, less those of ``fields`` that the changes
        leave unread (:meth:`unread_fields`; a preset's ``max_blocks`` once ``partition='histogram'`` is asked for),
        which take their defaults: only a field that was asked for is refused for being unread."""
        merged = {**fields, **changes}
        unread = cls.unread_fields({**field_defaults(cls), **merged})
        return {name: value for name, value in merged.items() if name in changes or name not in unread}

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self)}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(kind: Any) -> str:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_describe(k) for k in typing.get_args(kind))
    origin = typing.get_origin(kind) or kind
    if origin in (list, tuple) and typing.get_args(kind):
        return f"a list of {_describe(typing.get_args(kind)[0]).split(' ', 1)[1]}s"
    names = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", list: "a list",
             dict: "an object", tuple: "a list", type(None): "null"}
    return names.get(origin, getattr(origin, "__name__", str(origin)))


def _matches(value: Any, kind: Any) -> bool:
    if kind is Any:
        return True
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_matches(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(kind) if a is not Ellipsis]
        return isinstance(value, (list, tuple)) and all(_matches(v, args[0]) for v in value) if args else True
    if origin is dict:
        return isinstance(value, dict)
    return not isinstance(kind, type) or isinstance(value, kind)


def check_types(instance: Any, prefix: str = "", label: str = "") -> None:
    """Refuse a dataclass field whose value does not have its annotated type (``--set n_layer=abc``, a
    config.json holding a string where a number belongs, a non-finite float), naming the field, the value
    and the type it needs: checked before any arithmetic turns it into a traceback."""
    for name, kind in _field_types(type(instance)).items():
        value = getattr(instance, name)
        if not _matches(value, kind):
            raise ConfigError(f"{prefix}{label}{name} must be {_describe(kind)}, got {value!r}")


def from_fields(cls: type, data: Any, what: str) -> Any:
    """``cls(**data)`` for fields read from a file (``what`` names it): anything but an object of ``cls``'s
    fields is refused by name instead of surfacing as a ``TypeError``, and a value ``cls`` refuses is reported
    as the file's, not as a command-line flag's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object of fields, got {type(data).__name__}")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(f"{what} has unknown fields {', '.join(unknown)}; it was written by another version or edited")
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e} (a value in the file; it was written by another version or edited)") from None


def check_fields(cls: type, names: Any) -> None:
    """Refuse field ``names`` that the config class ``cls`` does not have, naming them and the family."""
    unknown = sorted(set(names) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ConfigError(
            f"{cls.family} config has no config field {', '.join(unknown)} (the {cls.family} family does not use it; "
            "check the name)"
        )


@dataclass
class TransformerShape:
    """The shape of a stack of identical layers. ``n_kv_head`` < ``n_head`` gives grouped-query attention
    (1 = multi-query); ``head_dim`` defaults to d_model / n_head and ``d_ff`` to the MLP's usual width."""

    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    d_model: int = 768
    d_ff: int | None = None
    head_dim: int | None = None

    def validate(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            if self.n_head <= 0 or self.d_model % self.n_head:
                raise ConfigError(
                    f"{self.name}: n_head={self.n_head} does not divide d_model={self.d_model}; "
                    "choose a head count that divides the width or set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_head
        if self.d_ff is None:
            # Gated MLPs use 2/3 of the 4x width so their parameter count matches a plain 4x MLP.
            self.d_ff = 4 * self.d_model if self.mlp in ("gelu", "gelu_tanh") else round_up(8 * self.d_model // 3, 64)
        super().validate()
        self._check(
            (self.d_model > 0, f"d_model must be positive, got {self.d_model}"),
            (self.d_ff > 0, f"d_ff must be positive, got {self.d_ff}"),
            (self.head_dim > 0, f"head_dim must be positive, got {self.head_dim}"),
            (self.n_layer > 0, f"n_layer must be positive, got {self.n_layer}"),
            (self.n_head > 0 and self.n_kv_head > 0, "n_head and n_kv_head must be positive"),
            (
                self.n_kv_head > 0 and self.n_head % self.n_kv_head == 0,
                f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (grouped-query attention)",
            ),
            (self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for rotary embeddings"),
        )

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head; kept even so channel pairs stay intact."""
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    @property
    def mup_width(self) -> int:
        return self.d_model

    def summary(self) -> str:
        return f"{self.n_layer} layers, d={self.d_model}, heads {self.n_head}/{self.n_kv_head}"

    def stack(self, n_layer: int | None = None) -> DecoderConfig:
        """The plain transformer of this shape (``n_layer`` layers, default this config's): what a stack or a
        recurrent core is built from. Fields this family does not have keep the plain decoder's defaults."""
        shared = {f.name for f in dataclasses.fields(DecoderConfig)}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in shared}
        # settled: a window only a looped model's local_depths read takes the plain decoder's default
        return DecoderConfig(**DecoderConfig.settled(fields, {"n_layer": self.n_layer if n_layer is None else n_layer}))


@dataclass
class InputEmbedding:
    """How pretrained models embed their input (see :mod:`blockloop.convert.hf`), read by the plain decoder's
    embedding: ``learned_positions`` adds a learned absolute position table to the token embeddings (GPT-2; use
    with ``rotary_pct=0``); ``embed_scale`` multiplies the embeddings by sqrt(d_model) (Gemma). Families whose
    input is their own (blocks, streams, two stacks) leave the group out and keep both off."""

    learned_positions: bool = False
    embed_scale: bool = False


@dataclass
class PretrainedFeatures:
    """Architecture features that let pretrained models load exactly (see :mod:`blockloop.convert.hf`); the
    defaults leave a model unchanged. ``qk_norm``: RMSNorm over each query/key head before rotary (Gemma-3).
    ``sandwich_norm``: norms on the attention and MLP outputs too, before the residual add (Gemma-3).
    ``attn_scalar``: scores scaled by attn_scalar^-1/2 instead of head_dim^-1/2 (Gemma-3's
    query_pre_attn_scalar; cross-attention's scores too). ``logit_softcap``: logits become c * tanh(logits / c)."""

    qk_norm: bool = False
    sandwich_norm: bool = False
    attn_scalar: float | None = None
    logit_softcap: float | None = None

    def validate(self) -> None:
        super().validate()
        self._check(
            (self.logit_softcap is None or self.logit_softcap > 0, "logit_softcap must be positive"),
            (self.attn_scalar is None or self.attn_scalar > 0, "attn_scalar must be positive"),
        )

    @property
    def attn_scale(self) -> float | None:
        """Scale of the attention scores: attn_scalar^-1/2, or None for attention()'s head_dim^-1/2."""
        return None if self.attn_scalar is None else self.attn_scalar**-0.5


@dataclass
class LocalAttention:
    """Interleaved local/global attention (Gemma-3): ``local_layers`` are layers whose queries see only the
    last ``sliding_window`` positions, rotated with ``local_rope_base`` when given."""

    sliding_window: int | None = None
    local_layers: list[int] = field(default_factory=list)
    local_rope_base: float | None = None

    def validate(self) -> None:
        super().validate()
        self._check(
            (
                all(0 <= i < self.n_layer for i in self.local_layers),
                f"local_layers={self.local_layers} must be layer indices below n_layer={self.n_layer}",
            ),
            (
                len(set(self.local_layers)) == len(self.local_layers),
                f"local_layers={self.local_layers} names a layer twice",
            ),
            (
                not self.local_layers or (self.sliding_window or 0) > 0,
                "local_layers need a positive sliding_window (how many recent positions they see)",
            ),
            (
                self.local_rope_base is None or self.local_rope_base > 0,
                f"local_rope_base must be positive (or left out: the local layers then use rope_base), got "
                f"{self.local_rope_base}",
            ),
        )

    @classmethod
    def unread_fields(cls, fields: Mapping[str, Any]) -> dict[str, str]:
        unread = super().unread_fields(fields)
        if not (fields["local_layers"] or fields.get("local_depths")):  # a looped model's layers may be local by depth
            named = "local_layers, local_depths" if "local_depths" in fields else "local_layers"
            why = f"applies to local layers, and none is named ({named})"
            unread.update(sliding_window=why, local_rope_base=why)
        return unread


@dataclass
class DecoderConfig(LocalAttention, InputEmbedding, PretrainedFeatures, TransformerShape, ModelConfig):
    """A decoder-only transformer (GPT-NeoX/Pythia, Llama, GPT-2 and Gemma-3 shapes are all expressible).

    ``rotary_pct`` < 1 rotates only the first part of each head, as Pythia does (0.25). ``parallel_residual``
    computes attention and MLP from the same input and adds both, as GPT-NeoX does. It is the decoder
    family's config and the plain transformer every other family builds its stacks and cores from.
    """

    family: ClassVar[str] = "decoder"


GROUPS = (ModelConfig, TransformerShape, PretrainedFeatures, InputEmbedding, LocalAttention)


def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple``."""
    return (x + multiple - 1) // multiple * multiple


def split_layers(name: str, total: int, first: int | None, second: int | None, names: tuple[str, str]) -> tuple[int, int]:
    """Resolve a two-stack layer split: either count may be left out and is then ``total`` minus the other."""
    if first is None and second is None:
        raise ConfigError(f"{name}: give {names[0]} or {names[1]} (how n_layer={total} is split between the stacks)")
    first = total - second if first is None else first
    second = total - first if second is None else second
    if first < 1 or second < 1 or first + second != total:
        raise ConfigError(
            f"{name}: layer split {names[0]}={first} + {names[1]}={second} does not add up to n_layer={total} "
            "with at least one layer in each stack"
        )
    return first, second


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` and its default."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)}


def shared_defaults() -> dict[str, Any]:
    """Every shared field's default: a config.json written before a family dropped a group holds these."""
    return {name: value for group in GROUPS for name, value in field_defaults(group).items()}


def save_config(config: ModelConfig, path: Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def read_config_dict(path: Path) -> dict[str, Any]:
    """The JSON object of a ``config.json``, with a one-line error when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise BlockloopError(f"model config not found: {path}; point at a checkpoint directory written by train")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockloopError(f"model config {path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    if not isinstance(data, dict):
        raise BlockloopError(f"model config {path} holds a JSON {type(data).__name__}, not an object of config fields; "
                             "the checkpoint is corrupt")
    return data
