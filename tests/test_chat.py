"""``blockloop chat`` and chat prompts: the conversation loop with fake input (streamed answers, /reset, Ctrl-C
stops an answer and not the program, history trimmed to the context), the real verb over stdin, and chat
templates (plain, and SmolLM2's own through transformers)."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from blockloop.cli.chat import converse
from blockloop.data.tokenizers import ByteTokenizer
from blockloop.errors import BlockloopError
from blockloop.serve.generate import generate
from blockloop.serve.http.chat import (
    ChatSession,
    TemplateFailure,
    chat_template_for,
    jinja_template,
    plain_template,
    trim_history,
)
from blockloop.serve.http.worker import EngineWorker, serving_engine
from blockloop.serve.requests import SamplingParams, wrap_seed
from blockloop.signals import Terminated
from blockloop.train.run import load_trained
from server_helpers import tiny_run

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny")


@pytest.fixture
def session(run):
    trained = load_trained(run)
    worker = EngineWorker(serving_engine(trained.model, 1, max_len=96))
    worker.start()
    yield ChatSession(worker, trained.tokenizer, chat_template_for(trained.tokenizer, trained.directory),
                      max_new_tokens=12, sampling=GREEDY, system="Be brief.")
    worker.close()


def lines(*texts):
    """A fake ``input``: the given lines, then end of input."""
    queue = list(texts)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)

    return read


def test_a_greedy_answer_is_generate_over_the_plain_template(run, session):
    reference = load_trained(run)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is there?"}]
    prompt = reference.tokenizer.encode(plain_template().render(messages))
    expected = generate(reference.model, [prompt], 12, temperature=0, eos_id=reference.tokenizer.eos_id)[0]
    shown: list[str] = []
    answer, reason = session.ask("Who is there?", shown.append)
    assert answer == "".join(shown) == reference.tokenizer.decode(expected).split("\nUser:")[0]
    assert session.history[-1] == {"role": "assistant", "content": answer.strip()}


def test_the_loop_streams_answers_and_reset_forgets_the_conversation(session):
    out: list[str] = []
    converse(session, lines("Who is there?", "", "/reset", "Nay, answer me."), out.append, interactive=False)
    text = "".join(out)
    assert "(conversation reset)" in text
    assert [m["role"] for m in session.history] == ["system", "user", "assistant"]
    assert session.history[1]["content"] == "Nay, answer me."


def test_an_unknown_command_is_named_not_sent_to_the_model(session):
    out: list[str] = []
    converse(session, lines("/help", "/clear", "/set-seed", "/"), out.append, interactive=False)
    assert "".join(out).count("(no command /") == 4 and "/reset forgets the conversation" in "".join(out)
    assert [m["role"] for m in session.history] == ["system"]  # nothing was asked


def test_ctrl_c_stops_the_answer_not_the_program(session):
    out: list[str] = []

    def write(text: str) -> None:
        out.append(text)
        if len(out) == 1:  # the first piece of the first answer: the user presses Ctrl-C
            raise KeyboardInterrupt

    converse(session, lines("Speak.", "Speak again."), write, interactive=False)
    assert " [stopped]\n" in out
    assert [m["role"] for m in session.history] == ["system", "user", "assistant", "user", "assistant"]
    engine = session.worker.engine
    assert engine.scheduler.free == [0]  # the cancelled answer gave its slot back


@pytest.mark.parametrize("where", ["answer", "prompt"])
def test_a_stop_signal_ends_the_chat_where_ctrl_c_would_only_stop_the_answer(session, where):
    """SIGTERM (a scheduler's stop, read as :class:`Terminated`) must end the chat: read as a plain Ctrl-C it only
    stopped the answer (or printed the help at the prompt) and the chat went on."""
    out: list[str] = []
    read = lines("Speak.", "Speak again.")

    def stopped_at_prompt(prompt: str) -> str:
        raise Terminated

    def write(text: str) -> None:
        out.append(text)
        if where == "answer" and len(out) == 1:
            raise Terminated

    with pytest.raises(Terminated):
        converse(session, read if where == "answer" else stopped_at_prompt, write, interactive=False)
    if where == "prompt":
        assert out == [] and [m["role"] for m in session.history] == ["system"]
        return
    assert len(out) == 1 and read("") == "Speak again."  # no second message was asked
    deadline = time.monotonic() + 30
    while session.worker.engine.scheduler.free != [0]:  # the stopped answer gives its slot back (next window)
        assert time.monotonic() < deadline, "the stopped answer kept its slot"
        time.sleep(0.01)


def test_a_line_that_cannot_be_answered_is_reported_and_the_chat_goes_on(session):
    """A message longer than the context, or undecodable input (a lone surrogate, as Python reads bad bytes), is
    refused with a line saying why; the next message is answered."""
    out: list[str] = []
    converse(session, lines("a" * 500, "caf\udce9", "Who is there?"), out.append, interactive=False)
    text = "".join(out)
    assert "does not fit the 96 tokens a request may take here (the model context, --max-len" in text
    assert "not valid UTF-8 text (byte 0xE9 at character 3)" in text
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["Who is there?"]


def test_a_system_message_that_leaves_no_room_is_refused_up_front(session):
    with pytest.raises(BlockloopError, match="system message and the template take .* shorten it"):
        ChatSession(session.worker, session.tokenizer, session.template, system="s" * 200)


def test_a_context_that_holds_no_turn_under_the_template_is_refused_up_front(run):
    """--max-len 2 leaves room for a one-token prompt and its answer, but the template alone takes more: refused as
    the chat starts, naming --max-len (before, every message was refused as if it were too long)."""
    trained = load_trained(run)
    worker = EngineWorker(serving_engine(trained.model, 1, max_len=2))
    with pytest.raises(BlockloopError, match="the chat template takes .* tokens around a message, leaving no room to "
                                             "chat in the 2 tokens a request may take here .*; raise --max-len"):
        ChatSession(worker, trained.tokenizer, chat_template_for(trained.tokenizer, trained.directory))


def test_a_context_with_no_room_to_chat_is_refused_as_the_engine_starts_without_blaming_a_system_message(run):
    trained = load_trained(run)
    with pytest.raises(BlockloopError, match=r"a context of 1 tokens leaves no room for a prompt and an answer; "
                                             r"raise max_len \(--max-len; at most the model context of"):
        serving_engine(trained.model, 1, max_len=1)
    # where --max-len is already the model context, raising it is no fix: another model is
    trained.model.config = trained.model.config.replace(context_length=1)
    with pytest.raises(BlockloopError, match="leaves no room for a prompt and an answer; use a model with a longer"):
        serving_engine(trained.model, 1)


def test_a_task_model_is_refused_up_front_not_on_every_line(session):
    from blockloop.data.tasks import TaskTokenizer, get_task

    tokenizer = TaskTokenizer("random-walk", get_task("random-walk").vocab)
    with pytest.raises(BlockloopError, match="reads the words of task random-walk, not text, so it cannot chat"):
        ChatSession(session.worker, tokenizer, chat_template_for(tokenizer))


def test_history_is_trimmed_to_leave_room_for_an_answer(session):
    engine = session.worker.engine
    for i in range(6):
        session.ask(f"Tell me of the {i}th sorrow of the house.", lambda text: None)
        assert engine.room(len(session.prompt(session.history[:-1]))) >= 1
    assert session.history[0] == {"role": "system", "content": "Be brief."}  # the system message stays
    assert session.history[1]["content"] != "Tell me of the 0th sorrow of the house."  # the oldest turns went
    assert session.history[-2]["content"] == "Tell me of the 5th sorrow of the house."
    assert session.dropped >= 2  # a question and its answer at least
    out: list[str] = []  # the chat says so, rather than forgetting silently
    converse(session, lines("And the seventh sorrow?"), out.append, interactive=False)
    assert f"({session.dropped} earlier messages left out of the conversation to fit the 96 tokens" in "".join(out)
    session.reset()
    assert session.dropped == 0


def test_trim_history_keeps_the_system_message_and_refuses_a_message_that_cannot_fit():
    messages = [{"role": "system", "content": "s"}] + [{"role": r, "content": str(i)}
                                                      for i, r in enumerate(["user", "assistant", "user"])]
    assert trim_history(messages, lambda m: len(m) <= 2) == [messages[0], messages[3]]
    with pytest.raises(BlockloopError, match="does not fit"):
        trim_history(messages, lambda m: False)


def test_trimmed_history_starts_with_a_user_message_so_strict_templates_accept_it(session):
    """Templates such as Gemma's and Mistral's refuse a conversation whose turns do not alternate from a user
    message: trimming drops a question with its answer, never leaves an answer first."""
    messages = [{"role": r, "content": str(i)} for i, r in enumerate(["user", "assistant", "user", "assistant", "user"])]
    assert trim_history(messages, lambda m: len(m) <= 4) == messages[2:]
    strict = jinja_template(
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{{ 'assistant:' }}", session.tokenizer)
    chat = ChatSession(session.worker, session.tokenizer, strict, max_new_tokens=12, sampling=GREEDY)
    for i in range(6):
        chat.ask(f"Tell me of the {i}th sorrow of the house.", lambda text: None)
        assert chat.history[0]["role"] == "user"
    assert chat.history[0]["content"] != "Tell me of the 0th sorrow of the house."  # the oldest turns went


def test_the_chat_verb_reads_stdin(run):
    proc = subprocess.run(
        [sys.executable, "-m", "blockloop.cli", "chat", "--checkpoint", str(run), "--temperature", "0",
         "--max-new-tokens", "6", "--device", "cpu"],
        input="Who is there?\n/reset\nAgain?\n/quit\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(conversation reset)" in proc.stdout and proc.stdout.count("\n") >= 3


def test_control_characters_of_an_answer_reach_a_terminal_as_escapes(run, monkeypatch):
    """An untrained byte-level model emits escape sequences (clear screen, cursor moves) and carriage returns; in a
    terminal they are written as escapes, through a pipe as they are: in chat and in generate."""

    from blockloop.cli import main
    from blockloop.cli.common import terminal_safe

    assert terminal_safe("a\x1b[2Jb\r\nc\td\x07\x7fé") == "a\\x1b[2Jb\\r\nc\td\\x07\\x7fé"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(ChatSession, "ask", lambda self, line, write: (write("\x1b[2Jhi\r"), ("hi", "stop"))[1])
    for out, expected in ((Terminal(), "\\x1b[2Jhi\\r"), (io.StringIO(), "\x1b[2Jhi\r")):
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr("builtins.input", lines("hello"))
        assert main(["chat", "--checkpoint", str(run), "--device", "cpu"]) == 0
        assert expected + "\n" in out.getvalue()
    for samples in ("1", "2"):  # generate too, streamed or printed
        for out, expected in ((Terminal(), "a\\x07b"), (io.StringIO(), "a\x07b")):
            monkeypatch.setattr(sys, "stdout", out)
            assert main(["generate", "--checkpoint", str(run), "--prompt", "a\x07b", "--max-new-tokens", "2",
                         "--num-samples", samples, "--device", "cpu"]) == 0
            assert out.getvalue().removeprefix("--- sample 1\n").startswith(expected), out.getvalue()


def test_plain_template_and_a_jinja_template_with_its_end_of_turn_token(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and?"}]
    assert plain_template().render(messages) == "User: hi\n\nAssistant: hello\n\nUser: and?\n\nAssistant:"
    assert plain_template().render(messages[:2], False, continue_final=True) == "User: hi\n\nAssistant: hello"
    assert plain_template().render(messages[:1], add_generation_prompt=False) == "User: hi\n\n"
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}<assistant>")
    template = chat_template_for(ByteTokenizer(), tmp_path)
    assert template.render(messages[:1]) == "<user>hi</s><assistant>"
    assert template.stop_ids == []  # "</s>" is five bytes for the byte tokenizer, not one special id
    given = chat_template_for(ByteTokenizer(), tmp_path, "[{{ messages[0].content }}]")  # --chat-template wins
    assert given.render(messages[:1]) == "[hi]"
    assert template.render(messages[:2], False, continue_final=True) == "<user>hi</s><assistant>hello"
    with pytest.raises(BlockloopError, match="does not write the last message's text"):  # nothing to continue
        given.render(messages[:2], False, continue_final=True)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages | length }}"')  # cut short
    with pytest.raises(BlockloopError, match="tokenizer_config.json is not valid JSON"):
        chat_template_for(ByteTokenizer(), tmp_path)


def test_a_jinja_template_gets_the_special_tokens_and_helpers_transformers_gives_it():
    """``bos_token``/``eos_token``/``pad_token`` and ``strftime_now`` are defined (Gemma and Llama templates write
    ``{{ bos_token }}``), and a ``developer`` message reaches the template as ``system``."""
    source = ("{{ bos_token | default('-') }}{{ eos_token }}{{ pad_token }}{% for m in messages %}{{ m.role }}:"
              "{{ m.content }};{% endfor %}{{ strftime_now('%Y') | length }}")
    template = jinja_template(source, ByteTokenizer())
    assert template.render([{"role": "developer", "content": "be brief"}]) == "-<|endoftext|><|pad|>system:be brief;4"


@pytest.mark.parametrize("source", ["{% for m in messages %}", "{{ messages[0].content | no_such_filter }}"])
def test_a_template_that_does_not_compile_is_refused_when_it_is_loaded(source):
    """Before the server or chat starts, not as a 400 on every request."""
    with pytest.raises(BlockloopError, match="the chat template does not compile .*give another with --chat-template"):
        jinja_template(source, ByteTokenizer())


@pytest.mark.parametrize("source", ["{{ messages[0].content.strip(1, 2, 3) }}", "{{ messages[0].content + 1 }}",
                                    "{{ 1 / (messages | length - 1) }}", "{{ range(10**9) | length }}"])
def test_a_template_that_fails_to_render_is_one_error_not_a_traceback(source):
    """Jinja's own errors and the Python errors template code raises (a string plus a number, a division by
    zero, the sandbox's refusal of a huge range) alike: one error naming the template to fix (the server answers it
    as its own 500), not a traceback."""
    template = jinja_template(source, ByteTokenizer())
    with pytest.raises(TemplateFailure, match="the chat template failed on these messages"):
        template.render([{"role": "user", "content": "hi"}])


def test_template_errors_name_the_template_to_fix_and_an_empty_one_is_refused_when_loaded():
    given = chat_template_for(ByteTokenizer(), source="{{ messages[0].content + 1 }}")
    with pytest.raises(BlockloopError, match="fix the --chat-template file$"):
        given.render([{"role": "user", "content": "hi"}])
    with pytest.raises(BlockloopError, match="fix the checkpoint's chat template$"):
        jinja_template("{{ messages[0].content + 1 }}", ByteTokenizer()).render([{"role": "user", "content": "hi"}])
    with pytest.raises(BlockloopError, match="the --chat-template file is empty"):
        chat_template_for(ByteTokenizer(), source=" \n")
    with pytest.raises(BlockloopError, match="the --chat-template file writes no text for a conversation"):
        chat_template_for(ByteTokenizer(), source="{# only a comment #}\n")


def test_a_seeded_chat_counts_its_turns_past_the_largest_seed():
    assert wrap_seed(2**63 - 1) == 2**63 - 1 and wrap_seed(2**63) == -(2**63) and wrap_seed(5) == 5


@pytest.mark.slow
def test_smollm2_chats_through_its_own_template_like_transformers():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from blockloop.data.pretrained import SMOLLM2_GGUF, smollm2_files
    from blockloop.data.tokenizers import build_tokenizer

    tok = build_tokenizer("smollm2")
    template = chat_template_for(tok)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    hf = AutoTokenizer.from_pretrained(smollm2_files(), gguf_file=SMOLLM2_GGUF, local_files_only=True)
    assert template.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.stop_ids == [tok.encode("<|im_end|>")[0]] and tok.encode(template.render(messages))[0] == 1
    # lm-eval's answer prefix: the text continues the assistant's started turn, as transformers writes it
    started = [*messages, {"role": "assistant", "content": "Answer:"}]
    assert template.render(started, False, continue_final=True) == hf.apply_chat_template(
        started, tokenize=False, continue_final_message=True)


def test_an_answer_budget_past_the_context_is_warned_about_as_the_chat_starts(run, monkeypatch, capsys):
    from blockloop.cli import main

    monkeypatch.setattr("builtins.input", lines())
    assert main(["chat", "--checkpoint", str(run), "--max-len", "64", "--max-new-tokens", "500", "--device", "cpu"]) == 0
    assert ("warning: --max-new-tokens 500 is more than the 64 tokens a request may take here; each answer ends where "
            "its context is full") in capsys.readouterr().err
    assert main(["chat", "--checkpoint", str(run), "--max-len", "64", "--max-new-tokens", "20", "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_unseeded_chat_samples_anew_each_session_and_a_seeded_one_replays(run, monkeypatch):
    """The seed defaulted to 0, so every session gave the same answers to the same messages, unlike `generate` and
    a server request without a seed."""
    from blockloop.cli import main

    def answers(*flags: str) -> str:
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr("builtins.input", lines("Who art thou?"))
        assert main(["chat", "--checkpoint", str(run), "--device", "cpu", "--max-new-tokens", "24", *flags]) == 0
        return out.getvalue()

    assert answers() != answers()  # 24 tokens sampled at temperature 1: the same twice by chance is negligible
    assert answers("--seed", "5") == answers("--seed", "5")
