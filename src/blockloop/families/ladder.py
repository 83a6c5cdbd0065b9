"""The Ladder (Ju et al. 2022, section 3.2.4) and its baselines: Universal Transformer and Transformer-XL.

Presets share the staircase paper's task cores and Table 6 (:mod:`blockloop.families.staircase`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from blockloop.config import ModelConfig, PretrainedFeatures, TransformerShape
from blockloop.families.costs import stack_flops
from blockloop.families.spec import FamilySpec, Preset
from blockloop.families.staircase import CORES, TABLE6, paper_core, qkv_flops, tiny_core
from blockloop.models.ladder import Ladder

LADDER_PATTERNS = ("abab", "aabb")


@dataclass
class LadderConfig(PretrainedFeatures, TransformerShape, ModelConfig):
    """Ladder: the whole segment at once, the core repeated ``n_steps`` times.

    ``pattern`` orders the shared layers (Table 4): ``abab`` repeats the whole core, ``aabb`` repeats each
    layer before the next. One layer is the Universal Transformer; one step is the plain core. With
    ``memory_len`` M > 0 each token attends to itself and the M tokens before it, in earlier segments too,
    through a per-layer memory of their states (Transformer-XL, Dai et al. 2019; rotary positions): the
    paper's long-sequence setting, and with ``n_steps=1`` the Transformer-XL baseline. The core's masks are
    the Ladder's own: no sliding-window local layers.
    """

    family: ClassVar[str] = "ladder"

    n_steps: int = 2
    pattern: str = "abab"
    memory_len: int = 0

    def validate(self) -> None:
        super().validate()
        self._check(
            (self.n_steps >= 1, f"n_steps must be at least 1, got {self.n_steps}"),
            (self.pattern in LADDER_PATTERNS, f"pattern={self.pattern!r} is not one of {LADDER_PATTERNS}"),
            (self.memory_len >= 0, f"memory_len must be zero or positive, got {self.memory_len}"),
        )

    @property
    def execution_order(self) -> list[int]:
        """Which core layer each of the n_steps x n_layer applications uses (ABAB or AABB)."""
        layers = range(self.n_layer)
        if self.pattern == "abab":
            return [layer for _ in range(self.n_steps) for layer in layers]
        return [layer for layer in layers for _ in range(self.n_steps)]

    def summary(self) -> str:
        memory = f", memory {self.memory_len}" if self.memory_len else ""
        layers = f"{self.n_layer} layer{'s' * (self.n_layer > 1)}"
        if self.n_steps == 1:  # one application: no order of steps to name (Transformer-XL)
            return f"one step: core {layers}, d={self.d_model}{memory}"
        steps = f"{self.n_steps} steps ({self.pattern.upper()})"
        return f"ladder: core {layers} x {steps}, d={self.d_model}{memory}"


PRESETS = (
    *(Preset(f"ladder-{task}", f"Ladder, {steps} steps (ABAB), attention span {span}, {task} core (Table 6)",
             paper_core(task, n_steps=steps, memory_len=span))
      for task, (steps, span) in ((task, best["ladder"]) for task, best in TABLE6.items())),
    *(Preset(f"transformer-xl-{task}", f"Transformer-XL baseline (one step, memory {span}), {task} core",
             paper_core(task, n_steps=1, memory_len=span))
      for task, span in ((task, CORES[task]["context_length"] // 2) for task in TABLE6)),
    Preset("universal-transformer-reddit", "Universal Transformer: one Reddit layer, 8 steps (Table 2)",
           paper_core("reddit", n_layer=1, n_steps=8)),
    Preset("tiny-ladder", "Ladder, 2-layer core x 2 steps (ABAB) for CPU tests", tiny_core(n_steps=2)),
    Preset("tiny-ladder-aabb", "Ladder, 2-layer core x 2 steps (AABB) for CPU tests", tiny_core(n_steps=2, pattern="aabb")),
    Preset("tiny-universal", "Universal Transformer: one layer x 4 steps, for CPU tests", tiny_core(n_layer=1, n_steps=4)),
    Preset("tiny-transformer-xl", "Transformer-XL: 2 layers, memory (attention span) 16, for CPU tests",
           tiny_core(n_steps=1, memory_len=16)),
)


def training_flops_per_token(config: LadderConfig, seq_len: int) -> float:
    """Steady-state training FLOPs per token: n_steps passes over the segment and its memory (``seq_len``
    tokens, of which at most M before the segment). The Transformer-XL memory's keys/values are projected
    through the fused q/k/v projection once per layer application and segment, i.e. M / T times per token."""
    extra = config.n_steps * config.n_layer * qkv_flops(config) * min(config.memory_len, seq_len) / seq_len
    head = 6 * config.d_model * config.padded_vocab_size
    return config.n_steps * stack_flops(config.stack(), 1, seq_len + config.memory_len) + extra + head


SPEC = FamilySpec(
    name="ladder",
    config_class=LadderConfig,
    model_class=Ladder,
    scoring="cached",
    presets=PRESETS,
    training_flops_per_token=training_flops_per_token,
    recurrent=lambda config: config.memory_len > 0,
    shard_per_layer=lambda config: not config.memory_len,  # the memory's K/V come from each layer's projections
    core=lambda config: config.stack(),
    cost_note="the core once per step over the segment and its memory",
)
