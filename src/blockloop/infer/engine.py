"""The serving engine: continuous (sequence-wise) batching of requests over a fixed set of cache slots.

Every model family takes part through one small interface (:class:`SlotModel`): allocate static caches
for ``n_slots`` rows, prefill a request into a slot, run one decode step over all slots, and free a
slot. The engine owns everything else, once for all families: the request queue (WAITING -> RUNNING ->
FINISHED), per-request sampling on device (:func:`~blockloop.infer.sampling.sample_rows`), stopping,
and streaming.

The decode loop runs ``sync_every`` steps with no host synchronisation: the sampled tokens go to a
device ring buffer, and only then are they copied to the host in one transfer, where requests that hit
EOS or their token limit finish, free their slot, and waiting requests are prefilled into the free
slots while the others keep their caches. Rows that finished inside a window keep stepping until its
end (their extra tokens are discarded), which is the price of not syncing every token. Every row steps
every time, busy or not, so the decode step has static shapes (``torch.compile`` / CUDA graphs).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from blockloop.errors import BlockloopError
from blockloop.infer.requests import Request, SamplingParams, TokenCallback
from blockloop.infer.sampling import sample_rows
from blockloop.infer.scheduler import Scheduler


class SlotModel(Protocol):
    """What a model implements to be served. ``state`` is the model's own cache object.

    * ``allocate_slots(n_slots, max_len)``: static caches for ``n_slots`` requests of ``max_len`` tokens;
    * ``prefill_slot(state, slot, prompt (P,)) -> logits (V,)``: take over row ``slot`` for a new prompt;
    * ``decode_step(state, tokens (n_slots,)) -> logits (n_slots, V)``: one step for every row;
    * ``admit_every``: the engine admits new requests only every this many steps (1, or a Block
      Transformer's block length: rows share the within-block phase);
    * ``prompt_multiple``: prompts are left-padded to a multiple of this (1 unless set).
    """

    admit_every: int

    def allocate_slots(self, n_slots: int, max_len: int) -> Any: ...
    def prefill_slot(self, state: Any, slot: int, prompt: Tensor) -> Tensor: ...
    def decode_step(self, state: Any, tokens: Tensor) -> Tensor: ...


def serves(model: nn.Module) -> bool:
    """Whether ``model`` implements the slot interface."""
    return all(hasattr(model, name) for name in ("allocate_slots", "prefill_slot", "decode_step"))


class Engine:
    """Continuous batching over ``n_slots`` rows for one model (see the module docstring).

    ``compile=True`` wraps the decode step in ``torch.compile`` (``mode="reduce-overhead"``, i.e. CUDA
    graphs, on CUDA). The model is used as given: cast it (e.g. ``model.to(torch.bfloat16)``) first.
    """

    def __init__(
        self, model: nn.Module, n_slots: int, *, max_len: int | None = None, sync_every: int = 8, compile: bool = False
    ) -> None:
        if not serves(model):
            raise BlockloopError(f"{type(model).__name__} does not implement the engine's slot interface yet")
        if n_slots < 1:
            raise BlockloopError(f"the engine needs at least one slot, got n_slots={n_slots}")
        if sync_every < 1:
            raise BlockloopError(f"sync_every must be at least 1, got {sync_every}")
        context = model.config.context_length
        self.max_len = context if max_len is None else max_len
        if not 1 <= self.max_len <= context:
            raise BlockloopError(f"max_len {self.max_len} must be between 1 and the model context of {context}")
        model.eval()
        self.model, self.n_slots = model, n_slots
        self.admit_every = getattr(model, "admit_every", 1)
        self.prompt_multiple = getattr(model, "prompt_multiple", 1)
        # Windows end on admission points, so a window always starts where new requests may join.
        self.sync_every = -(-sync_every // self.admit_every) * self.admit_every
        self.vocab_size = model.config.vocab_size
        weight = next(model.parameters())
        self.device = weight.device
        self.state = model.allocate_slots(n_slots, self.max_len)
        self.scheduler = Scheduler(n_slots)
        self.logits = torch.zeros(n_slots, model.config.padded_vocab_size, dtype=weight.dtype, device=self.device)
        self.ring = torch.zeros(self.sync_every, n_slots, dtype=torch.long, device=self.device)
        # Each slot's sampling parameters and how many tokens its request has sampled, on device.
        self.temperature = torch.zeros(n_slots, device=self.device)
        self.top_p = torch.ones(n_slots, device=self.device)
        self.top_k, self.seed, self.counter = (torch.zeros(n_slots, dtype=torch.long, device=self.device) for _ in range(3))
        self._decode = model.decode_step
        if compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._decode = torch.compile(model.decode_step, mode=mode)
        self.steps = 0
        self.last_window: list[tuple[Request, list[int]]] = []

    # ------------------------------------------------------------- requests
    def submit(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        eos_id: int | None = None,
        on_token: TokenCallback | None = None,
    ) -> Request:
        """Queue a request; it is prefilled into the first free slot. Raises on a request that cannot fit."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise BlockloopError("every prompt needs at least one token; give a non-empty prompt")
        if max_tokens < 1:
            raise BlockloopError(f"max_tokens must be at least 1, got {max_tokens}")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise BlockloopError(f"prompt token ids must lie in [0, {self.vocab_size}); re-encode it with the model's tokenizer")
        padded = -(-len(prompt) // self.prompt_multiple) * self.prompt_multiple
        if padded + max_tokens > self.max_len:
            raise BlockloopError(
                f"prompt of {padded} tokens plus {max_tokens} new tokens exceeds the engine's {self.max_len}-token "
                "slots (the model context); shorten the prompt or lower max_tokens"
            )
        request = Request(prompt, max_tokens, sampling or SamplingParams(), eos_id, on_token, arrival_time=time.perf_counter())
        self.scheduler.add(request)
        return request

    # ------------------------------------------------------------- stepping
    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @torch.no_grad()
    def step(self) -> list[Request]:
        """Admit waiting requests into free slots, decode one window, and hand tokens to their requests.

        Returns the requests that finished in this window.
        """
        for slot, request in self.scheduler.admit():
            self._prefill(slot, request)
        running = dict(self.scheduler.running)
        if not running:
            return []
        filtered = any(r.sampling.filters for r in running.values())
        logits = self.logits
        for i in range(self.sync_every):
            tokens = sample_rows(
                logits[:, : self.vocab_size], self.temperature, self.top_k, self.top_p, self.seed, self.counter,
                filtered=filtered,
            )
            self.ring[i] = tokens
            self.counter.add_(1)
            logits = self._decode(self.state, tokens)
        self.logits = logits.clone()  # a compiled step may reuse its output buffer; prefill writes rows here
        self.steps += self.sync_every
        return self._collect(running)

    def _prefill(self, slot: int, request: Request) -> None:
        pad = -len(request.prompt) % self.prompt_multiple
        prompt = torch.tensor([getattr(self.model.config, "pad_id", 0)] * pad + request.prompt, device=self.device)
        self.logits[slot] = self.model.prefill_slot(self.state, slot, prompt)
        s = request.sampling
        self.temperature[slot], self.seed[slot], self.counter[slot] = s.temperature, s.seed, 0
        self.top_k[slot], self.top_p[slot] = s.top_k or 0, s.top_p if s.top_p is not None else 1.0

    def _collect(self, running: dict[int, Request]) -> list[Request]:
        tokens = self.ring.T.tolist()  # the window's one host sync
        now = time.perf_counter()
        finished, self.last_window = [], []
        for slot, request in running.items():
            start = len(request.output)
            for token in tokens[slot]:
                if request.accept(token, now):
                    self.scheduler.release(slot)
                    finished.append(request)
                    break
            self.last_window.append((request, request.output[start:]))
        return finished

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while not self.idle:
            self.step()

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Step until idle, yielding ``(request, new tokens)`` for each request after every window."""
        while not self.idle:
            self.step()
            yield from self.last_window


def generate_all(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, **kwargs: Any
) -> list[list[int]]:
    """Submit ``prompts`` and run to completion; each prompt's new tokens (convenience for tests/bench)."""
    requests = [engine.submit(p, max_tokens, **kwargs) for p in prompts]
    engine.run()
    return [r.output for r in requests]
