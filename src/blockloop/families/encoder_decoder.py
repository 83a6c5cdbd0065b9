"""The standard encoder-decoder of the double-decoder paper's comparison (T5-style, span corruption)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from blockloop.config import ModelConfig, PretrainedFeatures, TransformerShape, split_layers
from blockloop.data.collate import sample_breakpoint
from blockloop.data.span_corruption import span_corrupt, span_counts
from blockloop.families.costs import (
    attention_flops,
    kv_cache_bytes,
    layer_weights,
    paper_kv_bytes_of_decoder_layers,
)
from blockloop.families.decoder import PAPER_SIZES, llama_tiny, paper_shape
from blockloop.families.spec import Batch, FamilySpec, Preset
from blockloop.models.encoder_decoder import EncoderDecoder


@dataclass
class EncoderDecoderConfig(PretrainedFeatures, TransformerShape, ModelConfig):
    """A standard encoder-decoder (bidirectional encoder; decoder with self- and cross-attention) as in T5.

    ``n_layer`` is split into ``n_encoder_layer`` and ``n_decoder_layer``; the paper (section 4) removes
    decoder layers until the non-embedding parameters match the other families, since each decoder layer
    carries an extra cross-attention sublayer. Pretraining uses span corruption: ``corruption_rate`` of the
    tokens in spans of mean length ``mean_span_length``, each span replaced by one of ``n_sentinels``
    sentinel ids placed after the tokenizer's vocabulary (inside the padded embedding table). No
    sliding-window local layers: the encoder is bidirectional and the decoder's masks are its own.
    """

    family: ClassVar[str] = "encoder_decoder"

    n_encoder_layer: int | None = None
    n_decoder_layer: int | None = None
    corruption_rate: float = 0.15
    mean_span_length: float = 3.0
    n_sentinels: int = 32

    def validate(self) -> None:
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size + self.n_sentinels
        super().validate()
        self.n_encoder_layer, self.n_decoder_layer = split_layers(
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


# Per layer (in d^2): decoder 12, encoder-decoder decoder layer 16 (+ cross-attention), so the encoder-decoder
# keeps n_ctx encoder layers and round(12 n_gen / 16) decoder layers to match the decoder-only model of
# n_ctx + n_gen layers.
PRESETS = (
    *(Preset(f"paper-encdec-{size}", f"encoder-decoder, {n_ctx} encoder / {round(12 * n_gen / 16)} decoder layers, "
             f"d={d}, span corruption (double-decoder paper, ~{size} non-embedding)",
             {**paper_shape(d), "n_layer": n_ctx + round(12 * n_gen / 16), "n_encoder_layer": n_ctx})
      for size, (n_ctx, n_gen, d) in PAPER_SIZES.items()),
    Preset("tiny-encdec", "3-layer encoder-decoder (2 encoder + 1 decoder) for CPU tests",
           {**llama_tiny(3, 64, 4, 4, 128), "n_encoder_layer": 2}),
    Preset("demo-encdec", "encoder-decoder, 3 encoder + 1 decoder layers, the CPU demo's size",
           {**llama_tiny(4, 128, 4, 4, 256), "n_encoder_layer": 3}),
)


def make_batch(config: EncoderDecoderConfig, inputs: Tensor, targets: Tensor, generator: torch.Generator,
               objective: str) -> Batch:
    """Span corruption (native objective), or PrefixLM: encoder gets [0, b), decoder [b, T) scored."""
    if objective == "prefix_lm":
        b = sample_breakpoint(inputs.shape[1], generator)
        return {"idx": inputs[:, :b], "decoder_idx": inputs[:, b:], "targets": targets[:, b:]}
    c = config
    return span_corrupt(inputs, rate=c.corruption_rate, mean_span=c.mean_span_length,
                        first_sentinel=c.vocab_size, n_sentinels=c.n_sentinels, generator=generator)


def window_lengths(config: EncoderDecoderConfig, seq_len: int) -> tuple[int, int]:
    """(T_in, T_out) of a span-corrupted window of ``seq_len`` tokens."""
    noise, spans = span_counts(seq_len, config.corruption_rate, config.mean_span_length, config.n_sentinels)
    return seq_len - noise + spans, noise + spans


def training_flops(config: EncoderDecoderConfig, seq_len: int, out_len: int | None = None, *,
                   lm_head: bool = True) -> float:
    """The encoder over T_in = ``seq_len``, the decoder over T_out = ``out_len`` (default: the span-corruption
    lengths of a ``seq_len`` window) with cross-attention to the encoder output."""
    w = layer_weights(config)
    layer = sum(w.values())
    head = config.d_model * config.padded_vocab_size if lm_head else 0
    n_enc, n_dec = config.n_encoder_layer, config.n_decoder_layer
    T, To = window_lengths(config, seq_len) if out_len is None else (seq_len, out_len)
    tokens = T * n_enc * layer + To * (n_dec * (layer + w["q_o"]) + head) + T * n_dec * w["kv"]
    return 6 * tokens + attention_flops(config) * (n_enc * T**2 + n_dec * (To**2 + T * To))


def paper_training_flops(seq_len: int, d_model: int, n_layer: int, out_len: int) -> float:
    """Appendix A.2: L ((52 T_in + 28 T_out) d^2 + (4 T_out^2 + 4 T_in T_out + 8 T_in^2) d)."""
    T, To, d = seq_len, out_len, d_model
    return n_layer * ((52 * T + 28 * To) * d**2 + (4 * To**2 + 4 * T * To + 8 * T**2) * d)



def kv_bytes(config: EncoderDecoderConfig, prompt_len: int, new_tokens: int, bytes_per_value: int = 2) -> int:
    return kv_cache_bytes(config, config.n_decoder_layer, prompt_len + new_tokens, bytes_per_value)


SPEC = FamilySpec(
    name="encoder_decoder",
    config_class=EncoderDecoderConfig,
    model_class=EncoderDecoder,
    scoring="encoder",
    next_token_windows=False,
    lm_scores="span corruption",
    cost_note=("serving state: a slot holds max_len cross K/V and max_len self K/V, as the prompt / output split is "
               "not known in advance"),
    presets=PRESETS,
    training_flops=training_flops,
    make_batch=make_batch,
    kv_bytes=kv_bytes,
    paper_training_flops=paper_training_flops,
    paper_kv_bytes=paper_kv_bytes_of_decoder_layers,
    paper_lengths=window_lengths,
    shard_per_layer=lambda config: False,  # the decoder layers' cross K/V are projected before they run
)
