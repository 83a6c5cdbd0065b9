"""The block-based double decoder (Alexander et al. 2026): config, presets, partition batching, FLOPs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from blockloop.config import ModelConfig, PretrainedFeatures, TransformerShape, split_layers
from blockloop.data.collate import unscored_prefix
from blockloop.data.partitions import PARTITIONS, prefix_partition, sample_partition
from blockloop.families.costs import (
    attention_flops,
    kv_cache_bytes,
    layer_weights,
    paper_kv_bytes_of_decoder_layers,
    param_bytes,
)
from blockloop.families.decoder import PAPER_SIZES, llama_tiny, paper_shape
from blockloop.families.spec import Batch, FamilySpec, Preset
from blockloop.models.double_decoder import DoubleDecoder


@dataclass
class DoubleDecoderConfig(PretrainedFeatures, TransformerShape, ModelConfig):
    """A block-based double decoder (section 3.1): context decoder + generation decoder.

    ``n_layer`` is the total depth, split into ``n_context_layer`` causal context-decoder layers and
    ``n_generation_layer`` generation-decoder layers (paper: 8/4, 10/5 for the smallest models). The block
    partition sampled for every training batch follows ``partition`` (see :mod:`blockloop.data.partitions`):
    ``uniform`` draws the number of blocks uniformly from 1..``max_blocks`` and the boundaries uniformly;
    ``logspace`` places the boundaries geometrically; ``histogram`` draws block lengths from
    ``partition_lengths`` (e.g. observed prompt lengths). No sliding-window local layers: the generation
    decoder's masks are the partition's.
    """

    family: ClassVar[str] = "double_decoder"

    n_context_layer: int | None = None
    n_generation_layer: int | None = None
    partition: str = "uniform"
    max_blocks: int = 16
    partition_lengths: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        self.n_context_layer, self.n_generation_layer = split_layers(
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

    @classmethod
    def unread_fields(cls, fields: Mapping[str, Any]) -> dict[str, str]:
        unread = super().unread_fields(fields)
        if fields["partition"] == "histogram":
            unread["max_blocks"] = "bounds the uniform and logspace partitions, and 'histogram' draws partition_lengths"
        else:
            unread["partition_lengths"] = f"are what partition='histogram' draws from, not {fields['partition']!r}"
        return unread


PRESETS = (
    *(Preset(f"paper-double-{size}", f"double decoder, {n_ctx} context / {n_gen} generation layers, d={d} "
             f"(double-decoder paper, ~{size} non-embedding)", {**paper_shape(d), "n_layer": n_ctx + n_gen,
                                                                "n_context_layer": n_ctx})
      for size, (n_ctx, n_gen, d) in PAPER_SIZES.items()),
    Preset("tiny-double", "3-layer double decoder (2 context + 1 generation) for CPU tests",
           {**llama_tiny(3, 64, 4, 4, 128), "n_context_layer": 2, "max_blocks": 8}),
    Preset("demo-double", "double decoder, 3 context + 1 generation layers, the CPU demo's size",
           {**llama_tiny(4, 128, 4, 4, 256), "n_context_layer": 3}),
)


def make_batch(config: DoubleDecoderConfig, inputs: Tensor, targets: Tensor, generator: torch.Generator,
               objective: str) -> Batch:
    """A block partition per batch (native objective), or the PrefixLM split [0, b) | [b, T)."""
    length = inputs.shape[1]
    if objective == "prefix_lm":
        targets, breakpoint = unscored_prefix(targets, generator)
        return {"idx": inputs, "targets": targets, "boundaries": prefix_partition(length, breakpoint)}
    c = config
    boundaries = sample_partition(length, c.partition, generator, max_blocks=c.max_blocks, lengths=c.partition_lengths)
    return {"idx": inputs, "targets": targets, "boundaries": boundaries}


def training_flops(config: DoubleDecoderConfig, seq_len: int, *, lm_head: bool = True) -> float:
    """The decoder's count with the generation layers' two extra projections (the cross k', v'); attention as
    the paper's "efficient implementation" (one attention's products per layer; ours computes two)."""
    w = layer_weights(config)
    layer = sum(w.values())
    head = config.d_model * config.padded_vocab_size if lm_head else 0
    n_ctx, n_gen = config.n_context_layer, config.n_generation_layer
    weights = n_ctx * layer + n_gen * (layer + w["kv"]) + head
    return 6 * seq_len * weights + attention_flops(config) * (n_ctx + n_gen) * seq_len**2


def paper_training_flops(seq_len: int, d_model: int, n_layer: int) -> float:
    """Appendix A.2: L (76 T d^2 + 12 T^2 d)."""
    return n_layer * (76 * seq_len * d_model**2 + 12 * seq_len**2 * d_model)



def kv_bytes(config: DoubleDecoderConfig, prompt_len: int, new_tokens: int, bytes_per_value: int = 2) -> int:
    return kv_cache_bytes(config, config.n_generation_layer, prompt_len + new_tokens, bytes_per_value)


def decode_bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float:
    """Section 3.3: only the generation layers and head run; they read cross K/V of the ``P - 1`` prompt
    latents and their own K/V of ``G / 2`` generated tokens on average."""
    c = model.config
    element = next(model.parameters()).element_size()
    weights = param_bytes(model.generation, model.norm, model.lm_head)
    return weights + batch * (prompt_len - 1 + gen_len / 2) * kv_cache_bytes(c, c.n_generation_layer, 1, element)


SPEC = FamilySpec(
    name="double_decoder",
    config_class=DoubleDecoderConfig,
    model_class=DoubleDecoder,
    scoring="partition",
    cost_note=("measured: its one dense attention over both key sets, 2T keys, counts two attentions' worth where "
               "the paper's efficient implementation counts one"),
    presets=PRESETS,
    training_flops=training_flops,
    make_batch=make_batch,
    kv_bytes=kv_bytes,
    decode_bytes_per_step=decode_bytes_per_step,
    paper_training_flops=paper_training_flops,
    paper_kv_bytes=paper_kv_bytes_of_decoder_layers,
    shard_per_layer=lambda config: False,  # the generation layers' cross K/V are projected before they run
    batch_wide_keys=("boundaries",),
)
