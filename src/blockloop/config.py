"""Model configurations: one typed dataclass per model family, serialisable to JSON.

Configs validate themselves on construction so that an impossible shape fails with a sentence
("n_head=5 does not divide d_model=128") instead of a reshape error deep inside a forward pass.
Layer choices (norm, MLP) are stored as strings so a config round-trips through ``config.json``.
Named presets live in :mod:`blockloop.presets`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from blockloop.errors import BlockloopError, ConfigError

NORMS = ("layernorm", "rmsnorm", "rmsnorm1p")
MLPS = ("gelu", "gelu_tanh", "swiglu", "geglu")
INITS = ("normal", "xavier_uniform")
PARTITIONS = ("uniform", "logspace", "histogram")


LAYER_STYLE = ("norm", "norm_eps", "mlp", "bias", "rotary_pct", "rope_base", "parallel_residual", "dropout", "init",
               "init_std")


@dataclass
class ModelConfigBase:
    """What every family's config has: identity, vocabulary, context, and the style of its layers.

    ``vocab_size`` is the tokenizer's; embedding tables and LM heads have ``padded_vocab_size`` rows
    (rounded up for matmul-friendly shapes, as Pythia's 50,304) and generation never samples the padding
    ids. The layer style (norm, MLP, bias, rotary fraction, parallel residual, dropout, init) applies to
    every transformer inside a model.
    """

    family: ClassVar[str]

    name: str = "custom"
    vocab_size: int = 50304
    padded_vocab_size: int | None = None
    context_length: int = 2048
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    bias: bool = True
    rotary_pct: float = 1.0
    rope_base: float = 10000.0
    parallel_residual: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    init: str = "normal"
    init_std: float = 0.02
    mup_base_width: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        self._check(
            (self.vocab_size > 0, f"vocab_size must be positive, got {self.vocab_size}"),
            (
                self.padded_vocab_size >= self.vocab_size,
                f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}",
            ),
            (self.context_length > 0, f"context_length must be positive, got {self.context_length}"),
            (0.0 <= self.rotary_pct <= 1.0, f"rotary_pct must be in [0, 1], got {self.rotary_pct}"),
            (self.norm in NORMS, f"norm={self.norm!r} is not one of {NORMS}"),
            (self.mlp in MLPS, f"mlp={self.mlp!r} is not one of {MLPS}"),
            (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}"),
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

    def _check(self, *checks: tuple[bool, str]) -> None:
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{self.name}: {message}")

    def style(self) -> dict[str, Any]:
        """The layer-style fields, to build a sub-transformer in the same style."""
        return {k: getattr(self, k) for k in LAYER_STYLE}

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **dataclasses.asdict(self)}


@dataclass
class DecoderConfig(ModelConfigBase):
    """A decoder-only transformer (GPT-NeoX/Pythia and Llama shapes are both expressible).

    ``n_kv_head`` < ``n_head`` gives grouped-query attention (1 = multi-query). ``rotary_pct`` < 1
    rotates only the first part of each head, as Pythia does (0.25). ``parallel_residual`` computes
    attention and MLP from the same input and adds both, as GPT-NeoX does.

    The remaining fields exist so pretrained architectures load exactly (see :mod:`blockloop.convert.hf`);
    their defaults leave the model above unchanged. ``learned_positions``: a learned absolute position
    table added to the token embeddings (GPT-2; use with ``rotary_pct=0``). ``embed_scale``: embeddings
    times sqrt(d_model) (Gemma). ``qk_norm``: RMSNorm over each query/key head before rotary (Gemma-3).
    ``sandwich_norm``: norms on the attention and MLP outputs too, before the residual add (Gemma-3).
    ``attn_scalar``: scores scaled by attn_scalar^-1/2 instead of head_dim^-1/2 (Gemma-3's
    query_pre_attn_scalar). ``local_layers``: layers whose queries see only the last ``sliding_window``
    positions, rotated with ``local_rope_base`` when given (Gemma-3). ``logit_softcap``: logits become
    c * tanh(logits / c).
    """

    family: ClassVar[str] = "decoder"

    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    d_model: int = 768
    d_ff: int | None = None
    head_dim: int | None = None
    learned_positions: bool = False
    embed_scale: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    attn_scalar: float | None = None
    sliding_window: int | None = None
    local_layers: list[int] = field(default_factory=list)
    local_rope_base: float | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
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
            self.d_ff = 4 * self.d_model if self.mlp in ("gelu", "gelu_tanh") else _round_up(8 * self.d_model // 3, 64)
        self.validate()

    def validate(self) -> None:
        super().__post_init__()
        self._check(
            (self.n_layer > 0, f"n_layer must be positive, got {self.n_layer}"),
            (self.n_head > 0 and self.n_kv_head > 0, "n_head and n_kv_head must be positive"),
            (
                self.n_head % self.n_kv_head == 0,
                f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (grouped-query attention)",
            ),
            (self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for rotary embeddings"),
            (
                all(0 <= i < self.n_layer for i in self.local_layers),
                f"local_layers={self.local_layers} must be layer indices below n_layer={self.n_layer}",
            ),
            (
                not self.local_layers or (self.sliding_window or 0) > 0,
                "local_layers need a positive sliding_window (how many recent positions they see)",
            ),
            (self.logit_softcap is None or self.logit_softcap > 0, "logit_softcap must be positive"),
            (self.attn_scalar is None or self.attn_scalar > 0, "attn_scalar must be positive"),
        )

    @property
    def attn_scale(self) -> float | None:
        """Scale of the attention scores: attn_scalar^-1/2, or None for attention()'s head_dim^-1/2."""
        return None if self.attn_scalar is None else self.attn_scalar**-0.5

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head; kept even so channel pairs stay intact."""
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    @property
    def mup_width(self) -> int:
        return self.d_model

    def stack(self, n_layer: int) -> "DecoderConfig":
        """A plain decoder config of this shape with ``n_layer`` layers: one stack of a two-stack family."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecoderConfig)}
        return DecoderConfig(**{**fields, "n_layer": n_layer})

    def summary(self) -> str:
        return f"{self.n_layer} layers, d={self.d_model}, heads {self.n_head}/{self.n_kv_head}"



def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _split_layers(name: str, total: int, first: int | None, second: int | None, names: tuple[str, str]) -> tuple[int, int]:
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


@dataclass
class DoubleDecoderConfig(DecoderConfig):
    """A block-based double decoder (Alexander et al. 2026, section 3.1): context decoder + generation decoder.

    ``n_layer`` is the total depth, split into ``n_context_layer`` causal context-decoder layers and
    ``n_generation_layer`` generation-decoder layers (paper: 8/4, 10/5 for the smallest models). The block
    partition sampled for every training batch follows ``partition`` (see :mod:`blockloop.data.partitions`):
    ``uniform`` draws the number of blocks uniformly from 1..``max_blocks`` and the boundaries uniformly;
    ``logspace`` places the boundaries geometrically; ``histogram`` draws block lengths from
    ``partition_lengths`` (e.g. observed prompt lengths).
    """

    family: ClassVar[str] = "double_decoder"

    n_context_layer: int | None = None
    n_generation_layer: int | None = None
    partition: str = "uniform"
    max_blocks: int = 16
    partition_lengths: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        self.n_context_layer, self.n_generation_layer = _split_layers(
            self.name, self.n_layer, self.n_context_layer, self.n_generation_layer,
            ("n_context_layer", "n_generation_layer"),
        )
        self._check(
            (self.partition in PARTITIONS, f"partition strategy {self.partition!r} is unknown; choose one of {PARTITIONS}"),
            (self.max_blocks >= 1, f"max_blocks must be at least 1, got {self.max_blocks}"),
            (
                self.partition != "histogram" or (self.partition_lengths and min(self.partition_lengths) > 0),
                "partition='histogram' needs partition_lengths, a list of positive block lengths to draw from",
            ),
        )


@dataclass
class EncoderDecoderConfig(DecoderConfig):
    """A standard encoder-decoder (bidirectional encoder; decoder with self- and cross-attention) as in T5.

    ``n_layer`` is split into ``n_encoder_layer`` and ``n_decoder_layer``; the paper (section 4) removes
    decoder layers until the non-embedding parameters match the other families, since each decoder layer
    carries an extra cross-attention sublayer. Pretraining uses span corruption: ``corruption_rate`` of the
    tokens in spans of mean length ``mean_span_length``, each span replaced by one of ``n_sentinels``
    sentinel ids placed after the tokenizer's vocabulary (inside the padded embedding table).
    """

    family: ClassVar[str] = "encoder_decoder"

    n_encoder_layer: int | None = None
    n_decoder_layer: int | None = None
    corruption_rate: float = 0.15
    mean_span_length: float = 3.0
    n_sentinels: int = 32

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size + self.n_sentinels
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        self.n_encoder_layer, self.n_decoder_layer = _split_layers(
            self.name, self.n_layer, self.n_encoder_layer, self.n_decoder_layer, ("n_encoder_layer", "n_decoder_layer")
        )
        self._check(
            (0.0 < self.corruption_rate < 1.0, f"corruption_rate must be in (0, 1), got {self.corruption_rate}"),
            (self.mean_span_length >= 1.0, f"mean_span_length must be at least 1, got {self.mean_span_length}"),
            (self.n_sentinels >= 2, f"n_sentinels must be at least 2, got {self.n_sentinels}"),
            (
                self.padded_vocab_size >= self.vocab_size + self.n_sentinels,
                f"padded_vocab_size={self.padded_vocab_size} leaves no room for {self.n_sentinels} sentinel ids after "
                f"vocab_size={self.vocab_size}",
            ),
        )

    @property
    def reserved_ids(self) -> int:
        return self.n_sentinels


EMBEDDERS = ("lookup", "encoder", "cls")
TOKEN_DECODERS = ("prefix", "sum", "cross")


@dataclass
class BlockTransformerConfig(ModelConfigBase):
    """Block Transformer (Ho et al. 2024): embedder -> block decoder -> token decoder.

    ``context_length`` counts tokens; the block decoder sees ``context_length / block_len`` blocks.
    Embedders (appendix F.1): ``lookup`` concatenates ``block_len`` token embeddings of width
    ``embed_dim`` (default ``block_d_model / block_len``; any other width adds a projection, which is how
    a vanilla model's full-width embedding is reused when uptraining); ``encoder`` runs a small
    bidirectional transformer of width ``embed_dim`` over the block's tokens and projects their
    concatenation; ``cls`` reads ``n_cls`` CLS tokens of that encoder instead. Token decoders
    (appendix F.2): ``prefix`` projects the context embedding to ``prefix_len`` prefix tokens; ``sum``
    adds a projected context to each input position (MEGABYTE); ``cross`` lets every layer
    cross-attend to ``block_len`` projected context states. The layer style fields (norm, MLP, rotary,
    ...) apply to every transformer inside. ``pad_id`` fills blocks (random-length padding in training,
    left padding of prompts); runs set it to the tokenizer's end-of-text id.
    """

    family: ClassVar[str] = "block"

    block_len: int = 4
    pad_id: int = 0
    random_padding: bool = True
    embedder: str = "lookup"
    embed_dim: int | None = None
    embedder_n_layer: int = 3
    embedder_n_head: int = 4
    n_cls: int = 3
    block_n_layer: int = 6
    block_d_model: int = 768
    block_n_head: int = 12
    block_n_kv_head: int | None = None
    block_d_ff: int | None = None
    token_decoder: str = "prefix"
    prefix_len: int = 2
    token_n_layer: int = 6
    token_d_model: int = 768
    token_n_head: int = 12
    token_n_kv_head: int | None = None
    token_d_ff: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embed_dim is None:
            self.embed_dim = self.block_d_model // self.block_len if self.embedder == "lookup" else 256
        self._check(
            (self.block_len >= 1, f"block_len must be at least 1, got {self.block_len}"),
            (
                self.context_length % self.block_len == 0,
                f"context_length={self.context_length} is not a multiple of block_len={self.block_len}",
            ),
            (self.embedder in EMBEDDERS, f"embedder={self.embedder!r} is not one of {EMBEDDERS}"),
            (self.token_decoder in TOKEN_DECODERS, f"token_decoder={self.token_decoder!r} is not one of {TOKEN_DECODERS}"),
            (self.token_decoder != "prefix" or self.prefix_len >= 1, "the prefix token decoder needs prefix_len >= 1"),
            (self.embedder != "cls" or self.n_cls >= 1, "the cls embedder needs n_cls >= 1"),
            (0 <= self.pad_id < self.padded_vocab_size, f"pad_id={self.pad_id} is outside the vocabulary"),
            (self.embed_dim >= 1, f"embed_dim must be positive, got {self.embed_dim}"),
            (self.mup_base_width is None, "muP width scaling is not defined for block models (two widths)"),
        )
        for build_part in (self.block_decoder_config, self.token_decoder_config, self.embedder_config):
            build_part()  # each part validates its own shape

    @property
    def n_lead(self) -> int:
        """Token-decoder positions before the block's first input token: the prefix, or one start token."""
        return self.prefix_len if self.token_decoder == "prefix" else 1

    def _part(self, part: str, **shape: Any) -> DecoderConfig:
        return DecoderConfig(name=f"{self.name}/{part}", vocab_size=self.vocab_size, **self.style(), **shape)

    def block_decoder_config(self) -> DecoderConfig:
        return self._part(
            "block_decoder", context_length=self.context_length // self.block_len, n_layer=self.block_n_layer,
            d_model=self.block_d_model, n_head=self.block_n_head, n_kv_head=self.block_n_kv_head, d_ff=self.block_d_ff,
        )

    def token_decoder_config(self) -> DecoderConfig:
        return self._part(
            "token_decoder", context_length=self.n_lead + self.block_len - 1, n_layer=self.token_n_layer,
            d_model=self.token_d_model, n_head=self.token_n_head, n_kv_head=self.token_n_kv_head, d_ff=self.token_d_ff,
        )

    def embedder_config(self) -> DecoderConfig:
        heads = self.embedder_n_head if self.embed_dim % self.embedder_n_head == 0 else 1
        return self._part(
            "embedder", context_length=self.block_len + self.n_cls, n_layer=max(1, self.embedder_n_layer),
            d_model=self.embed_dim, n_head=heads,
        )

    def summary(self) -> str:
        lead = f"prefix {self.prefix_len}" if self.token_decoder == "prefix" else self.token_decoder
        return (f"block {self.block_n_layer}x{self.block_d_model} + token {self.token_n_layer}x{self.token_d_model}, "
                f"L_B={self.block_len}, {self.embedder}, {lead}")


TYING_STRATEGIES = ("cycle", "sequence", "cycle_rev")
EXIT_LOSSES = ("none", "weighted", "aggressive")


@dataclass
class RecursiveConfig(DecoderConfig):
    """A (Relaxed) Recursive Transformer (Bae et al. 2024, sections 2.2-2.3): ``loops`` passes B over one block
    of ``n_layer`` unique layers, so the looped depth is L = n_layer * loops (equation 2).

    ``tying`` orders the shared layers along the depth (appendix D): ``cycle`` repeats the block
    (0,1,2,0,1,2), ``sequence`` repeats each layer in place (0,0,1,1,2,2), ``cycle_rev`` runs the last loop
    in reverse (0,1,2,2,1,0). Relaxations (section 2.3, appendix K): ``lora_rank`` > 0 gives every shared
    linear weight one LoRA per loop (scaling ``lora_alpha / lora_rank``, alpha defaulting to the rank);
    ``prefix_len`` > 0 gives every (loop, layer) position its own learned prefix keys/values.
    Early-exit training (section 3.7, appendix M): ``exit_loss`` ``weighted`` weighs loop i's loss by
    i / sum(i); ``aggressive`` weighs intermediate loops by ``exit_coefficient`` and the last by 1;
    ``exit_kd_weight`` > 0 adds, for each intermediate loop, that weight times the KL divergence from the
    detached final-loop distribution.
    """

    family: ClassVar[str] = "recursive"

    loops: int = 2
    tying: str = "cycle"
    lora_rank: int = 0
    lora_alpha: float | None = None
    prefix_len: int = 0
    exit_loss: str = "none"
    exit_coefficient: float = 0.1
    exit_kd_weight: float = 0.0

    def validate(self) -> None:
        super().validate()
        self._check(
            (self.loops >= 1, f"loops must be at least 1, got {self.loops}"),
            (self.tying in TYING_STRATEGIES, f"tying strategy {self.tying!r} is unknown; choose one of {TYING_STRATEGIES}"),
            (self.lora_rank >= 0, f"lora_rank must be 0 (no LoRA) or positive, got {self.lora_rank}"),
            (self.lora_alpha is None or self.lora_alpha > 0, f"lora_alpha must be positive, got {self.lora_alpha}"),
            (self.prefix_len >= 0, f"prefix_len must be 0 (no prefix) or positive, got {self.prefix_len}"),
            (self.exit_loss in EXIT_LOSSES, f"exit_loss {self.exit_loss!r} is unknown; choose one of {EXIT_LOSSES}"),
            (0.0 <= self.exit_coefficient <= 1.0, f"exit_coefficient must be in [0, 1], got {self.exit_coefficient}"),
            (self.exit_kd_weight >= 0.0, f"exit_kd_weight must be non-negative, got {self.exit_kd_weight}"),
            (
                not (self.prefix_len and self.local_layers),
                "prefix relaxation is not defined for sliding-window local layers; use LoRA (lora_rank) instead",
            ),
        )

    @property
    def depth(self) -> int:
        """The looped depth L = n_layer * loops."""
        return self.n_layer * self.loops

    @property
    def lora_scaling(self) -> float:
        """alpha / r, the factor on every LoRA delta."""
        return (self.lora_alpha or self.lora_rank) / self.lora_rank if self.lora_rank else 0.0

    def summary(self) -> str:
        relax = f", LoRA r={self.lora_rank}" if self.lora_rank else ""
        relax += f", prefix {self.prefix_len}" if self.prefix_len else ""
        return f"{self.n_layer} shared layers x {self.loops} loops ({self.tying}), d={self.d_model}{relax}"


CONFIG_CLASSES: dict[str, type] = {
    cls.family: cls
    for cls in (DecoderConfig, DoubleDecoderConfig, EncoderDecoderConfig, BlockTransformerConfig, RecursiveConfig)
}
ModelConfig = DecoderConfig | BlockTransformerConfig  # the double decoder and encoder-decoder configs are DecoderConfigs



def config_from_dict(data: dict[str, Any]) -> "ModelConfig":
    """Rebuild any family's config from :meth:`to_dict` output, rejecting unknown fields by name."""
    data = dict(data)
    family = data.pop("family", "decoder")
    cls = CONFIG_CLASSES.get(family)
    if cls is None:
        raise ConfigError(f"unknown model family {family!r}; known: {', '.join(sorted(CONFIG_CLASSES))}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config field(s) for {family}: {', '.join(unknown)}")
    return cls(**data)


def save_config(config: "ModelConfig", path: Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def load_config(path: Path) -> "ModelConfig":
    path = Path(path)
    if not path.is_file():
        raise BlockloopError(f"model config not found: {path}; point at a checkpoint directory written by train")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BlockloopError(f"model config {path} is not valid JSON ({exc}); the checkpoint is corrupt") from exc
    return config_from_dict(data)
