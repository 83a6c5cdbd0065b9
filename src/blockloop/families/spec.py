"""What a model family is, as data: :class:`FamilySpec`, one per family module, and its :class:`Preset` s.

The rest of the code asks a family's spec instead of branching on its name or probing its model: how to
batch a training window, which ``--seq-len`` it accepts, whether its state crosses segments, its FLOPs
and the bytes a decode step reads. A capability a family does not have is ``None`` (no roofline, no paper
closed form) or the plain decoder's answer (one window per batch, any length, no state).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from blockloop.choices import OBJECTIVES
from blockloop.config import ModelConfig
from blockloop.data.collate import Collate, lm_batch
from blockloop.errors import ConfigError

Batch = dict[str, Tensor]
MakeBatch = Callable[[Any, Tensor, Tensor, torch.Generator, str], Batch]


@dataclass(frozen=True)
class Preset:
    """A named config: its family's config class built from ``fields`` (plain data, JSON-like)."""

    name: str
    description: str
    fields: Mapping[str, Any]


def plain_batch(config: ModelConfig, inputs: Tensor, targets: Tensor, generator: torch.Generator, objective: str) -> Batch:
    """The window as it is (next-token prediction), for families with no batching needs of their own."""
    return lm_batch(inputs, targets, generator, objective)


def _one(config: ModelConfig) -> int:
    return 1


def _stateless(config: ModelConfig) -> bool:
    return False


def _always(config: ModelConfig) -> bool:
    return True


def _whole_window(config: ModelConfig, seq_len: int) -> tuple[int, ...]:
    return (seq_len,)


@dataclass(frozen=True)
class FamilySpec:
    """One paper family: its config, model, presets, batching, and the numbers the trainer and bench need.

    * ``make_batch(config, inputs, targets, generator, objective)``: a window's forward keyword arguments
      (random-length block padding, a sampled partition, span corruption...); see :mod:`blockloop.data.collate`.
    * ``sequence_multiple(config)``: what a training ``--seq-len`` must be a multiple of, named ``sequence_unit``.
    * ``shortest_sequence(config)``: the shortest window in which anything is scored, for ``shortest_reason``
      (a Block Transformer never predicts its first block); :meth:`check_seq_len` refuses both before a run starts.
    * ``recurrent(config)``: state crosses segments (truncated BPTT over contiguous streams).
    * ``training_flops_per_token(config, seq_len)``: steady-state training FLOPs per token (derived from
      ``training_flops(config, seq_len, ..., lm_head=True)`` for families counted over whole windows, appendix A).
    * ``kv_bytes(config, prompt_len, new_tokens, bytes_per_value)``: K/V held generating after a prompt.
    * ``decode_bytes_per_step(model, batch, prompt_len, gen_len)``: the decode roofline's bytes per step.
    * ``paper_training_flops(seq_len, d_model, n_layer, out_len)`` / ``paper_kv_bytes(d_model, n_layer,
      n_dec_layer, in_len, out_len, bytes_per_value)``: the double-decoder paper's closed forms (appendix A).
    * ``paper_lengths(config, seq_len)``: the lengths the closed form takes for a window (T, or T_in and T_out).
    * ``unrolled(config)``: the plain decoder whose compute and KV cache equal this model's (a looped model's
      depth), for the FLOP report; ``core(config)``: the plain decoder its recurrence repeats, shown beside it.
    * ``cost_note``: how ``training_flops_per_token`` counts, for families without an appendix-A closed form;
      for one with it, what the FLOP report's measured or serving columns count differently (its footnote).
    * ``pad_with_eos``: the config's ``pad_id`` is set to the tokenizer's end-of-text id when a run starts.
    * ``scoring``: how the log-likelihood of a continuation given a context is computed exactly (zero-shot
      evaluation, :mod:`blockloop.evals.scoring`): ``cached`` (the context once into the model's KV cache,
      every choice continues from it), ``causal`` (one causal forward over context + continuation),
      ``blocks`` (the context left-padded to whole blocks, as generation does), ``partition`` (the context
      as the first block of a two-block partition), ``encoder`` (the context as the encoder input); None:
      the family has not said, and evaluation refuses it rather than approximate.
    * ``next_token_windows``: ``make_batch`` passes a window's ``idx`` and its targets through, and position t
      of the logits predicts ``idx[t + 1]``: a labelled-position task trains and scores its labels, and a
      teacher's next-token distribution lines up for distillation (False where the batch is rebuilt from the
      inputs: block targets, span corruption; such a family is refused for both rather than misaligned).
    * ``shard_per_layer(config)``: ``--distributed fsdp`` may make each layer its own FSDP unit, gathered only
      around the layer's forward. False where the model calls a layer's weights outside that forward (the
      double decoder's and encoder-decoder's cross K/V projections, a recurrent core's K/V of carried states):
      FSDP then shards the model as one unit, gathered around the whole forward.
    * ``batch_wide_keys``: ``make_batch`` outputs that describe the whole batch rather than one row each (the double
      decoder's block partition); kept whole where a batch is cut into ranks' rows, every other output is cut.
    * ``lm_scores``: what the loss of the family's own ``lm`` objective scores, in words (:meth:`loss_scores`).
    """

    name: str
    config_class: type[ModelConfig]
    model_class: type[nn.Module]
    presets: tuple[Preset, ...]
    training_flops_per_token: Callable[[Any, int], float] | None = None
    training_flops: Callable[..., float] | None = None
    make_batch: MakeBatch = plain_batch
    sequence_multiple: Callable[[Any], int] = _one
    sequence_unit: str = "sequence multiple"
    shortest_sequence: Callable[[Any], int] = _one
    shortest_reason: str = ""
    recurrent: Callable[[Any], bool] = _stateless
    kv_bytes: Callable[[Any, int, int, int], int] | None = None
    decode_bytes_per_step: Callable[[Any, int, int, int], float] | None = None
    paper_training_flops: Callable[..., float] | None = None
    paper_kv_bytes: Callable[..., int] | None = None
    paper_lengths: Callable[[Any, int], tuple[int, ...]] = _whole_window
    unrolled: Callable[[Any], Any] | None = None
    core: Callable[[Any], Any] | None = None
    cost_note: str = ""
    pad_with_eos: bool = False
    scoring: str | None = None
    next_token_windows: bool = True
    shard_per_layer: Callable[[Any], bool] = _always
    batch_wide_keys: tuple[str, ...] = ()
    lm_scores: str = "next token"

    def loss_scores(self, objective: str) -> str:
        """What a loss under ``objective`` scores, in words: losses are compared (printed as one kind, plotted on
        one axis) only where equal. A Block Transformer's next-token loss leaves its first block out, as the paper's
        comparison does."""
        return "PrefixLM suffix" if objective == "prefix_lm" else self.lm_scores

    def check_seq_len(self, config: ModelConfig, seq_len: int) -> None:
        """Refuse a window the family cannot batch or score, before any data is read or a run's line is printed."""
        unit = self.sequence_multiple(config)
        if seq_len % unit:
            raise ConfigError(f"--seq-len {seq_len} is not a multiple of the model's {self.sequence_unit} {unit}; "
                              f"choose a multiple of {unit}")
        shortest = self.shortest_sequence(config)
        if seq_len < shortest:
            raise ConfigError(f"--seq-len {seq_len} would score nothing ({self.shortest_reason}); use at least {shortest}")

    def __post_init__(self) -> None:
        # A family counted over whole windows (appendix A) has its per-token count derived, not restated.
        if self.training_flops_per_token is None:
            if self.training_flops is None:
                raise ValueError(f"family {self.name!r} needs training_flops_per_token or training_flops")
            whole = self.training_flops
            object.__setattr__(self, "training_flops_per_token", lambda config, seq_len: whole(config, seq_len) / seq_len)

    def collate(self, config: ModelConfig, objective: str = "lm") -> Collate:
        """``(inputs, targets, generator) -> forward kwargs`` for ``objective`` (``lm`` or ``prefix_lm``)."""
        if objective not in OBJECTIVES:
            raise ConfigError(f"objective {objective!r} is not one of {OBJECTIVES}")
        return partial(self.make_batch, config, objective=objective)
