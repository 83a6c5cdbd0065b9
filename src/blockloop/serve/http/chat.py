"""Chat prompts: messages -> prompt text through a chat template, a history kept within the context, and the
terminal chat's conversation on an engine thread (:class:`ChatSession`).

Where the template comes from: the Jinja file ``--chat-template`` names, else the first found of

1. the template the tokenizer carries (``Tokenizer.chat_template``: SmolLM2's, or a Hugging Face import's);
2. the checkpoint folder's ``chat_template.jinja``, or the ``chat_template`` of its ``tokenizer_config.json``
   (the Hugging Face layout);
3. for a run saved before tokenizers carried their template, SmolLM2's when its tokenizer is ``smollm2``;
4. the plain template, for models trained here on raw text::

       System: {system message}

       User: {user message}

       Assistant: {assistant message}

       User: ...

       Assistant:

   with ``"\\nUser:"`` as a stop string, so a model that goes on to write the user's next turn stops there.

A Jinja template is rendered like ``transformers``' ``apply_chat_template`` (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``add_generation_prompt=True``, the tokenizer's ``bos_token`` / ``eos_token`` / ``pad_token``
and ``strftime_now``); a ``developer`` message reaches it as ``system``, the role templates know. Its end-of-turn
token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>`` or ``</s>``, whichever the template writes and the
tokenizer has as one special id) stops generation like the end-of-text token.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from blockloop.data.tokenizers import Tokenizer, build_tokenizer, folder_chat_template
from blockloop.errors import BlockloopError
from blockloop.serve.http.text import TextStream
from blockloop.serve.http.worker import EngineWorker, Event, Job
from blockloop.serve.requests import SamplingParams, wrap_seed
from blockloop.signals import Terminated

if TYPE_CHECKING:
    from jinja2 import Environment, Template  # imported only by chats with a Jinja template

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "</s>")
PLAIN_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
Message = dict[str, str]


@dataclass
class ChatTemplate:
    """Renders a conversation into the prompt text the model continues with the assistant's answer."""

    source: str | None = None  # Jinja text; None = the plain template
    stop: list[str] = field(default_factory=list)  # stop strings every chat request gets
    stop_ids: list[int] = field(default_factory=list)  # end-of-turn token ids
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, pad_token: their text
    origin: str = "the checkpoint's chat template"  # what an error tells the user to fix
    compiled: Template | None = field(init=False, repr=False, compare=False)  # the source, compiled once

    def __post_init__(self) -> None:
        """Compile a Jinja source once, here: a template that does not compile is refused when the server or chat
        starts, not at every request."""
        from jinja2 import TemplateError

        if self.source is not None and not self.source.strip():  # every conversation would be an empty prompt
            raise BlockloopError(f"{self.origin} is empty; give a Jinja chat template with --chat-template")
        try:
            self.compiled = None if self.source is None else _environment().from_string(self.source)
        except TemplateError as exc:
            raise BlockloopError(f"the chat template does not compile ({type(exc).__name__}: {exc}); fix {self.origin}, "
                                 "or give another with --chat-template") from None
        try:  # one that compiles but writes nothing (all comments, say) would make every prompt empty
            silent = self.source is not None and not self.render([{"role": "user", "content": "Hello"}]).strip()
        except BlockloopError:  # one that refuses this conversation may take others: judged per request
            silent = False
        if silent:
            raise BlockloopError(f"{self.origin} writes no text for a conversation; give a Jinja chat template that "
                                 "renders the messages, with --chat-template")

    def render(self, messages: list[Message], add_generation_prompt: bool = True, continue_final: bool = False) -> str:
        """The prompt for the assistant's next turn (``add_generation_prompt``: the template's opening of it), or,
        with ``continue_final``, text that continues the last message, cut right after its content
        (``transformers``' ``continue_final_message``: a client's or lm-eval's answer prefix such as "Answer:")."""
        if self.source is None:
            turns = "".join(f"{PLAIN_NAMES[m['role']]}: {m['content']}\n\n" for m in messages)
            if continue_final:
                return turns.removesuffix("\n\n")
            return turns + "Assistant:" if add_generation_prompt else turns
        from jinja2 import TemplateError

        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        try:
            text = self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
            if not continue_final or not messages:
                return text
            last = messages[-1]["content"].strip()
            if last not in text:
                raise BlockloopError(f"{self.origin} does not write the last message's text as given, so the text "
                                     "cannot continue it; end the messages without continue_final_message")
            return text[: text.rindex(last) + len(last)]
        except BlockloopError:
            raise  # the template's own raise_exception: its message is for the client
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as exc:  # what template code raises
            raise TemplateFailure(f"the chat template failed on these messages ({type(exc).__name__}: {exc}); "
                                  f"fix {self.origin}") from None


class TemplateFailure(BlockloopError):
    """The chat template itself failed on a conversation (not its ``raise_exception`` refusing one): the server's
    configuration to fix, not the client's request."""


def _environment() -> Environment:
    """A Jinja environment as ``transformers`` renders chat templates in: sandboxed, with its helpers."""
    from jinja2.ext import loopcontrols  # a dependency of torch
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise BlockloopError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


def plain_template() -> ChatTemplate:
    return ChatTemplate(None, stop=["\nUser:"])


def jinja_template(source: str, tokenizer: Tokenizer, origin: str = ChatTemplate.origin) -> ChatTemplate:
    """A Jinja chat template; its end-of-turn tokens that ``tokenizer`` has as single special ids stop generation."""
    ids = []
    for marker in END_OF_TURN:
        encoded = tokenizer.encode(marker) if marker in source else []
        if len(encoded) == 1 and tokenizer.decode(encoded) == "":  # one special id, not plain text
            ids.append(encoded[0])
    try:
        vocabulary = tokenizer.hf_tokenizer()
    except BlockloopError:  # a task's word list: no token texts to give the template
        vocabulary = None
    ids_of = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    texts = {name: vocabulary.id_to_token(i) for name, i in ids_of.items() if i is not None} if vocabulary else {}
    return ChatTemplate(source, stop_ids=ids, special_tokens={k: v for k, v in texts.items() if v is not None},
                        origin=origin)


def chat_template_for(tokenizer: Tokenizer, directory: Path | None = None, source: str | None = None) -> ChatTemplate:
    """The template a checkpoint's chats use: ``source`` (``--chat-template``) where given, else the first found in
    the module docstring's order."""
    if source is not None:
        return jinja_template(source, tokenizer, origin="the --chat-template file")
    if tokenizer.chat_template is not None:
        return jinja_template(tokenizer.chat_template, tokenizer)
    source = folder_chat_template(directory) if directory is not None else None
    if source is not None:
        return jinja_template(source, tokenizer)
    if tokenizer.name == "smollm2":
        source = build_tokenizer("smollm2").chat_template
        if source is not None:
            return jinja_template(source, tokenizer)
    return plain_template()


def trim_history(messages: list[Message], fits: Callable[[list[Message]], bool], limit: str = "the model context"
                 ) -> list[Message]:
    """The longest recent part of a conversation that ``fits``: system messages stay, the oldest other turns go
    first, a user message with the answers to it, so the kept part starts with a user message as chat templates
    expect (many refuse a conversation that starts with the assistant). Raises when even the last message alone
    does not fit (in ``limit``, as the message says)."""
    system = [m for m in messages if m["role"] in ("system", "developer")]
    turns = [m for m in messages if m["role"] not in ("system", "developer")]
    for start in range(len(turns)):
        if start and turns[start]["role"] == "assistant":  # never keep an answer without its question
            continue
        kept = system + turns[start:]
        if fits(kept):
            return kept
    raise BlockloopError(f"the last message alone does not fit {limit}; write a shorter one or /reset")


class ChatSession:
    """A conversation with the model behind ``worker``: each answer is streamed, the history is trimmed to leave
    room for an answer of ``max_new_tokens`` (or half the context, if less), and answer ``i`` samples with seed
    ``seed + i`` so a seeded conversation replays exactly."""

    def __init__(self, worker: EngineWorker, tokenizer: Tokenizer, template: ChatTemplate, *, max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), system: str | None = None) -> None:
        if max_new_tokens < 1:
            raise BlockloopError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        task = getattr(tokenizer, "task", None)  # a TaskTokenizer: the words of a state-tracking task
        if task is not None and template.source is None:
            raise BlockloopError(f"this model reads the words of task {task}, not text, so it cannot chat; continue "
                                 "a sequence of its words with blockloop generate --checkpoint RUN --prompt ...")
        self.worker, self.tokenizer, self.template = worker, tokenizer, template
        self.max_new_tokens, self.sampling, self.system = max_new_tokens, sampling, system
        self.reset()
        # The least a turn takes: the template around an empty user message (and the system message), then a
        # word and an answer. Refused here rather than at every message.
        taken = len(self.prompt([*self.history, {"role": "user", "content": ""}]))
        if worker.engine.room(taken + 1) < 1:
            limit = self.limit()
            if self.history:
                raise BlockloopError(f"the system message and the template take {taken} of {limit}, leaving no "
                                     "room to chat; shorten it")
            raise BlockloopError(f"the chat template takes {taken} tokens around a message, leaving no room to chat "
                                 f"in {limit}; raise --max-len")

    def limit(self) -> str:
        """The most tokens a turn may take, as the messages that refuse one say it."""
        return (f"the {self.worker.engine.longest_request} tokens a request may take here (the model context, "
                "--max-len or --kv-tokens)")

    def reset(self) -> None:
        self.history: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = self.dropped = 0

    def prompt(self, messages: list[Message]) -> list[int]:
        return self.tokenizer.encode(self.template.render(messages))

    def ask(self, text: str, on_text: Callable[[str], None]) -> tuple[str, str]:
        """Answer ``text``, passing each new piece of text to ``on_text``; returns the answer and why it ended
        (``stop``, ``length``, or ``interrupted`` when Ctrl-C stopped it: the partial answer is kept)."""
        engine = self.worker.engine
        wanted = min(self.max_new_tokens, engine.max_len // 2)
        messages = [*self.history, {"role": "user", "content": text}]
        try:
            messages = trim_history(messages, lambda m: engine.room(len(self.prompt(m))) >= wanted)
        except BlockloopError:  # a long message: answer in whatever room is left
            messages = trim_history(messages, lambda m: engine.room(len(self.prompt(m))) >= 1, self.limit())
        self.dropped = len(self.history) + 1 - len(messages)  # earlier messages this answer no longer sees
        prompt = self.prompt(messages)
        s = self.sampling
        events: queue.Queue[Event] = queue.Queue()
        job = Job(prompt, min(self.max_new_tokens, engine.room(len(prompt))),
                  SamplingParams(s.temperature, s.top_k, s.top_p, seed=wrap_seed(s.seed + self.turns)),
                  TextStream(self.tokenizer, self.template.stop, self.template.stop_ids, prompt=prompt), events.put,
                  eos_id=self.tokenizer.eos_id)
        self.worker.submit(job)
        pieces: list[str] = []
        reason = None
        try:
            while reason is None:
                event = events.get()
                reason = event.finish_reason
                if reason == "error":
                    raise BlockloopError(f"generation failed: {event.tail}")
                new = "".join(event.pieces) + event.tail
                pieces.append(new)
                if new:
                    on_text(new)
        except KeyboardInterrupt as stop:
            self.worker.cancel(job)
            if isinstance(stop, Terminated):  # a scheduler's stop ends the chat; Ctrl-C ends only this answer
                raise
            reason = "interrupted"
        answer = "".join(pieces)
        self.history = [*messages, {"role": "assistant", "content": answer.strip()}]
        self.turns += 1
        return answer, reason
