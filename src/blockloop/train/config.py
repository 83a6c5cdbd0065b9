"""How to train (:class:`TrainConfig`), apart from the loop that does it.

Torch-free, so ``blockloop train --help`` can show every default at once; :mod:`blockloop.train.trainer`
runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from blockloop.choices import OBJECTIVES, PRECISIONS, SCHEDULES
from blockloop.errors import ConfigError


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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "grad_accum", "seq_len", "eval_interval", "log_interval", "ckpt_interval")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"--objective {self.objective!r} is not one of {OBJECTIVES}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    def resolved_device(self) -> str:
        from blockloop.device import resolve_device  # imports torch

        return resolve_device(self.device)
