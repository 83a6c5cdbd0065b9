"""Incremental detokenization (``serve/http/text.py``): what a stream releases is the text the tokens add after
their prompt, whatever the tokenizer joins tokens with, whole characters only, stop strings held back; and
``blockloop generate`` writes nothing when the engine refuses the request."""

from __future__ import annotations

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.data.tasks.base import TaskVocab
from blockloop.data.tasks.tokenizer import TaskTokenizer
from blockloop.data.tokenizers import ByteTokenizer
from blockloop.serve.http.text import TextStream, continuation
from server_helpers import tiny_run


def test_a_word_tokenizer_stream_keeps_the_space_after_the_prompt_and_between_words():
    tok = TaskTokenizer("walk", TaskVocab(["END", "F", "L", "R", "r4c4", "p0"]))
    prompt, out = tok.encode("F L R"), tok.encode("r4c4 p0 r4c4")
    assert continuation(tok, prompt, out) == " r4c4 p0 r4c4"
    assert "F L R" + continuation(tok, prompt, out) == tok.decode(prompt + out)
    assert continuation(tok, [], out) == "r4c4 p0 r4c4"  # no prompt: nothing to join to


def test_a_byte_stream_releases_whole_characters_and_holds_back_a_stop_string():
    tok = ByteTokenizer()
    prompt = tok.encode("héllo ")
    stream = TextStream(tok, ["END"], prompt=prompt)
    pieces = [stream.push(t) for t in tok.encode("wörld EN")]
    assert "" in pieces[1:3] and all("\ufffd" not in p for p in pieces)  # 'ö' is two bytes: released once whole
    assert "".join(pieces) == "wörld "  # "EN" could begin the stop string "END"
    assert stream.push(tok.encode("D")[0]) == "" and stream.stopped
    assert continuation(tok, prompt, tok.encode("wörld")) == "wörld"


def test_a_stop_string_that_only_the_final_decode_reveals_still_ends_the_answer():
    """An answer cut inside a character ends in U+FFFD on the final decode; a stop string holding it must not
    reach the client there either, and the stream counts as stopped."""
    stream = TextStream(ByteTokenizer(), stop=["\ufffd"])
    text = "".join(stream.push(t) for t in [ord("o"), ord("k"), 0xE2, 0x82])  # "ok" then 2 of euro's 3 bytes
    assert not stream.stopped
    assert text + stream.flush() == "ok" and stream.stopped


def test_generate_writes_nothing_when_the_request_does_not_fit(tmp_path_factory, capsys):
    run = tiny_run(tmp_path_factory.getbasetemp() / "serve-runs", "tiny")
    capsys.readouterr()  # training's own output
    code = main(["generate", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "1000", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == EXIT_USER_ERROR and "exceeds the model context" in captured.err
    assert captured.out == ""  # the prompt was not echoed before the refusal
