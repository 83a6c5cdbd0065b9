"""lm-evaluation-harness on blockloop checkpoints: importing this module registers the ``blockloop`` model type.

For people who have lm-eval and its data (``pip install 'blockloop[eval]'``; lm-eval fetches task data
from a hub unless the task reads local files)::

    import lm_eval
    import blockloop.evals.lm_eval_bridge  # registers "blockloop"
    lm_eval.simple_evaluate(model="blockloop", model_args="checkpoint=runs/smollm2,device=cpu", tasks=["piqa"])

``loglikelihood`` goes through :func:`blockloop.evals.scoring.score` (requests with the same context share
their prefix work, and every family is scored the way its spec says), ``loglikelihood_rolling`` scores
lm-eval's disjoint rolling windows the same way, and ``generate_until`` decodes greedily through the
engine, ``batch_size`` requests at a time, each cut at its first stop string. With lm-eval's
``apply_chat_template`` prompts go through the checkpoint's chat template, as ``serve`` and ``chat`` render them
(:func:`blockloop.serve.http.chat.chat_template_for`). lm-eval's own command line finds models only by import:
``python -m blockloop.evals.lm_eval_cli`` is that command line with this module imported.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from torch import nn

from blockloop.data.tokenizers import Tokenizer
from blockloop.device import resolve_device
from blockloop.errors import BlockloopError
from blockloop.evals.scoring import Request, check_requests, encode_request, score
from blockloop.families import spec_of
from blockloop.nn.linear import packed_linears
from blockloop.serve.engine import Engine
from blockloop.serve.http.chat import chat_template_for
from blockloop.serve.requests import SamplingParams
from blockloop.serve.runners import runner_for
from blockloop.train.run import load_trained


@register_model("blockloop")
class BlockloopLM(LM):
    """A blockloop checkpoint (``checkpoint=RUN``), or a ``model`` and ``tokenizer`` already in memory."""

    def __init__(self, checkpoint: str | None = None, device: str = "auto", batch_size: int | str = 8,
                 loops: int | str | None = None, model: nn.Module | None = None,
                 tokenizer: Tokenizer | None = None, **_: Any) -> None:
        super().__init__()
        if model is None:
            if not checkpoint:
                raise BlockloopError('the blockloop model needs checkpoint=RUN (model_args="checkpoint=runs/NAME"), '
                                     "or a model and tokenizer in memory")
            trained = load_trained(checkpoint, resolve_device(device))
            model, tokenizer, directory = trained.model, trained.tokenizer, trained.directory
        else:
            directory = None
        self.model, self.tokenizer = model.eval(), tokenizer
        self.template = chat_template_for(tokenizer, directory)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": lm-eval's default 8
        if self.batch_size < 1:
            raise BlockloopError(f"batch_size={batch_size!r} must be at least 1 (or auto)")
        if loops in (None, ""):
            self.exits = None
        elif not str(loops).isdigit():
            raise BlockloopError(f"loops={loops!r} is not a loop number; give loops=K, 1 <= K <= the model's loops")
        else:  # exits_of's own checks, in the words of model_args rather than of eval's flags
            most = getattr(self.model.config, "loops", None)
            if most is None or not 1 <= int(loops) <= most:
                raise BlockloopError(f"loops={loops} is not one of the model's loops (" +
                                     ("it has none; leave loops out)" if most is None else f"1..{most})"))
            self.exits = [int(loops)]

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> BlockloopLM:
        """lm-eval hands its own ``device`` and ``batch_size`` over beside ``model_args`` (its command line always
        a device, cuda:0 by default), which the base class passes twice: ``model_args`` win where they name one."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> BlockloopLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval's request cache keys chat-templated prompts by."""
        return self.tokenizer.name

    def chat_template(self, chat_template: bool | str = False) -> str:
        """The Jinja source lm-eval records beside its results ("" for the plain template)."""
        return self.template.source or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Without ``add_generation_prompt``, lm-eval asks to continue the assistant's turn it started (its answer
        prefix), as its Hugging Face model does."""
        return self.template.render(chat_history, add_generation_prompt, continue_final=not add_generation_prompt)

    def _score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        """Requests with equal contexts form groups of at most ``batch_size`` (one prefix pass each: lm-eval's
        ``acc_mutual_info`` asks every choice of every document after the same empty context, which must not
        become one forward of thousands of rows); answers in the order asked."""
        by_context: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(requests):
            by_context.setdefault(r.context, []).append(i)
        groups = [m[j : j + self.batch_size] for m in by_context.values() for j in range(0, len(m), self.batch_size)]
        order = [i for members in groups for i in members]
        scores = score(self.model, [[requests[i] for i in m] for m in groups], exits=self.exits,
                       batch_size=self.batch_size)
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for row, i in enumerate(order):
            answers[i] = (float(scores.loglikelihood[row, -1]), bool(scores.greedy[row, -1]))
        return answers

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Every task's requests are checked first, as ``eval`` checks its tasks: one line names each task that
        cannot be scored, before any scoring."""
        encoded = [encode_request(self.tokenizer, *req.args[:2]) for req in requests]
        by_task: dict[str, list[list[Request]]] = {}
        for req, request in zip(requests, encoded, strict=True):
            by_task.setdefault(getattr(req, "task_name", None) or "lm-eval", []).append([request])
        refused = []
        for task, groups in by_task.items():
            try:
                check_requests(self.model, groups, what="requests")
            except BlockloopError as exc:
                refused.append(f"{task}: {exc}")
        if refused:
            raise BlockloopError("; ".join(refused))
        return self._score(encoded)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        config = self.model.config
        multiple = spec_of(config).sequence_multiple(config)
        window = config.context_length - (multiple if multiple > 1 else 0)  # room for a block-padded context
        totals = []
        for req in requests:
            # The first window's one-token context is blockloop's empty context: the BOS of a model that reads
            # one, else the end of a previous text. (lm-eval's HF model takes any BOS the vocabulary names, even
            # one never read before a text, such as SmolLM2's <|im_start|>; none of the built-in tasks has an
            # empty context, so only rolling perplexity sees the difference.)
            start = self.tokenizer.start_id if self.tokenizer.start_id is not None else self.tokenizer.eos_id
            pairs = [make_disjoint_window(p) for p in get_rolling_token_windows(
                self.tokenizer.encode(req.args[0]), start, window, 1)]
            totals.append(sum(ll for ll, _ in self._score([Request(tuple(c), tuple(x)) for c, x in pairs])))
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, ``batch_size`` requests decoding at once through the engine (continuous batching);
        a request leaves at the first window after its text holds a stop string, and is cut there."""
        if self.exits is not None:  # decoding exits through the engine's exit rules, not at a fixed loop
            raise BlockloopError(f"loops={self.exits[0]} scores log-likelihoods at that loop's exit; generation runs "
                                 "the whole model, so run generation tasks without loops=")
        c = self.model.config
        engine = Engine(runner_for(self.model), min(self.batch_size, max(1, len(requests))), max_len=c.context_length)
        asked = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1])
            until = kwargs.get("until") or []
            # lm-eval ignores an empty stop string (a seq2seq EOS decodes to one)
            until = [stop for stop in ([until] if isinstance(until, str) else until) if stop]
            new = max(1, min(int(kwargs.get("max_gen_toks", 256)), c.context_length // 2))
            keep = c.context_length - new - spec_of(c).sequence_multiple(c)  # a block family pads the prompt
            ids, start = self.tokenizer.encode(context), self.tokenizer.start_id
            if start is not None:  # as the model reads a prompt: BOS first, kept when a long context is cut
                prompt = [start, *ids[max(0, len(ids) - (keep - 1)):]]
            else:
                prompt = (ids or [self.tokenizer.eos_id])[-keep:]
            request = engine.submit(prompt, new, sampling=SamplingParams(temperature=0.0), eos_id=self.tokenizer.eos_id)
            asked.append((request, until))
        with packed_linears(self.model, engine.step_rows), torch.no_grad():
            while not engine.idle:
                engine.step()
                for request, until in asked:
                    if not request.finished and _cut(self.tokenizer.decode(request.output), until) is not None:
                        engine.cancel(request)
        texts = [(self.tokenizer.decode(request.output), until) for request, until in asked]
        return [text if (cut := _cut(text, until)) is None else cut for text, until in texts]


def _cut(text: str, until: list[str]) -> str | None:
    """``text`` up to its first stop string, or None when it holds none."""
    found = [text.index(stop) for stop in until if stop in text]
    return text[: min(found)] if found else None
