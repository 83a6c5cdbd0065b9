"""The Block Transformer family (Ho et al. 2024): config, the Table 3/4 presets, block padding, FLOPs, roofline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from blockloop.config import DecoderConfig, ModelConfig
from blockloop.data.block_padding import random_length_padding
from blockloop.data.collate import sample_breakpoint
from blockloop.errors import ConfigError
from blockloop.families.costs import attention_flops, kv_cache_bytes, layer_weights, param_bytes, stack_flops
from blockloop.families.decoder import LLAMA_TINY, PYTHIA
from blockloop.families.spec import Batch, FamilySpec, Preset
from blockloop.models.block import BlockTransformer
from blockloop.nn.loss import IGNORE_INDEX

EMBEDDERS = ("lookup", "encoder", "cls")
TOKEN_DECODERS = ("prefix", "sum", "cross")


@dataclass
class BlockTransformerConfig(ModelConfig):
    """Block Transformer: embedder -> block decoder -> token decoder.

    ``context_length`` counts tokens; the block decoder sees ``context_length / block_len`` blocks.
    Embedders (appendix F.1): ``lookup`` concatenates ``block_len`` token embeddings of width
    ``embed_dim`` (default ``block_d_model / block_len``; any other width adds a projection, which is how
    a vanilla model's full-width embedding is reused when uptraining); ``encoder`` runs a small
    bidirectional transformer of width ``embed_dim`` over the block's tokens and projects their
    concatenation; ``cls`` reads ``n_cls`` CLS tokens of that encoder instead. Token decoders
    (appendix F.2): ``prefix`` projects the context embedding to ``prefix_len`` prefix tokens; ``sum``
    adds a projected context to each input position (MEGABYTE); ``cross`` lets every layer
    cross-attend to ``block_len`` projected context states (its layers are sequential: self-attention,
    cross-attention, MLP in turn, even in a ``parallel_residual`` preset). The layer style fields (norm, MLP,
    rotary, ...) apply to every transformer inside. ``pad_id`` fills blocks (random-length padding in training,
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

    def validate(self) -> None:
        super().validate()
        self._check((self.block_len >= 1, f"block_len must be at least 1, got {self.block_len}"))  # before dividing
        if self.embed_dim is None:
            self.embed_dim = self.block_d_model // self.block_len if self.embedder == "lookup" else 256
        # block 0 is never predicted: a one-block context could not train, score or generate anything
        choose = ""
        if self.context_length % self.block_len or self.context_length < 2 * self.block_len:  # say what would do
            fits = [n for n in range(1, self.context_length // 2 + 1) if self.context_length % n == 0]
            choose = f"; a block_len that divides it into at least two blocks: {', '.join(map(str, fits[-6:]))}" if fits else ""
        self._check(
            (
                self.context_length % self.block_len == 0,
                f"context_length={self.context_length} is not a multiple of block_len={self.block_len}{choose}",
            ),
            (
                self.context_length >= 2 * self.block_len,
                f"context_length={self.context_length} is one block of block_len={self.block_len}, and needs at least "
                f"two{choose}",
            ),
            (self.embedder in EMBEDDERS, f"embedder={self.embedder!r} is not one of {EMBEDDERS}"),
            (self.token_decoder in TOKEN_DECODERS, f"token_decoder={self.token_decoder!r} is not one of {TOKEN_DECODERS}"),
            (self.token_decoder != "prefix" or self.prefix_len >= 1, "the prefix token decoder needs prefix_len >= 1"),
            (self.embedder != "cls" or self.n_cls >= 1, "the cls embedder needs n_cls >= 1"),
            (0 <= self.pad_id < self.padded_vocab_size, f"pad_id={self.pad_id} is outside the vocabulary"),
            (self.embed_dim >= 1, f"embed_dim must be positive, got {self.embed_dim}"),
            (self.mup_base_width is None, "muP width scaling is not defined for block models (two widths)"),
        )
        parts = [self.block_decoder_config, self.token_decoder_config]
        if self.embedder != "lookup":  # the lookup embedder has no transformer: its layer and head counts are unused
            self._check(
                (self.embedder_n_layer >= 1, f"the {self.embedder} embedder needs embedder_n_layer >= 1"),
                (
                    self.embedder_n_head >= 1 and self.embed_dim % self.embedder_n_head == 0,
                    f"embedder_n_head={self.embedder_n_head} does not divide embed_dim={self.embed_dim}",
                ),
            )
            parts.append(self.embedder_config)
        for build_part in parts:
            build_part()  # each part validates its own shape

    @classmethod
    def unread_fields(cls, fields: Mapping[str, Any]) -> dict[str, str]:
        unread = super().unread_fields(fields)
        embedder, decoder = fields["embedder"], fields["token_decoder"]
        if embedder == "lookup":  # no transformer: concatenated token embeddings
            why = "sizes the encoder and cls embedders' transformer, and embedder='lookup' has none"
            unread.update(embedder_n_layer=why, embedder_n_head=why)
        if embedder != "cls":
            unread["n_cls"] = f"counts the CLS tokens of embedder='cls', not {embedder!r}"
        if decoder != "prefix":
            unread["prefix_len"] = f"sizes the prefix of token_decoder='prefix', not {decoder!r}"
        return unread

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
        return self._part(
            "embedder", context_length=self.block_len + (self.n_cls if self.embedder == "cls" else 0),
            n_layer=self.embedder_n_layer,
            d_model=self.embed_dim, n_head=self.embedder_n_head,
        )

    def summary(self) -> str:
        lead = f"prefix {self.prefix_len}" if self.token_decoder == "prefix" else self.token_decoder
        return (f"block {self.block_n_layer}x{self.block_d_model} + token {self.token_n_layer}x{self.token_d_model}, "
                f"L_B={self.block_len}, {self.embedder}, {lead}")


def pythia_block(token: tuple[int, int, int], block: tuple[int, int, int], **fields: Any) -> dict[str, Any]:
    """A Block Transformer with Pythia-style layers; ``token``/``block`` are (layers, width, heads)."""
    return {**PYTHIA, "block_len": 4, "token_n_layer": token[0], "token_d_model": token[1], "token_n_head": token[2],
            "block_n_layer": block[0], "block_d_model": block[1], "block_n_head": block[2], **fields}


def llama_block(n_layer: int, d_model: int, n_head: int, context_length: int) -> dict[str, Any]:
    """Block decoder and token decoder of ``n_layer`` Llama-style layers each, byte vocabulary."""
    return {**LLAMA_TINY, "context_length": context_length, "block_len": 4, "prefix_len": 2, "block_n_layer": n_layer,
            "block_d_model": d_model, "block_n_head": n_head, "token_n_layer": n_layer, "token_d_model": d_model,
            "token_n_head": n_head}


TABLE3 = {"5m": ((3, 256, 8), (3, 256, 8)), "19m": ((3, 512, 8), (3, 512, 8)), "85m": ((6, 768, 12), (6, 768, 12)),
          "302m": ((12, 1024, 16), (12, 1024, 16)), "805m": ((8, 2048, 16), (8, 2048, 16)),
          "1.2b": ((12, 2048, 16), (12, 2048, 16))}
TABLE4_MEGABYTE = {"5m": ((4, 128, 4), (5, 256, 8)), "19m": ((4, 256, 8), (5, 512, 8)),
                   "85m": ((4, 512, 8), (11, 768, 12))}

PRESETS = (
    *(Preset(f"block-{size}", f"Block Transformer, {size.upper()} non-embedding, L_B=4, prefix 2 (Table 3)",
             pythia_block(token, block, token_decoder="prefix", prefix_len=2))
      for size, (token, block) in TABLE3.items()),
    *(Preset(f"megabyte-{size}", f"MEGABYTE-style block model, {size.upper()} non-embedding, summation (Table 4)",
             pythia_block(token, block, token_decoder="sum"))
      for size, (token, block) in TABLE4_MEGABYTE.items()),
    Preset("tiny-block", "Block Transformer with 1+1 Llama-style layers (L_B=4, prefix 2) for CPU tests",
           llama_block(1, 64, 4, 128)),
    Preset("demo-block", "Block Transformer with the demo's 4 layers split 2+2 (L_B=4, prefix 2)",
           llama_block(2, 128, 4, 256)),
)


def make_batch(config: BlockTransformerConfig, inputs: Tensor, targets: Tensor, generator: torch.Generator,
               objective: str) -> Batch:
    """Random-length padding (appendix H) of the window, then the labels each position predicts.

    The window's ``T + 1`` tokens are re-packed so that every document starts after 0..L_B-1 pads
    and ends on a block boundary, and cut back to ``T`` tokens. Labels are the tokens themselves,
    except pads and the first block (which nothing predicts): ``IGNORE_INDEX``. Under ``prefix_lm`` the positions
    before the batch's breakpoint are not scored either.
    """
    c = config
    breakpoint = sample_breakpoint(inputs.shape[1], generator) if objective == "prefix_lm" else 0
    if inputs.shape[1] % c.block_len:
        raise ConfigError(f"sequence length {inputs.shape[1]} is not a multiple of block_len={c.block_len}; pad or cut it to "
                              "whole blocks")
    if inputs.shape[1] < 2 * c.block_len:
        raise ConfigError(f"a window of {inputs.shape[1]} tokens is one block, and the first block is never predicted: "
                          f"nothing would be scored; use a sequence length of at least {2 * c.block_len} (two blocks)")
    window = torch.cat([inputs[:, :1], targets], dim=1)
    if c.random_padding:
        idx, real = random_length_padding(window, c.block_len, eos_id=c.pad_id, pad_id=c.pad_id,
                                          length=inputs.shape[1], generator=generator)
    else:
        idx, real = window[:, :-1], torch.ones_like(window[:, :-1], dtype=torch.bool)
    labels = idx.masked_fill(~real, IGNORE_INDEX)
    labels[:, : max(c.block_len, breakpoint)] = IGNORE_INDEX
    return {"idx": idx, "targets": labels}


def training_flops_per_token(config: BlockTransformerConfig, seq_len: int) -> float:
    """Steady-state training FLOPs per token: per block (the block decoder once over T / L_B blocks, the
    token decoder over n_lead + L_B - 1 positions), divided by L_B."""
    lb = config.block_len
    token = config.token_decoder_config()
    per_block = stack_flops(config.block_decoder_config(), 1, seq_len // lb)
    if config.embedder == "lookup":
        per_block += 6 * lb * config.embed_dim * config.block_d_model if lb * config.embed_dim != config.block_d_model else 0
    else:
        width = lb + (config.n_cls if config.embedder == "cls" else 0)
        readout = (config.n_cls if config.embedder == "cls" else lb) * config.embed_dim
        per_block += stack_flops(config.embedder_config(), width, width) + 6 * readout * config.block_d_model
    positions = config.n_lead + lb - 1
    per_block += 6 * config.block_d_model * token.d_model * (config.prefix_len if config.token_decoder == "prefix" else lb)
    per_block += stack_flops(token, positions, positions)
    if config.token_decoder == "cross":
        w = layer_weights(token)
        per_block += token.n_layer * (6 * positions * w["q_o"] + 6 * lb * w["kv"])
        per_block += positions * token.n_layer * attention_flops(token) * lb
    per_block += lb * 6 * token.d_model * config.padded_vocab_size
    return per_block / lb


def decode_bytes_per_step(model: nn.Module, batch: int, prompt_len: int, gen_len: int) -> float:
    """Section 2, Table 1: the embedder and block decoder (weights and a block KV cache of ``(P + G/2) / L_B``
    entries) run once every ``L_B`` tokens; the token decoder (weights, and a local cache of
    ``n_lead + (L_B - 1) / 2`` entries on average) runs every token."""
    c = model.config
    element = next(model.parameters()).element_size()
    context = prompt_len + gen_len / 2
    slow = param_bytes(model.embedder, model.block_decoder) + batch * context / c.block_len * kv_cache_bytes(
        c.block_decoder_config(), c.block_n_layer, 1, element)
    td = model.token_decoder
    fast = param_bytes(td.body, td.context_proj, td.lm_head) + batch * (c.n_lead + (c.block_len - 1) / 2) * kv_cache_bytes(
        c.token_decoder_config(), c.token_n_layer, 1, element)
    return fast + slow / c.block_len


SPEC = FamilySpec(
    name="block",
    config_class=BlockTransformerConfig,
    model_class=BlockTransformer,
    scoring="blocks",
    next_token_windows=False,
    presets=PRESETS,
    training_flops_per_token=training_flops_per_token,
    make_batch=make_batch,
    sequence_multiple=lambda config: config.block_len,
    sequence_unit="block length",
    shortest_sequence=lambda config: 2 * config.block_len,
    shortest_reason="the first block is never predicted: a window needs two blocks",
    decode_bytes_per_step=decode_bytes_per_step,
    pad_with_eos=True,
    cost_note=("block decoder once per block, token decoder n_lead + L_B - 1 positions per block; the generation "
               "state is the block decoder's cache plus one block of token-decoder cache"),
)
