"""The command line: a full train -> eval -> generate -> info round trip, and one-line errors for bad input."""

from __future__ import annotations

import json
import re

import pytest

from blockloop.cli import COMMANDS, EXIT_USER_ERROR, main

TINY_TRAIN = [
    "train", "--preset", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1",
    "--log-interval", "2", "--eval-interval", "4", "--eval-batches", "1", "--ckpt-interval", "2", "--device", "cpu",
    "--no-progress",
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main([*TINY_TRAIN, "--out", str(out)]) == 0
    return out


def one_line_error(capsys, argv, match):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert match in err, err


def test_train_writes_checkpoints_and_metrics(trained_run):
    metrics = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [2, 4]
    assert any("val_loss" in m for m in metrics)
    assert (trained_run / "checkpoints" / "latest").read_text().strip() == "step_0000004"


def test_resume_extends_a_finished_run(trained_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    assert main(["train", "--steps", "6", "--out", str(run), "--resume", "--no-progress", "--distributed", "fsdp"]) == 0
    printed = capsys.readouterr()
    assert "step 4 of 6" in printed.out
    assert "warning: --distributed fsdp applies across torchrun's processes; this one process trains the whole" in printed.err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    # resumed once finished: nothing to train (no NaN loss); asked for fewer steps than it has: an error
    assert main(["train", "--steps", "6", "--out", str(run), "--resume", "--no-progress"]) == 0
    assert "already at step 6 of 6; nothing to train" in capsys.readouterr().out
    one_line_error(capsys, ["train", "--steps", "5", "--out", str(run), "--resume", "--no-progress"],
                   "already at step 6, past --steps 5")


def test_eval_reports_loss_perplexity_and_bits_per_byte(trained_run, capsys):
    assert main(["eval", "--checkpoint", str(trained_run), "--max-batches", "2", "--device", "cpu", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["split"] == "val" and metrics["tokens"] == 2 * 8 * 32
    assert metrics["perplexity"] == pytest.approx(2.718281828 ** metrics["loss"], rel=1e-6)
    # Byte-level tokens are one byte each: bits per byte = loss / ln 2.
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / 0.6931471805599453, rel=1e-6)


def test_generate_is_seeded_and_streams_the_prompt_first(trained_run, capsys):
    argv = ["generate", "--checkpoint", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "20",
            "--seed", "3", "--no-stop", "--device", "cpu"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("ROMEO:") and len(first.encode()) > len("ROMEO:")


def test_train_says_how_many_ids_a_bpe_learned_from_a_small_corpus(tmp_path, capsys, monkeypatch):
    """bpe:N on a corpus with fewer merges to learn gives fewer than N ids, under the name bpe:N: say so."""
    monkeypatch.setenv("BLOCKLOOP_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "notes.txt"
    text.write_text("the cat sat on the mat. " * 200, encoding="utf-8")
    argv = [arg if arg != "4" else "2" for arg in TINY_TRAIN]
    assert main([*argv, "--data", str(text), "--tokenizer", "bpe:4096", "--out", str(tmp_path / "run")]) == 0
    ids = int(re.search(r"with the bpe:4096 tokenizer \((\d+) ids\)", capsys.readouterr().out).group(1))
    assert 257 < ids < 4096


def test_info_and_presets(trained_run, capsys):
    assert main(["info", str(trained_run)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer: byte" in out and "trained: step 4 (256 tokens) on " in out
    assert main(["info", "--checkpoint", str(trained_run)]) == 0  # as every other verb takes it
    assert capsys.readouterr().out == out
    one_line_error(capsys, ["info", str(trained_run), "--checkpoint", str(trained_run)], "give the checkpoint once")
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "pythia-85m" in out and "85.06M" in out


def test_info_shows_a_model_saved_without_its_tokenizer(trained_run, tmp_path, capsys):
    """save_model_files writes the model alone; info refused it ("holds a model without its tokenizer")."""
    from blockloop.train.checkpoint import save_model_files
    from blockloop.train.run import load_trained

    trained = load_trained(trained_run)
    save_model_files(tmp_path / "alone", trained.model, trained.config)
    assert main(["info", str(tmp_path / "alone")]) == 0
    out = capsys.readouterr().out
    assert f"{trained.model.num_parameters() / 1e6:.3f}M parameters" in out
    assert "tokenizer: none saved" in out and "trained:" not in out and '"name": "tiny"' in out


def test_info_names_an_objective_other_than_next_token(trained_run, tmp_path, capsys):
    run = tmp_path / "plm"
    assert main(["train", "--init-from", str(trained_run), "--objective", "prefix_lm", "--steps", "1", "--batch-size",
                 "2", "--seq-len", "32", "--device", "cpu", "--no-progress", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["info", str(run)]) == 0
    assert "trained: step 1 (64 tokens) on shakespeare with the prefix_lm objective, initialised from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--preset", "gpt-17"], "unknown preset 'gpt-17'"),
        (["train", "--preset", "tiny", "--data", "/no/such/file.txt"], "/no/such/file.txt"),
        (["train", "--preset", "tiny", "--seq-len", "4096"], "exceeds the model context of 128"),
        (["train", "--preset", "tiny", "--batch-size", "0"], "--batch-size: must be an integer >= 1"),
        (["train", "--preset", "tiny", "--tokenizer", "sentencepiece-9"], "sentencepiece-9"),
        (["eval", "--checkpoint", "/no/such/run"], "checkpoint not found"),
        (["generate", "--checkpoint", "/no/such/run", "--prompt", "hi"], "checkpoint not found"),
        # an empty value (an unset shell variable) is refused, not read as the flag's default or the current folder
        (["train", "--preset", "", "--steps", "1"], "argument --preset: is empty"),
        (["train", "--preset", "tiny", "--task", "", "--steps", "1"], "argument --task: is empty"),
        (["train", "--preset", "tiny", "--task-dir", "", "--steps", "1"], "argument --task-dir: is empty"),
        (["eval", "--checkpoint", ""], "argument --checkpoint: is empty"),
        (["eval", "--checkpoint", "/no/such/run", "--data", ""], "argument --data: is empty"),
        (["eval", "--checkpoint", "/no/such/run", "--task", ""], "argument --task: is empty"),
        (["generate", "--checkpoint", "", "--prompt", "hi"], "argument --checkpoint: is empty"),
        (["serve", "--checkpoint", "/no/such/run", "--name", ""], "argument --name: is empty"),
        (["chat", "--checkpoint", ""], "argument --checkpoint: is empty"),
        (["tasks", "import", "data.jsonl", "--out", "x", "--name", ""], "argument --name: is empty"),
        (["tasks", "make", "random-walk:4", "--out", ""], "argument --out: is empty"),
        (["tasks", "import", "data.jsonl", "--out", ""], "argument --out: is empty"),
        (["convert", "--to", "weights", "--checkpoint", "", "--out", "x"], "argument --checkpoint: is empty"),
        (["bench", "--stream", "--checkpoint", ""], "argument --checkpoint: is empty"),
        (["demo", "--out", ""], "argument --out: is empty"),
        (["info", ""], "argument checkpoint: is empty"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, match):
    one_line_error(capsys, [*argv, *(["--out", str(tmp_path / "x")] if argv[0] == "train" else [])], match)


def test_errors_on_an_existing_run(trained_run, tmp_path, capsys):
    one_line_error(capsys, [*TINY_TRAIN, "--out", str(trained_run)], "already holds a run")
    one_line_error(capsys, ["train", "--out", str(tmp_path / "empty"), "--resume"], "empty holds no run to resume; drop --resume to start one there")
    one_line_error(
        capsys, ["generate", "--checkpoint", str(trained_run), "--prompt", "x" * 120, "--max-new-tokens", "20"],
        "exceeds the model context of 128",
    )
    one_line_error(
        capsys, ["generate", "--checkpoint", str(trained_run), "--prompt", "x", "--top-p", "2", "--device", "cpu"],
        "--top-p: must be a finite number in (0, 1]",
    )


def test_corrupt_checkpoint_is_reported(trained_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "checkpoints" / "step_0000004" / "model.safetensors").write_bytes(b"not a safetensors file")
    one_line_error(capsys, ["eval", "--checkpoint", str(run), "--device", "cpu"], "corrupt")
    (run / "checkpoints" / "step_0000004" / "config.json").write_text("{ nope")
    one_line_error(capsys, ["generate", "--checkpoint", str(run), "--prompt", "a", "--device", "cpu"], "not valid JSON")


def test_every_command_has_help(capsys):
    from blockloop.cli import COMMANDS

    for command in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        assert f"usage: blockloop {command}" in capsys.readouterr().out


@pytest.mark.parametrize("verb", [None, *COMMANDS])
def test_help_of_every_verb_imports_no_torch(verb):
    """`blockloop --help` and `blockloop VERB --help` must answer within 0.5 s (issue 17): building the parser may
    not import torch (2-5 s), so every default and choice a help shows comes from a torch-free module."""
    import subprocess
    import sys

    verbs = "set()" if verb is None else f"{{{verb!r}}}"
    code = ("import sys, time; t = time.perf_counter(); from blockloop.cli import COMMANDS, build_parser; "
            f"parser = build_parser({verbs}); text = parser.format_help(); elapsed = time.perf_counter() - t; "
            "heavy = sorted(m for m in ('torch', 'numpy', 'tokenizers', 'transformers') if m in sys.modules); "
            "print(heavy, all(v in text for v in COMMANDS), elapsed < 0.5)")
    if verb is not None:
        code += f"; parser.parse_args([{verb!r}, '--help'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split()[:3] == ["[]", "True", "True"], result.stdout + result.stderr
    if verb is not None:  # the verb's own help was printed, with its flags
        assert f"usage: blockloop {verb}" in result.stdout and result.returncode == 0, result.stderr


def test_demo_trains_compares_and_samples(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--steps", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "validation loss before training" in out and "=== comparison" in out and "vanilla decoder" in out
    assert "double decoder" in out
    assert (tmp_path / "demo" / "demo" / "checkpoints" / "latest").is_file()
    assert (tmp_path / "demo" / "demo-double" / "checkpoints" / "latest").is_file()
    # A rerun replaces the demo's own runs, and nothing else: refused before any training where a run folder holds
    # another file, or a run trained on since (its latest checkpoint not the one the demo left), or --out is a file.
    from blockloop.demo import check_demo_folder

    check_demo_folder(tmp_path / "demo")
    (tmp_path / "demo" / "demo-block" / "notes.txt").write_text("mine")
    one_line_error(capsys, ["demo", "--out", str(tmp_path / "demo"), "--steps", "1"],
                   "demo-block holds files the demo did not leave there (another run, files of yours, a demo run")
    (tmp_path / "demo" / "demo-block" / "notes.txt").unlink()
    (tmp_path / "demo" / "demo" / "checkpoints" / "latest").write_text("step_0000009\n")
    one_line_error(capsys, ["demo", "--out", str(tmp_path / "demo"), "--steps", "1"], "demo/demo holds files the demo")
    mark = tmp_path / "demo" / "demo" / "demo.json"  # as a demo stopped before its run finished leaves it
    mark.write_text(json.dumps({**json.loads(mark.read_text()), "latest": None}))
    check_demo_folder(tmp_path / "demo")
    (tmp_path / "afile").write_text("x")
    one_line_error(capsys, ["demo", "--out", str(tmp_path / "afile")], "afile is a file, not a folder")
    assert (tmp_path / "demo" / "demo" / "checkpoints" / "step_0000004").is_dir()  # nothing was replaced


def test_tokens_budget_sets_the_step_count(tmp_path):
    # 2 sequences x 32 tokens = 64 tokens per step, so 200 tokens is 3 whole steps.
    argv = [*TINY_TRAIN, "--out", str(tmp_path / "run"), "--tokens", "200"]
    del argv[argv.index("--steps") : argv.index("--steps") + 2]  # --tokens sets the step count; both are refused
    assert main(argv) == 0
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_0000003"


def test_a_token_budget_on_resume_counts_the_tokens_already_trained_at_their_own_batch_shape(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [*TINY_TRAIN, "--out", str(run), "--tokens", "200"]
    del argv[argv.index("--steps") : argv.index("--steps") + 2]
    assert main(argv) == 0  # 3 steps of 2 x 32 tokens: 192
    resume = ["train", "--out", str(run), "--resume", "--no-progress"]
    # 4 x 32 = 128 tokens per step now: (400 - 192) // 128 = 1 more step, not 400 // 128 = 3 steps in all
    assert main([*resume, "--tokens", "400", "--batch-size", "4"]) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    state = json.loads((run / "checkpoints" / "step_0000004" / "train_state.json").read_text())
    assert state["tokens"] == 192 + 128
    capsys.readouterr()
    one_line_error(capsys, [*resume, "--tokens", "300"], "has already trained on 320 tokens, past --tokens 300")


def test_resume_refuses_a_corpus_that_changed_since_the_checkpoint(tmp_path, capsys):
    corpus = tmp_path / "notes.txt"
    corpus.write_text("".join(f"line {i} of some text here.\n\n" for i in range(400)))
    run = tmp_path / "run"
    assert main([*TINY_TRAIN, "--data", str(corpus), "--steps", "2", "--out", str(run)]) == 0
    resume = ["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress"]
    corpus.write_text("".join(f"other {i} words.\n\n" for i in range(400)))
    assert main(resume) == EXIT_USER_ERROR  # (the new text is tokenized first, with its progress line)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "is not the data" in err.strip().splitlines()[-1]
    corpus.write_text("".join(f"line {i} of some text here.\n\n" for i in range(400)))  # restored: resumes
    assert main(resume) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000004"


def test_convert_to_block_then_uptrain_and_generate(trained_run, tmp_path, capsys):
    block = tmp_path / "block"
    assert main(["convert", "--to", "block", "--checkpoint", str(trained_run), "--out", str(block)]) == 0
    assert "train --init-from" in capsys.readouterr().out
    # a conversion was not trained: info says where it came from, not "trained: step 0 on <the source's data>"
    assert main(["info", str(block)]) == 0
    out = capsys.readouterr().out
    assert "trained:" not in out and "origin: converted from" in out and "not trained since" in out
    up = tmp_path / "up"
    argv = ["train", "--init-from", str(block), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
            "--warmup-steps", "1", "--eval-interval", "2", "--eval-batches", "1", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--out", str(up)]) == 0
    assert main(["info", str(up)]) == 0
    out = capsys.readouterr().out
    assert "model: block" in out and "trained: step 2" in out and f"initialised from {block}" in out
    assert main(["generate", "--checkpoint", str(up), "--prompt", "ab", "--max-new-tokens", "9", "--device", "cpu"]) == 0
    # The default --max-new-tokens is what the context leaves after the prompt padded to whole blocks (it used to
    # be refused by the very check it should satisfy, for a prompt that is not a multiple of the block length).
    context = json.loads(next((up / "checkpoints").glob("step_*/config.json")).read_text())["context_length"]
    assert main(["generate", "--checkpoint", str(up), "--prompt", "x" * (context - 5), "--temperature", "0",
                 "--no-stop", "--device", "cpu"]) == 0
    one_line_error(capsys, ["convert", "--to", "block", "--checkpoint", str(trained_run), "--out", str(block)],
                   "already holds a model")
    one_line_error(capsys, ["convert", "--to", "block", "--checkpoint", str(trained_run), "--out", str(tmp_path / "b3"),
                            "--block-len", "3"], "not a multiple of --block-len 3")
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "x"), "--preset", "tiny"], "--init-from keeps the saved model")


def test_a_conversion_that_cannot_keep_the_source_window_says_so(trained_run, tmp_path, capsys):
    """A source trained on windows that are no whole number of blocks: the block model is scored and trained on the
    default window, which nothing said (eval of the two then compared different windows)."""
    import shutil

    run = shutil.copytree(trained_run, tmp_path / "run")
    for state_file in (run / "checkpoints").glob("*/train_state.json"):
        state = json.loads(state_file.read_text())
        state["train_config"]["seq_len"] = 30
        state_file.write_text(json.dumps(state))
    assert main(["convert", "--to", "block", "--checkpoint", str(run), "--out", str(tmp_path / "block")]) == 0
    assert ("(the source's training window of 30 tokens is not a whole number of its 4-token units, so eval and "
            "training take the default window: give --seq-len with a multiple of 4)") in capsys.readouterr().out
    assert main(["convert", "--to", "block", "--checkpoint", str(trained_run), "--out", str(tmp_path / "kept")]) == 0
    assert "window" not in capsys.readouterr().out  # 32 tokens: kept, nothing to say


def test_set_overrides_model_fields_and_rejects_unknown_ones(tmp_path, capsys):
    argv = [*TINY_TRAIN, "--steps", "1", "--ckpt-interval", "1"]
    argv[argv.index("--preset") + 1] = "tiny-block"
    out = tmp_path / "cls"
    assert main([*argv, "--out", str(out), "--set", "embedder=cls", "--set", "token_decoder=cross", "--set", "n_cls=2"]) == 0
    config = json.loads((out / "checkpoints" / "step_0000001" / "config.json").read_text())
    assert (config["embedder"], config["token_decoder"], config["n_cls"]) == ("cls", "cross", 2)
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "x"), "--set", "embeder=cls"], "no config field embeder")
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "y"), "--set", "embedder=conv"], "embedder='conv'")
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "z"), "--set", "oops"], "FIELD=VALUE")
    argv[argv.index("--seq-len") + 1] = "30"
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "w")], "not a multiple of the model's block length 4")
    # One block scores nothing (block 0 is never predicted): refused before the run's line, as eval refuses it.
    argv[argv.index("--seq-len") + 1] = "4"
    assert main([*argv, "--out", str(tmp_path / "v")]) == EXIT_USER_ERROR
    printed = capsys.readouterr()
    assert "training" not in printed.out and "would score nothing (the first block is never predicted" in printed.err
    one_line_error(capsys, ["eval", "--checkpoint", str(out), "--seq-len", "4", "--device", "cpu", "--no-progress"],
                   "--seq-len 4 would score nothing")


@pytest.mark.parametrize("preset", ["tiny", "tiny-block", "tiny-double", "tiny-encdec", "tiny-staircase", "tiny-transformer-xl"])
def test_flops_reports_every_family(preset, capsys):
    assert main(["flops", "--preset", preset, "--seq-len", "64", "--out-len", "16", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "FLOPs/token" in out and "MiB" in out
    # a family's own caveat is said of that family only (every family's footnote named two, before)
    assert ("counts two attentions' worth" in out) == (preset == "tiny-double")
    assert ("max_len cross K/V" in out) == (preset == "tiny-encdec")


def test_flops_says_when_the_cache_it_prices_is_longer_than_the_model_serves(capsys):
    """The default prices the whole context as the prompt plus 256 more tokens: a slot no engine of the model holds."""
    assert main(["flops", "--preset", "tiny"]) == 0
    assert "T + T_out = 384 tokens is more than tiny's context of 128" in capsys.readouterr().out
    assert main(["flops", "--preset", "tiny", "--seq-len", "64", "--out-len", "64"]) == 0
    assert "more than tiny's context" not in capsys.readouterr().out


def test_flops_rejects_a_window_that_splits_a_block(capsys):
    one_line_error(capsys, ["flops", "--preset", "tiny-block", "--seq-len", "30"], "not a multiple of the model's block length 4")


def test_the_cli_package_names_no_model_family():
    """Choices and rules about families come from the library; the CLI only has them in help sentences."""
    import ast
    from pathlib import Path

    import blockloop.cli

    families = {"decoder", "block", "recursive", "staircase", "ladder", "double_decoder", "encoder_decoder"}
    for path in Path(blockloop.cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in families, f"{path.name}:{node.lineno} names the family {node.value!r}"
            if isinstance(node, ast.Compare):
                assert "family" not in ast.unparse(node), f"{path.name}:{node.lineno} branches on a family"


def test_a_missing_optional_package_names_the_extra_that_installs_it(monkeypatch, capsys):
    from blockloop.cli import presets

    def needs_transformers(args):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(presets, "run", needs_transformers)
    one_line_error(capsys, ["presets"], "pip install 'blockloop[hf]'")


def test_ctrl_c_mentions_a_checkpoint_only_where_one_is_written(monkeypatch, capsys):
    from blockloop.cli import presets

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(presets, "run", interrupted)
    assert main(["presets"]) == 130
    assert capsys.readouterr().err.strip() == "blockloop presets: interrupted"


def test_more_threads_than_cpus_are_warned_about(capsys):
    import os

    import torch

    from blockloop.cli.common import set_threads

    before = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    try:
        set_threads(cpus)
        assert capsys.readouterr().err == ""
        set_threads(cpus + 1)
        assert f"warning: --threads {cpus + 1} is more than the {cpus} CPUs" in capsys.readouterr().err
        assert torch.get_num_threads() == cpus + 1  # warned, not refused
    finally:
        torch.set_num_threads(before)


def test_a_stopped_generation_ends_its_text_with_a_newline(trained_run, capsys, monkeypatch):
    """Ctrl-C mid-answer printed "...the text so far^Cblockloop generate: interrupted" on one line."""
    from blockloop.serve import generate as generation

    def stopped(model, prompts, max_new, *, on_token, **kwargs):
        on_token(0, prompts[0][0])
        raise KeyboardInterrupt

    monkeypatch.setattr(generation, "generate", stopped)
    assert main(["generate", "--checkpoint", str(trained_run), "--prompt", "to be", "--device", "cpu"]) == 130
    out = capsys.readouterr().out
    assert out.startswith("to be") and out.endswith("\n") and out.count("\n") == 1


def test_a_stop_signal_ends_every_verb_with_a_line_not_silently(monkeypatch, capsys):
    """SIGTERM to a verb other than train or serve (generate, eval, convert...) ended the process on the spot with
    no word; it now takes Ctrl-C's way out."""
    import os
    import signal
    import time

    from blockloop.cli import presets

    def stopped(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal arrives first
        raise AssertionError("SIGTERM did not stop the verb")

    monkeypatch.setattr(presets, "run", stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["presets"]) == 130
    assert capsys.readouterr().err.strip() == "blockloop presets: interrupted"
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_ctrl_c_in_training_says_whether_a_checkpoint_is_there_to_resume_from(monkeypatch, capsys, tmp_path):
    from blockloop.cli import train

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    argv = ["train", "--preset", "tiny", "--out", str(tmp_path / "run")]
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == "blockloop train: interrupted; no checkpoint was written yet"
    (tmp_path / "run" / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_0000002" / "train_state.json").write_text("{}")
    assert main(argv) == 130
    run = tmp_path / "run"
    assert capsys.readouterr().err.strip() == f"blockloop train: interrupted; the last checkpoint in {run} is kept: --resume goes on from it"


def test_a_conversion_whose_calibration_text_is_gone_says_how_to_go_on(trained_run, tmp_path, capsys):
    """The SVD calibrates on the source run's training text; when that file has moved since, the error said "pass a
    builtin name, a .txt/.jsonl file...", advice no convert flag can take."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for state_file in (run / "checkpoints").glob("*/train_state.json"):
        state = json.loads(state_file.read_text())
        state["run"]["data"] = str(tmp_path / "moved.txt")
        state_file.write_text(json.dumps(state))
    one_line_error(capsys, ["convert", "--to", "recursive", "--checkpoint", str(run), "--lora-rank", "4", "--out",
                            str(tmp_path / "rec")],
                   f"the source run's training data cannot be read to calibrate the SVD on (unknown corpus "
                   f"'{tmp_path / 'moved.txt'}'")
    capsys.readouterr()
    assert main(["convert", "--to", "recursive", "--checkpoint", str(run), "--lora-rank", "4", "--out",
                 str(tmp_path / "rec")]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip().endswith("); put it back where the run read it, or pass --calibration 0 "
                                                    "(the SVD of the weights alone)")
    assert main(["convert", "--to", "recursive", "--checkpoint", str(run), "--lora-rank", "4", "--calibration", "0",
                 "--out", str(tmp_path / "rec")]) == 0  # the way on the error names


def test_verbs_other_than_train_refuse_to_run_under_torchrun(trained_run, capsys, monkeypatch):
    """Under torchrun every rank ran eval (or generate...) whole and printed it again."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_line_error(capsys, ["eval", "--checkpoint", str(trained_run)],
                   "blockloop eval: error: only train runs across torchrun's processes; run blockloop eval as one "
                   "process, without torchrun")


def test_a_stop_signal_in_training_says_which_checkpoint_is_kept(tmp_path):
    """SIGTERM (a scheduler's stop) takes Ctrl-C's way out: the step in progress is written as a checkpoint and
    named, exit 130; it ended the process on the spot, silently, and later lost every step since the last checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    # checkpoints only every 1000 steps: the one the stop writes is the only one
    proc = subprocess.Popen([sys.executable, "-m", "blockloop.cli", *TINY_TRAIN, "--steps", "100000", "--ckpt-interval",
                             "1000", "--out", str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == f"blockloop train: interrupted; the last checkpoint in {run} is kept: --resume goes on from it"
    assert "stopping after this step, with a checkpoint" in err
    # the step it was in is the checkpoint: nothing trained is lost
    last_logged = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines())
    kept = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert last_logged <= kept < 1000


def test_an_unrelated_missing_module_is_still_a_bug_with_its_traceback(monkeypatch):
    from blockloop.cli import presets

    def broken(args):
        raise ModuleNotFoundError("No module named 'blockloop.nowhere'", name="blockloop.nowhere")

    monkeypatch.setattr(presets, "run", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["presets"])


def test_a_closed_pipe_ends_the_command_quietly():
    """`blockloop presets | head -1`: the reader leaves early; no BrokenPipeError traceback on stderr."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "blockloop.cli", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away while the table is still being written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1)  # 0 only if the whole table fit the pipe before the reader left
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_no_progress_turns_every_bar_off_and_every_long_verb_takes_it(trained_run, monkeypatch, capsys):
    from blockloop import progress
    from blockloop.cli import build_parser

    long_running = ["train", "eval", "demo", "bench", "convert"]
    parser = build_parser(set(long_running))
    for verb in long_running:
        assert "--no-progress" in parser._subparsers._group_actions[0].choices[verb].format_help(), verb
    monkeypatch.setattr(progress, "_enabled", True)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    assert progress.shown()  # a terminal, no flag: bars are drawn
    assert main(["eval", "--checkpoint", str(trained_run), "--device", "cpu", "--max-batches", "1", "--no-progress"]) == 0
    assert not progress.shown()


def test_piped_training_logs_are_plain_lines_and_say_when_validation_starts(tmp_path, capsys):
    argv = [a for a in TINY_TRAIN if a != "--no-progress"]  # no flag: the pipe alone must keep bars away
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    assert "step 4: validating on up to 1 batches" in captured.out
    assert "val_loss" in captured.out


def test_long_work_without_a_bar_still_logs_plain_lines(monkeypatch, capsys):
    """A benchmark evaluation runs for many minutes: piped to a log (or under --no-progress) it must still say,
    in plain lines, which task runs and how far it got, and nothing for bars that did not ask for it."""
    from blockloop import progress

    for enabled in (True, False):  # a pipe, then a pipe with --no-progress
        monkeypatch.setattr(progress, "_enabled", enabled)
        with progress.bar(total=3, desc="piqa", unit="q", leave=False, log_every=0) as logged:
            logged.update(2)
            logged.update(1)
        with progress.bar(total=3, desc="quiet", unit="q") as quiet:
            quiet.update(3)
        err = capsys.readouterr().err
        assert "\r" not in err and "quiet" not in err
        lines = err.splitlines()
        # no 0/3 line before any work is done, and the end once (the last update and the close both wrote it)
        assert [line.split(" q")[0] for line in lines] == ["piqa: 2/3", "piqa: 3/3"], lines


def test_python_dash_m_blockloop_is_the_console_script():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "blockloop", "presets", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "usage: blockloop presets" in done.stdout, done.stderr


def test_the_commands_printed_to_paste_next_quote_paths_with_spaces(tmp_path, capsys):
    """`train` ends with the command that writes its weights alone, `convert` with the one that uses the result:
    a path with spaces used to be printed bare, and the pasted command failed."""
    import shlex

    run = tmp_path / "out with space" / "run 1"
    assert main(["train", "--preset", "tiny", "--steps", "1", "--warmup-steps", "1", "--batch-size", "2", "--seq-len",
                 "32", "--device", "cpu", "--no-progress", "--out", str(run)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "blockloop convert --to weights" in x)
    argv = shlex.split(line.split("blockloop ", 1)[1])
    assert argv[argv.index("--checkpoint") + 1] == str(run)
    assert main(argv) == 0  # the pasted command runs
    line = next(x for x in capsys.readouterr().out.splitlines() if "blockloop generate" in x)
    argv = shlex.split(line.split("blockloop ", 1)[1].replace("TEXT", "hi"))
    assert argv[argv.index("--checkpoint") + 1] == f"{run}-weights"
    assert main([*argv, "--max-new-tokens", "2", "--device", "cpu"]) == 0


def test_a_stream_that_is_not_utf8_gets_escapes_not_a_traceback(trained_run):
    """``PYTHONIOENCODING=ascii``: a prompt (or an answer) the stream cannot encode used to end generate with a
    UnicodeEncodeError traceback, and chat with a UnicodeDecodeError on a UTF-8 line read through it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    run = [sys.executable, "-m", "blockloop.cli"]
    generated = subprocess.run([*run, "generate", "--checkpoint", str(trained_run), "--prompt", "Emoji: \U0001f642 é",
                                "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu"],
                               env=env, capture_output=True, timeout=300)
    assert generated.returncode == 0 and b"Traceback" not in generated.stderr, generated.stderr.decode()
    assert generated.stdout.startswith(b"Emoji: \\U0001f642 \\xe9")
    chatted = subprocess.run([*run, "chat", "--checkpoint", str(trained_run), "--max-new-tokens", "3", "--device", "cpu"],
                             env=env, input="héllo\n".encode(), capture_output=True, timeout=300)
    assert chatted.returncode == 0 and b"Traceback" not in chatted.stderr, chatted.stderr.decode()
    assert b"not valid UTF-8" not in chatted.stdout  # the line was UTF-8: read as such, and answered


def test_a_config_whose_vocabulary_is_smaller_than_its_tokenizer_is_named_as_the_checkpoint_loads(trained_run, tmp_path,
                                                                                                   capsys):
    """It used to load, and every prompt was then refused as holding ids the tokenizer had made: the prompt blamed."""
    import shutil

    from blockloop.train.checkpoint import resolve_checkpoint

    run = tmp_path / "edited"
    shutil.copytree(trained_run, run)
    config_path = resolve_checkpoint(run) / "config.json"
    config = json.loads(config_path.read_text())
    config["vocab_size"] = 100
    config_path.write_text(json.dumps(config))
    one_line_error(capsys, ["generate", "--checkpoint", str(run), "--prompt", "a", "--device", "cpu"],
                   "the tokenizer has 258 ids but config.json's vocab_size is 100; the config was edited or belongs")


def test_a_calibration_count_past_the_data_says_it_took_every_window(trained_run, capsys):
    """``--calibration 100000`` quietly calibrated on the few thousand windows there were."""
    from blockloop.convert.checkpoints import calibration_windows
    from blockloop.train.run import load_trained

    source = load_trained(trained_run)
    few = calibration_windows(source, 3)
    assert few.shape == (3, 128) and "warning" not in capsys.readouterr().err
    every = calibration_windows(source, 10**7)
    assert every.shape[1] == 128 and 3 < every.shape[0] < 10**7
    assert capsys.readouterr().err.strip() == (f"warning: --calibration 10000000 is more than the {every.shape[0]} "
                                               f"windows of 128 tokens the source's training data holds; calibrating "
                                               f"on all {every.shape[0]}")
