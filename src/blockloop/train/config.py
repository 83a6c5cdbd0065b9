"""How to train (:class:`TrainConfig`), apart from the loop that does it.

Torch-free, so ``blockloop train --help`` can show every default at once; :mod:`blockloop.train.trainer`
runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockloop.choices import DISTRIBUTED, OBJECTIVES, PRECISIONS, SCHEDULES
from blockloop.config import check_types
from blockloop.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38  # the optimizer keeps the learning rate in float32


@dataclass
class TrainConfig:
    """How to train; saved in every checkpoint so ``--resume`` continues the same run."""

    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 200
    eval_batches: int = 20
    log_interval: int = 10
    ckpt_interval: int = 500
    seed: int = 1337
    device: str = "auto"
    precision: str = "auto"
    compile: bool = False
    distributed: str = "ddp"
    objective: str = "lm"
    progress: bool = True
    # Distillation (RRT section 3.6): the teacher's checkpoint, pinned by absolute path, and its term's weight.
    distill_from: str | None = None
    distill_weight: float | None = None

    def __post_init__(self) -> None:
        check_types(self, "training setting ")
        positive = ("steps", "batch_size", "grad_accum", "seq_len", "eval_interval", "eval_batches", "log_interval",
                    "ckpt_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        ranges = (("lr", 0 < self.lr < FLOAT32_MAX, "> 0 and a float32 (below 3.4e38)"),
                  ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                  ("grad_clip", self.grad_clip >= 0, ">= 0 (0 disables clipping)"),
                  ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
                  ("seed", 0 <= self.seed < 2**32, "in [0, 2**32)"))
        for name, ok, allowed in ranges:
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')} must be {allowed}, got {getattr(self, name)}")
        choices = (("schedule", SCHEDULES), ("objective", OBJECTIVES), ("precision", PRECISIONS),
                   ("distributed", DISTRIBUTED))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.objective == "prefix_lm" and self.seq_len < 2:
            raise ConfigError("--objective prefix_lm splits each window into a prefix and a scored suffix; "
                              f"--seq-len must be at least 2, got {self.seq_len}")
        if (self.distill_weight is not None) != (self.distill_from is not None):
            raise ConfigError("distill_weight weighs the term of the teacher distill_from names: give both or neither")

    @staticmethod
    def saved_fields(data: dict[str, Any]) -> dict[str, Any]:
        """A saved ``train_config`` as this version reads it: train states written before distillation had its own
        fields hold it in an ``extra`` dict."""
        data = dict(data)
        extra = data.pop("extra", None) or {}
        return {**{k: extra[k] for k in ("distill_from", "distill_weight") if k in extra}, **data}

    def resolved_device(self) -> str:
        from blockloop.device import resolve_device  # imports torch

        return resolve_device(self.device)
