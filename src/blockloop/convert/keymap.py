"""Declarative weight maps between Hugging Face state dicts and blockloop's, usable in both directions.

A :class:`KeyMap` is a list of :class:`Rule` s: one blockloop key, the Hugging Face key(s) it is made from,
and a :class:`Transform` that says how (copy, transpose a GPT-2 ``Conv1D`` weight, fuse separate q/k/v
projections into blockloop's single qkv projection, regroup GPT-NeoX's per-head interleaved qkv). Keys
may hold ``{}``, the layer index, and such a rule is expanded for every layer. Every transform has an
exact inverse, so the same table imports and exports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from blockloop.config import DecoderConfig
from blockloop.errors import BlockloopError


@dataclass(frozen=True)
class Transform:
    """``to_blockloop`` turns the Hugging Face tensors (in rule order) into one blockloop tensor;
    ``to_hf`` is its inverse."""

    to_blockloop: Callable[[list[Tensor], DecoderConfig], Tensor]
    to_hf: Callable[[Tensor, DecoderConfig], list[Tensor]]


COPY = Transform(lambda ts, c: ts[0], lambda t, c: [t])
# GPT-2 stores linear weights as Conv1D (in, out); nn.Linear keeps (out, in).
TRANSPOSE = Transform(lambda ts, c: ts[0].t(), lambda t, c: [t.t()])


def _qkv_sizes(c: DecoderConfig) -> list[int]:
    return [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim]


# Separate q_proj / k_proj / v_proj (Llama, Gemma) stacked into one fused qkv projection (rows q, k, v).
FUSE_QKV = Transform(lambda ts, c: torch.cat(ts, dim=0), lambda t, c: list(t.split(_qkv_sizes(c), dim=0)))


def _neox_to_blockloop(ts: list[Tensor], c: DecoderConfig) -> Tensor:
    t = ts[0]
    return t.reshape(c.n_head, 3, c.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _neox_to_hf(t: Tensor, c: DecoderConfig) -> list[Tensor]:
    return [t.reshape(3, c.n_head, c.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)]


# GPT-NeoX's query_key_value rows are grouped per head as (head, [q, k, v], head_dim); blockloop's are
# (q heads, k heads, v heads). A permutation of rows (weights and biases alike).
NEOX_QKV = Transform(_neox_to_blockloop, _neox_to_hf)


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    transform: Transform = COPY
    when: Callable[[DecoderConfig], bool] = lambda c: True


def rule(ours: str, *theirs: str, transform: Transform = COPY, when: Callable[[DecoderConfig], bool] | None = None) -> Rule:
    return Rule(ours, theirs, transform, when or (lambda c: True))


class KeyMap:
    """The rules of one architecture; ``{}`` in a key is the layer index."""

    def __init__(self, *rules: Rule) -> None:
        self.rules = rules

    def _expanded(self, config: DecoderConfig) -> list[tuple[str, tuple[str, ...], Transform]]:
        out = []
        for r in self.rules:
            if not r.when(config):
                continue
            for i in range(config.n_layer) if "{}" in r.ours else [None]:
                keys = [key.format(i) if i is not None else key for key in (r.ours, *r.theirs)]
                out.append((keys[0], tuple(keys[1:]), r.transform))
        return out

    def to_blockloop(self, hf_state: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
        """blockloop's state dict from a Hugging Face one; every rule's source key must be present."""
        ours = {}
        for key, theirs, transform in self._expanded(config):
            missing = [k for k in theirs if k not in hf_state]
            if missing:
                raise BlockloopError(
                    f"the Hugging Face weights lack {missing[0]} (needed for {key}); the checkpoint does not match "
                    "its config.json"
                )
            ours[key] = transform.to_blockloop([hf_state[k] for k in theirs], config).contiguous()
        return ours

    def to_hf(self, state: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
        """A Hugging Face state dict from blockloop's (the inverse of :meth:`to_blockloop`)."""
        theirs_state = {}
        for key, theirs, transform in self._expanded(config):
            for name, tensor in zip(theirs, transform.to_hf(state[key], config)):
                theirs_state[name] = tensor.contiguous()
        return theirs_state
