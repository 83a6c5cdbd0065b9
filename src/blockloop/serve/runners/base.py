"""The one protocol the serving engine drives: a runner serves one model family.

Models only compute (their ``forward`` and the small compute methods of their paper); a runner owns
everything generation adds around them: the static caches and per-slot decode state, prefilling a
request into a slot, one decode step over every slot, and the admission rules the engine must respect.
Lock-step generation is the engine with every request admitted at once; a runner that cannot prefill
one slot at a time (``per_slot = False``) is given a static batch through :meth:`Runner.prefill_batch`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor, nn


class Runner(ABC):
    """Serves ``model`` over ``n_slots`` rows; every row is a slot holding one request.

    Admission rules, read by the engine:

    * ``prompt_multiple``: prompts are left-padded with ``pad_id`` to a multiple of this (a Block
      Transformer's block length);
    * ``admit_every``: requests join only every this many decode steps (a Block Transformer's rows
      share the within-block phase);
    * ``token_per_step``: False when :meth:`decode_step` returns ``(logits, ready)``: only ``ready`` rows
      emit a token next step, the others are fed -1 (depth-wise batching);
    * ``per_slot``: False when requests can only be served in static batches (:meth:`prefill_batch`);
    * ``reserved``: context every request gives up to something the runner holds (a shared cached prefix).
    """

    prompt_multiple: int = 1
    admit_every: int = 1
    token_per_step: bool = True
    per_slot: bool = True
    reserved: int = 0
    pad_id: int = 0

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @abstractmethod
    def allocate(self, n_slots: int, max_len: int) -> None:
        """Static caches and decode state for ``n_slots`` requests of up to ``max_len`` tokens each."""

    @abstractmethod
    def prefill_slot(self, slot: int, prompt: Tensor) -> Tensor:
        """Take over row ``slot`` for ``prompt (P,)`` (the other rows keep their state); next-token logits ``(V,)``."""

    @abstractmethod
    def prefill_batch(self, idx: Tensor, token_valid: Tensor) -> Tensor:
        """Prefill rows ``0..B-1`` at once from left-padded prompts ``idx (B, P)`` (``token_valid`` marks the
        real tokens); next-token logits ``(B, V)``. The lock-step form of :meth:`prefill_slot`."""

    @abstractmethod
    def decode_step(self, tokens: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """Feed one token per row ``tokens (n_slots,)``; next-token logits ``(n_slots, V)`` (or, without
        ``token_per_step``, those and the ``(n_slots,)`` rows ready to emit)."""
