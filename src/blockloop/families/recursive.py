"""The (Relaxed) Recursive Transformer family (Bae et al. 2024): config, presets, FLOPs of the looped depth."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from blockloop.choices import EXIT_LOSSES, TYING_STRATEGIES
from blockloop.config import InputEmbedding, LocalAttention, ModelConfig, PretrainedFeatures, TransformerShape
from blockloop.families.costs import param_bytes, windowed_kv_cache_bytes
from blockloop.families.decoder import llama_tiny
from blockloop.families.decoder import training_flops as decoder_training_flops
from blockloop.families.spec import FamilySpec, Preset
from blockloop.models.recursive import RecursiveDecoder, rolling_positions

EXIT_COEFFICIENT = 0.1  # the aggressive loss's weight of the intermediate loops unless one is given


@dataclass
class RecursiveConfig(LocalAttention, InputEmbedding, PretrainedFeatures, TransformerShape, ModelConfig):
    """A (Relaxed) Recursive Transformer (sections 2.2-2.3): ``loops`` passes over one block of ``n_layer``
    unique layers, so the looped depth is L = n_layer * loops (equation 2).

    ``tying`` orders the shared layers along the depth (appendix D): ``cycle`` repeats the block
    (0,1,2,0,1,2), ``sequence`` repeats each layer in place (0,0,1,1,2,2), ``cycle_rev`` runs the last loop
    in reverse (0,1,2,2,1,0). Relaxations (section 2.3, appendix K): ``lora_rank`` > 0 gives every shared
    linear weight one LoRA per loop (of rank min(lora_rank, in, out); scaling ``lora_alpha / lora_rank``, alpha
    defaulting to the rank);
    ``prefix_len`` > 0 gives every (loop, layer) position its own learned prefix keys/values; ``loop_norms``
    gives every norm of the shared layers one gain (and LayerNorm bias) per loop.
    Sliding-window attention: ``local_layers`` are shared layers that are local at every depth position;
    ``local_depths`` are depth positions (0 .. L-1) that attend locally whatever their shared layer, for a
    converted model whose tied layers mix local and global positions (the mask is chosen per position).
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
    loop_norms: bool = False
    local_depths: list[int] = field(default_factory=list)
    exit_loss: str = "none"
    exit_coefficient: float = EXIT_COEFFICIENT
    exit_kd_weight: float = 0.0

    def validate(self) -> None:
        super().validate()
        full = full_lora_rank(self)
        self._check(
            (self.loops >= 1, f"loops must be at least 1, got {self.loops}"),
            (self.tying in TYING_STRATEGIES, f"tying strategy {self.tying!r} is unknown; choose one of {TYING_STRATEGIES}"),
            (self.lora_rank >= 0, f"lora_rank must be 0 (no LoRA) or positive, got {self.lora_rank}"),
            (self.lora_alpha is None or self.lora_alpha > 0, f"lora_alpha must be positive, got {self.lora_alpha}"),
            (self.prefix_len >= 0, f"prefix_len must be 0 (no prefix) or positive, got {self.prefix_len}"),
            (self.exit_loss in EXIT_LOSSES, f"exit_loss {self.exit_loss!r} is unknown; choose one of {EXIT_LOSSES}"),
            (self.exit_loss == "none" or self.loops > 1,
             f"exit_loss={self.exit_loss!r} trains the exits after loops 1 .. B-1, which loops=1 does not have; set "
             "loops to 2 or more, or leave exit_loss at 'none'"),
            (self.lora_rank <= full,
             f"lora_rank={self.lora_rank} exceeds the rank of every shared weight matrix (the largest min(in, out) "
             f"is {full}, full rank); give at most {full}"),
            (0.0 <= self.exit_coefficient <= 1.0, f"exit_coefficient must be in [0, 1], got {self.exit_coefficient}"),
            (self.exit_kd_weight >= 0.0, f"exit_kd_weight must be non-negative, got {self.exit_kd_weight}"),
            (
                not (self.prefix_len and (self.local_layers or self.local_depths)),
                "prefix relaxation is not defined for sliding-window local layers; use LoRA (lora_rank) instead",
            ),
            (
                all(0 <= p < self.depth for p in self.local_depths),
                f"local_depths={self.local_depths} must be depth positions below n_layer * loops = {self.depth}",
            ),
            (
                not self.local_depths or (self.sliding_window or 0) > 0,
                "local_depths need a positive sliding_window (how many recent positions they see)",
            ),
        )

    @classmethod
    def unread_fields(cls, fields: Mapping[str, Any]) -> dict[str, str]:
        """Weights of a loss or a relaxation this config does not have: saved with a run, they would read as if they
        had shaped the model."""
        unread = super().unread_fields(fields)
        if not fields["lora_rank"]:
            unread["lora_alpha"] = "scales LoRA modules, and lora_rank=0 adds none"
        if fields["exit_loss"] == "none":
            unread["exit_kd_weight"] = "weighs the early-exit loss's distillation, and exit_loss='none' computes none"
        if fields["exit_loss"] != "aggressive":
            unread["exit_coefficient"] = (f"weighs the intermediate loops of the aggressive exit loss, not of "
                                          f"exit_loss={fields['exit_loss']!r}")
        return unread

    @classmethod
    def saved_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint written before the refusals of what a model does not read (an exit loss on one loop, a LoRA
        rank past full rank, and :meth:`unread_fields`) loads as the same model."""
        data = dict(data)
        if data.get("loops") == 1 and data.get("exit_loss", "none") != "none":  # one loop: the exit loss was plain CE
            data["exit_loss"] = "none"
        if data.get("lora_rank"):  # every matrix took min(rank, in, out): the same modules at full rank, same scaling
            shape = cls.settled(data, {"lora_rank": 0, "exit_loss": "none"})  # no LoRA, no loss: nothing else to check
            full = full_lora_rank(cls(**shape))
            if data["lora_rank"] > full:
                alpha = data.get("lora_alpha")
                data.update(lora_rank=full, lora_alpha=None if alpha is None else alpha * full / data["lora_rank"])
        return super().saved_fields(data)

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
        relax += ", per-loop norms" if self.loop_norms else ""
        layers = f"{self.n_layer} shared layer{'s' if self.n_layer > 1 else ''}"
        return f"{layers} x {self.loops} loop{'s' * (self.loops > 1)} ({self.tying}), d={self.d_model}{relax}"


def linear_shapes(config: TransformerShape) -> dict[str, tuple[int, int]]:
    """(out, in) of every weight matrix in one layer (the fused projection's W^Q, W^K, W^V apart)."""
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    shapes = {"W^Q": (q, config.d_model), "W^K": (kv, config.d_model), "W^V": (kv, config.d_model),
              "attn.proj": (config.d_model, q)}
    if config.mlp in ("gelu", "gelu_tanh"):
        return {**shapes, "mlp.fc": (config.d_ff, config.d_model), "mlp.proj": (config.d_model, config.d_ff)}
    return {**shapes, "mlp.gate": (config.d_ff, config.d_model), "mlp.up": (config.d_ff, config.d_model),
            "mlp.proj": (config.d_model, config.d_ff)}


def full_lora_rank(config: TransformerShape) -> int:
    """The largest LoRA rank any shared weight takes (each takes min(rank, in, out)): a larger one adds nothing."""
    return max(min(shape) for shape in linear_shapes(config).values())


PRESETS = (
    Preset("tiny-recursive", "1 shared Llama-style layer looped twice (CYCLE) for CPU tests",
           {**llama_tiny(1, 64, 4, 2, 128), "loops": 2}),
    Preset("demo-recursive", "the demo's 4-layer depth as 2 shared layers looped twice (CYCLE): half the layer weights",
           {**llama_tiny(2, 128, 4, 4, 256), "loops": 2}),
)


def training_flops(config: RecursiveConfig, seq_len: int, *, lm_head: bool = True) -> float:
    """The looped depth's FLOPs (weights are shared, compute is not); LoRA/prefix relaxations are not counted."""
    return decoder_training_flops(config.stack(config.depth), seq_len, lm_head=lm_head)


def kv_bytes(config: RecursiveConfig, prompt_len: int, new_tokens: int, bytes_per_value: int = 2) -> int:
    """Every loop computes (and caches) its own keys and values: K/V of the looped depth (the last
    ``sliding_window`` tokens at rolling positions, :func:`~blockloop.models.recursive.rolling_positions`)."""
    rolling = len(rolling_positions(config))
    return windowed_kv_cache_bytes(config, config.depth, rolling, prompt_len + new_tokens, bytes_per_value)


def decode_bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float:
    """RRT section 2.2: the shared layers' weights once per loop, KV of every depth position (at most
    ``sliding_window`` tokens at rolling positions)."""
    c = model.config
    element = next(model.parameters()).element_size()
    weights = param_bytes(model) + (c.loops - 1) * param_bytes(model.body.blocks)
    weights -= model.embed.weight.numel() * element * (not c.tie_embeddings)
    rolling, average = len(rolling_positions(c)), prompt_len + gen_len / 2
    return weights + batch * windowed_kv_cache_bytes(c, c.depth, rolling, average, element)


SPEC = FamilySpec(
    name="recursive",
    config_class=RecursiveConfig,
    model_class=RecursiveDecoder,
    scoring="cached",
    presets=PRESETS,
    training_flops=training_flops,
    kv_bytes=kv_bytes,
    decode_bytes_per_step=decode_bytes_per_step,
    unrolled=lambda config: config.stack(config.depth),  # weights are shared; compute and KV cache are not
)
