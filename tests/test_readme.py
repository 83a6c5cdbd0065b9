"""The README as a tested contract: every shell command in its ```bash blocks runs, in order, as written.

The commands run one after another in a scratch folder (so later ones find the runs earlier ones wrote), with
the virtualenv's ``blockloop`` and ``python`` first on PATH and a copy of ``benchmarks/``. Two conventions
in the README steer the run:

* a ``# expected error`` comment line before a command: that command must fail with a one-line message and
  no traceback;
* ``<!-- readme-test: skip: REASON -->`` on the line before a code block: the block is not run
  (placeholders such as ``path/to/model``; a client of a server another block stopped);
* ``<!-- readme-test: one script -->`` on the line before a ```bash block: the block runs as one ``bash -e``
  script, for commands that share shell state (a server started with ``&`` and killed at the end). Whatever
  the script leaves running is killed with it.

The two set-up commands are :data:`ENTRY_POINTS`: ``make demo`` runs as the ``blockloop demo`` it wraps (the
virtualenv it would set up is the one running this suite) and ``make test`` is this suite itself.

A command that is one plain ``blockloop ...`` call (no pipe, redirection, variable or glob) runs in this process
as its console script would, ``blockloop.cli.main(argv)``, in the scratch folder with the same environment: the
interpreter and torch are loaded already, which is most of a small command's time. Everything else runs in its
own process (``bash -e -c``, or ``python -c`` for a Python block).

To keep ``make test`` short every command is *scaled down* by :data:`SMOKE`: the same command with fewer
steps, requests, repeats and tokens. Everything else (presets, data, tokenizers, flags, paths) runs as
written, so a renamed flag, a default that does not fit a preset, or a missing run folder fails here.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip\b")
ONE_SCRIPT_MARK = re.compile(r"<!--\s*readme-test:\s*one script\s*-->")
EXPECTED_ERROR = "# expected error"
COMMAND_TIMEOUT_S = 600

ENTRY_POINTS = {"make demo": "blockloop demo", "make test": None}
# (pattern, replacement) applied to every command: the smoke-sized version of the same work.
SMOKE: list[tuple[str, str]] = [
    (r"--steps \d+", "--steps 2"),
    (r"--tokens \S+", "--steps 2"),
    (r"--requests \d+", "--requests 4"),
    (r"--repeats \d+", "--repeats 1"),
    (r"--gen-len \d+", "--gen-len 4"),
    (r"--max-new-tokens \d+", "--max-new-tokens 8"),
    (r"--batch-sizes \S+", "--batch-sizes 1"),
    (r"--max-batches \d+", "--max-batches 1"),
    (r"--limit \d+", "--limit 2"),
    (r"--eval-batches \d+", "--eval-batches 1"),
    (r"--seeds \d+", "--seeds 1"),
    (r"--curve-batches \d+", "--curve-batches 1"),
    (r"--windows \d+", "--windows 1"),
    (r"--ranks \S+", "--ranks 2"),
    (r"--sizes \S+", "--sizes 200,40,40"),
    (r"--tokens-range \S+", "--tokens-range 4,8"),
    (r"--scenario prefill-heavy", "--scenario prefill-heavy --prompt-len 128"),  # 2048 tokens of 85M models
    (r"--scenario (\S+)", r"--scenario \1 --gen-len 4"),
    # benchmarks whose README commands rely on their defaults: the same parts at one batch, one repeat
    (r"(benchmarks/block_vs_vanilla\.py)", r"\1 --eval-batches 1 --batches 1 --repeats 1 --batch-size 2"),
    (r"(benchmarks/staircase_speed\.py)", r"\1 --repeats 1 --batch-size 2 --seq-len 64"),
    (r"--variants \S+", "--variants eager"),
    (r"--log-interval \d+", "--log-interval 1"),
    (r"--seq-len 2048\b", "--seq-len 256"),
    (r" --search\b", ""),
    (r" --compile\b", ""),
    (r"^blockloop demo\b", "blockloop demo --steps 2"),
    (r"(blockloop\.cli|^blockloop) train\b", r"\1 train --steps 2 --eval-batches 1 --batch-size 2"),  # later flags still win
    (r"--batch-size \d+", "--batch-size 2"),
    (r"^blockloop eval\b(?![\s\S]*--(?:tasks|compare)\b)", "blockloop eval --max-batches 2"),  # loss mode only
    (r'"steps": \d+', '"steps": 2'),
]


@dataclass(frozen=True)
class Command:
    line: int  # 1-based line of the README where the command starts
    text: str
    expect_error: bool = False
    python: bool = False  # a whole ```python block, run as one script
    script: bool = False  # a whole ```bash block, run as one script


def readme_commands(text: str) -> list[Command]:
    """The commands of every ```bash block and the ```python blocks, in order, unless marked skip."""
    commands: list[Command] = []
    skip_next = skipping = expect_error = script_next = script = False
    block: str | None = None  # the language of the block we are in
    pending, start, source = "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if block is None:
            if SKIP_MARK.search(stripped):
                skip_next = True
            elif ONE_SCRIPT_MARK.search(stripped):
                script_next = True
            elif stripped in ("```bash", "```python"):
                block, skipping, start, source = stripped[3:], skip_next, number + 1, []
                script = script_next and block == "bash"
                skip_next = script_next = False
            elif stripped:
                skip_next = script_next = False
            continue
        if stripped.startswith("```"):
            if (block == "python" or script) and not skipping:
                commands.append(Command(start, "\n".join(source), python=block == "python", script=script))
            block = None
            continue
        if skipping:
            continue
        if block == "python" or script:
            source.append(line)
            continue
        if not pending:
            if stripped == EXPECTED_ERROR:
                expect_error = True
                continue
            if not stripped or stripped.startswith("#"):
                continue
            start = number
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        commands.append(Command(start, " ".join(pending.split()), expect_error))
        pending, expect_error = "", False
    return commands


def smoke(command: str) -> str | None:
    """The smoke-sized command to run, or None for ``make test`` (this suite)."""
    entry = command.split("#")[0].strip()
    if entry in ENTRY_POINTS:
        if ENTRY_POINTS[entry] is None:
            return None
        command = ENTRY_POINTS[entry]
    for pattern, replacement in SMOKE:
        command = re.sub(pattern, replacement, command, flags=re.MULTILINE)
    return command


def test_the_parser_reads_blocks_marks_and_continuations():
    text = "\n".join([
        "```bash", "blockloop a --steps 300   # trailing comment", "# a comment", "blockloop b \\", "  --x 1", "```",
        "<!-- readme-test: skip: never returns -->", "```bash", "blockloop serve", "```",
        "```bash", EXPECTED_ERROR, "blockloop c", "```", "```python", "x = 1", "print(x)", "```",
        "<!-- readme-test: one script -->", "```bash", "sleep 9 &", "kill $!", "```",
    ])
    assert readme_commands(text) == [
        Command(2, "blockloop a --steps 300 # trailing comment", False),
        Command(4, "blockloop b --x 1", False),
        Command(13, "blockloop c", True),
        Command(16, "x = 1\nprint(x)", python=True),
        Command(21, "sleep 9 &\nkill $!", script=True),
    ]
    assert smoke("blockloop bench --repeats 5 --search --compile") == "blockloop bench --repeats 1"
    assert smoke("blockloop train --tokens 2e6 --batch-size 16") == (
        "blockloop train --steps 2 --eval-batches 1 --batch-size 2 --steps 2 --batch-size 2")
    assert smoke("make demo   # comment") == "blockloop demo --steps 2" and smoke("make test") is None
    assert smoke(".venv/bin/python benchmarks/staircase_speed.py") == (
        ".venv/bin/python benchmarks/staircase_speed.py --repeats 1 --batch-size 2 --seq-len 64")
    # only a call the shell would merely split into words runs in-process
    assert plain_blockloop_call('blockloop generate --prompt "Who art thou?" # c | d') == [
        "generate", "--prompt", "Who art thou?"]
    assert plain_blockloop_call(".venv/bin/blockloop info runs/x") == ["info", "runs/x"]
    for shell in ("blockloop a | head", "blockloop a > f", 'blockloop a "$HOME"', "blockloop a *.txt", "X=1 blockloop a",
                  "blockloop a && blockloop b", "python3 -c 'x'", "torchrun -m blockloop.cli train"):
        assert plain_blockloop_call(shell) is None, shell
    assert smoke("blockloop bench --scenario prefill-heavy --hf") == (
        "blockloop bench --scenario prefill-heavy --gen-len 4 --prompt-len 128 --hf")


@pytest.mark.slow
@pytest.mark.longest
def test_every_readme_command_runs_as_written(tmp_path: Path):
    commands = readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(commands) > 20, "the README lost its commands"
    work = tmp_path / "readme"
    work.mkdir()
    shutil.copytree(ROOT / "benchmarks", work / "benchmarks")
    (work / "src").symlink_to(ROOT / "src", target_is_directory=True)
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for command in commands:
        text = smoke(command.text)
        if text is None:
            continue
        if not command.python and not command.script and shlex.split(text, comments=True)[0] == "export":
            for assignment in shlex.split(text, comments=True)[1:]:  # the shell's state, kept for what follows
                name, _, value = assignment.partition("=")
                env[name] = value
            continue
        argv = plain_blockloop_call(text) if not (command.python or command.script) else None
        code, stderr = run_command(command, text, work, env) if argv is None else run_in_process(argv, work, env)
        where = f"README.md:{command.line}: {command.text}\n(ran: {text})\n--- stderr ---\n{stderr[-3000:]}"
        if command.expect_error:
            assert code != 0, f"expected an error, got success\n{where}"
            assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, where
        else:
            assert code == 0, f"exit status {code}\n{where}"


SHELL_SYNTAX = set("|&;<>()$`*?[]{}~\\")  # outside quotes: the shell would read the command, not just split it


def plain_blockloop_call(text: str) -> list[str] | None:
    """The arguments of ``text`` if it is one call of the ``blockloop`` console script that the shell only splits
    into words (quotes aside: no operator, redirection, expansion or glob), else None."""
    quote = None
    for i, char in enumerate(text):
        if quote is not None:
            if char == quote:
                quote = None
            elif quote == '"' and char in "$`\\":
                return None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            break  # a comment: the rest of the line is not the command's
        elif char in SHELL_SYNTAX:
            return None
    words = shlex.split(text, comments=True)
    if not words or words[0] not in ("blockloop", ".venv/bin/blockloop"):
        return None
    return words[1:]


def run_in_process(argv: list[str], work: Path, env: dict[str, str]) -> tuple[int, str]:
    """Exit status and stderr of ``blockloop ARGV`` run as the console script runs it (``sys.exit(main(argv))``) in
    this process, in ``work`` with ``env``. What a command sets for the rest of its process (torch's threads and
    random state, progress bars, packed linears) is put back for the next command and the tests after this one."""
    import torch

    from blockloop import progress
    from blockloop.cli import main
    from blockloop.nn import linear

    saved_env, cwd = dict(os.environ), os.getcwd()
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    bars, packing = progress._enabled, linear._packing  # the flags --no-progress / --no-pack set for the process
    err = io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(work)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # --help, or argparse's own exit
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        progress.set_enabled(bars)
        linear.set_packing(packing)
    return code, err.getvalue()


def run_command(command: Command, text: str, work: Path, env: dict[str, str]) -> tuple[int, str]:
    """Exit status and stderr of one command, run in its own process group that is killed afterwards.

    Output goes to files, not pipes: a server a script started in the background would hold a pipe open.
    """
    argv = [sys.executable, "-c", text] if command.python else ["bash", "-e", "-c", text]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        err.seek(0)
        return code, err.read()
