"""Training and evaluating on labelled-position tasks: aligned windows, the task error, the CLI path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.data.loader import TrainBatches, eval_batches
from blockloop.data.tasks import (
    IGNORE_INDEX,
    TaskSequences,
    TaskTokenizer,
    generate_splits,
    get_task,
    load_task,
    write_task,
)
from blockloop.errors import BlockloopError
from blockloop.families import build_model, from_name
from blockloop.train.evaluate import evaluate
from blockloop.train.run import load_trained, padded_vocab
from blockloop.train.trainer import TrainConfig, Trainer

WALK = "random-walk:8"  # 8 actions + END = 9 tokens per walk


def windows_of(task_name, split="train", sizes=(40, 10, 10), seq_len=27):
    task = get_task(task_name)
    stream = generate_splits(task, seed=3, sizes=sizes)[split]
    return task, stream, TaskSequences(stream, seq_len, end_id=task.vocab.id("END"))


def walk_cells(actions: list[str]) -> list[str]:
    """The agent's cell after each action, re-simulated from the task's description (8x8, start r4c4 north)."""
    steps = [(-1, 0), (0, 1), (1, 0), (0, -1)]
    row, col, heading, cells = 4, 4, 0, []
    for action in actions:
        heading = (heading + (action == "R") - (action == "L")) % 4
        if action == "F" and 0 <= row + steps[heading][0] < 8 and 0 <= col + steps[heading][1] < 8:
            row, col = row + steps[heading][0], col + steps[heading][1]
        cells.append(f"r{row}c{col}")
    return cells


# -------------------------------------------------------------------- windows
def test_walk_windows_pair_each_input_with_the_answer_for_its_prefix():
    task, _, seqs = windows_of(WALK, sizes=(39, 10, 10), seq_len=27)
    assert len(seqs) == 39 * 9 // 27 and (seqs.first_scored == 0).all()  # windows of 3 walks tile the stream
    inputs, labels = TrainBatches(seqs, 4, seed=0).next_batch()
    assert inputs.shape == labels.shape == (4, 27) and inputs.dtype == labels.dtype == torch.int64
    for row_inputs, row_labels in zip(inputs.tolist(), labels.tolist()):
        words = task.vocab.decode(row_inputs).split()
        for start in range(0, 27, 9):  # each window holds three whole walks
            walk = words[start : start + 9]
            assert walk[-1] == "END" and row_labels[start + 8] == IGNORE_INDEX
            # The label at t is the cell after actions 0..t of the walk (no shift to the next input).
            assert [task.vocab.words[i] for i in row_labels[start : start + 8]] == walk_cells(walk[:8])


def test_algorithm_windows_score_every_label_once_with_its_whole_program():
    task, stream, seqs = windows_of("algorithm-3:6", sizes=(30, 5, 5), seq_len=64)
    labels = np.asarray(stream.labels)
    end = task.vocab.id("END")
    program_starts = set(np.flatnonzero(np.asarray(stream.inputs) == end) + 1) | {0}
    scored_at = np.zeros(len(labels), dtype=int)
    for i in range(len(seqs)):
        window = seqs[i]
        start = int(seqs.starts[i])
        assert np.array_equal(window[0], stream.inputs[start : start + 64])
        assert start in program_starts or start == len(labels) - 64  # only the last window may start elsewhere
        scored = np.flatnonzero(window[1] != IGNORE_INDEX)
        # Unlabelled positions stay -100; a scored label is the stream's label at that position.
        assert np.array_equal(window[1][scored], labels[start + scored])
        for t in scored:
            # Its program starts inside the window, so the window holds all it needs to answer.
            assert max(s for s in program_starts if s <= start + t) >= start
        scored_at[start + scored] += 1
    assert np.array_equal(scored_at, (labels != IGNORE_INDEX).astype(int))  # each label exactly once


def test_eval_batches_read_task_windows_in_order():
    _, _, seqs = windows_of(WALK, seq_len=18)
    batches = list(eval_batches(seqs, batch_size=7))
    assert sum(len(inputs) for inputs, _ in batches) == len(seqs)
    assert np.array_equal(batches[1][1][0].numpy(), seqs[7][1])


# --------------------------------------------------------------------- metric
class ConstantGuess(nn.Module):
    """Always predicts one id, whatever the input: its task error is the share of labels that differ."""

    def __init__(self, vocab_size: int, guess: int) -> None:
        super().__init__()
        self.vocab_size, self.guess = vocab_size, guess

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, self.vocab_size)
        logits[..., self.guess] = 1.0
        return logits, None


def test_evaluate_reports_the_argmax_error_on_labelled_positions_only():
    task = get_task("algorithm-3:10")
    stream = generate_splits(task, seed=1, sizes=(40, 20, 1))["valid"]
    seqs = TaskSequences(stream, 96, end_id=task.vocab.id("END"))
    guess = task.vocab.id("3")
    labels = np.asarray(stream.labels)
    asked = labels[labels != IGNORE_INDEX]
    metrics = evaluate(ConstantGuess(task.vocab.vocab_size, guess), seqs, batch_size=4)
    assert metrics["tokens"] == len(asked)
    assert metrics["error"] == pytest.approx(np.mean(asked != guess))
    assert 0.5 < metrics["error"] < 1.0  # most positions are unlabelled; counting them would change this


def test_text_evaluation_has_no_task_error():
    from blockloop.data.loader import PackedSequences

    seqs = PackedSequences(np.arange(200) % 50, 16)
    assert "error" not in evaluate(ConstantGuess(64, 3), seqs, batch_size=4)


# ------------------------------------------------------------------- training
def test_tiny_model_learns_the_short_random_walk(tmp_path):
    task = get_task(WALK)
    splits = generate_splits(task, seed=0, sizes=(600, 40, 1))
    end = task.vocab.id("END")
    train, val = (TaskSequences(splits[s], 36, end_id=end) for s in ("train", "valid"))
    config = from_name("tiny").replace(vocab_size=task.vocab.vocab_size, padded_vocab_size=padded_vocab(task.vocab.vocab_size))
    torch.manual_seed(0)
    model = build_model(config)
    before = evaluate(model, val, batch_size=16)["error"]
    cfg = TrainConfig(
        steps=120, batch_size=16, seq_len=36, lr=3e-3, warmup_steps=10, eval_interval=120, eval_batches=10,
        log_interval=60, ckpt_interval=1000, device="cpu", progress=False,
    )
    tokenizer = TaskTokenizer(task.name, task.vocab)
    metrics = Trainer(model, config, tokenizer, train, val, cfg, tmp_path / "run").fit()
    assert before > 0.9  # 64 cells: an untrained model is nearly always wrong
    assert metrics["val_error"] < 0.65, metrics  # seeds 0-2 reach 0.43-0.49
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_error" in entry for entry in logged)


# ------------------------------------------------------------------------ CLI
TRAIN = ["--preset", "tiny", "--seq-len", "18", "--steps", "4", "--batch-size", "4", "--eval-interval", "4",
         "--eval-batches", "2", "--log-interval", "2", "--warmup-steps", "1", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def walk_dir(tmp_path_factory):
    return write_task(WALK, tmp_path_factory.mktemp("tasks") / "walk", seed=0, sizes=(40, 8, 8))


def test_cli_trains_and_evaluates_a_task_end_to_end(tmp_path, walk_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--task-dir", str(walk_dir), "--out", str(run), *TRAIN]) == 0
    out = capsys.readouterr().out
    assert f"on task:{WALK} with the task:{WALK} tokenizer" in out and "val task error" in out
    tokenizer = load_trained(run).tokenizer
    assert isinstance(tokenizer, TaskTokenizer) and tokenizer.vocab.words == get_task(WALK).vocab.words
    # eval finds the task from the checkpoint and scores the test split's labelled positions.
    assert main(["eval", "--checkpoint", str(run), "--split", "test", "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    test_labels = np.asarray(load_task(walk_dir).splits["test"].labels)
    assert result["task"] == WALK and result["split"] == "test"
    assert result["tokens"] == (test_labels != IGNORE_INDEX).sum() and 0.0 <= result["error"] <= 1.0
    # generate answers a sequence of the task's words with the model's label after the last one, and only that: a
    # label fed back is no word the model reads (it went on with labels as if they were inputs)
    trained = load_trained(run)
    prompt = trained.tokenizer.encode("L R F")
    with torch.no_grad():
        label = int(trained.model(torch.tensor([prompt]))[0][0, -1].argmax())
    assert main(["generate", "--checkpoint", str(run), "--prompt", "L R F", "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split() == ["L", "R", "F", trained.tokenizer.vocab.words[label]]
    # ... and resumes with the same task.
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--no-progress", "--device", "cpu"]) == 0
    assert "step 6" in capsys.readouterr().out


def test_cli_task_errors_are_one_line(tmp_path, walk_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--task-dir", str(walk_dir), "--out", str(run), *TRAIN]) == 0
    capsys.readouterr()
    short = write_task(WALK, tmp_path / "short", seed=0, sizes=(40, 1, 1))
    cases = [
        (["train", "--task", "maze", "--out", str(tmp_path / "a"), *TRAIN], "unknown task 'maze'; choose one of"),
        (["train", "--task", "random-walk:x", "--out", str(tmp_path / "a"), *TRAIN], "positive whole number"),
        (["train", "--task", WALK, "--data", "shakespeare", "--out", str(tmp_path / "a"), *TRAIN], "drop --data"),
        (["train", "--task", "algorithm-3", "--task-dir", str(walk_dir), "--out", str(tmp_path / "a"), *TRAIN],
         f"holds task {WALK}, not algorithm-3"),
        (["train", "--task-dir", str(walk_dir), "--out", str(tmp_path / "a"), *TRAIN[:2], "--seq-len", "8", *TRAIN[4:]],
         "sequence of 9 tokens, longer than --seq-len 8"),
        # the length it names is one the model takes: a whole number of staircase chunks (4), not 9 and then a refusal
        (["train", "--task-dir", str(walk_dir), "--out", str(tmp_path / "a"), "--preset", "tiny-staircase",
          "--seq-len", "8", *TRAIN[4:]], "raise --seq-len to at least 12 (past the model's context, a new run also "
                                         "needs --set context_length=12"),
        (["train", "--task-dir", str(short), "--out", str(tmp_path / "b"), *TRAIN],
         "valid split of task random-walk:8 holds 9 tokens, fewer than one window"),
        (["generate", "--checkpoint", str(run), "--prompt", "L R F", "--max-new-tokens", "3", "--device", "cpu"],
         f"this model learned task {WALK}: it answers a sequence of the task's words with one label"),
        (["eval", "--checkpoint", str(run), "--task", "algorithm-3", "--device", "cpu"],
         "is not the vocabulary of task algorithm-3"),
        (["eval", "--checkpoint", str(run), "--task-dir", str(tmp_path / "nowhere"), "--device", "cpu"], "no meta.json"),
        # a task model meets text: named as such, not as the first word of Shakespeare it does not know
        (["eval", "--checkpoint", str(run), "--data", "shakespeare", "--device", "cpu"],
         f"the model learned task {WALK} and reads its words, not text; leave --data out"),
        (["bench", "--stream", "--checkpoint", str(run), "--requests", "2", "--device", "cpu"],
         "reads its words, not text; a request stream is cut from a corpus (shakespeare): bench it without --stream"),
        (["train", "--init-from", str(run), "--data", "shakespeare", "--out", str(tmp_path / "c"), *TRAIN[2:]],
         f"the model learned task {WALK} and reads its words, not text; leave --data out to train it on its task"),
        # conversions whose result could not learn or be scored on the task, or that calibrate on a text corpus
        (["convert", "--to", "block", "--checkpoint", str(run), "--out", str(tmp_path / "d")],
         "the block family builds its targets from the inputs (block targets or span corruption), not from a task's"),
        (["convert", "--to", "recursive", "--checkpoint", str(run), "--out", str(tmp_path / "e"), "--lora-rank", "2"],
         f"the source learned task {WALK}, not a text corpus to calibrate the SVD on; pass --calibration 0"),
    ]
    for argv, match in cases:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == EXIT_USER_ERROR and len(err.splitlines()) == 1 and match in err, (argv, err)


def test_a_task_longer_than_the_model_context_is_refused_before_it_is_generated(tmp_path, monkeypatch, capsys):
    # algorithm-3:10000 would take an hour and gigabytes to write, only to be refused by the window check after it
    # (a length whose sequences pass 65536 tokens is refused by the task itself: tests/test_tasks.py)
    monkeypatch.setenv("BLOCKLOOP_CACHE", str(tmp_path / "cache"))
    for argv in (["train", "--preset", "tiny", "--task", "random-walk:128", "--out", str(tmp_path / "a")],
                 ["train", "--preset", "tiny", "--task", "algorithm-3:10000", "--out", str(tmp_path / "a")]):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == EXIT_USER_ERROR and len(err.splitlines()) == 1, err
        assert "tokens, more than the model context of 128; use shorter sequences" in err, err
    assert not (tmp_path / "cache" / "tasks").exists() and not (tmp_path / "a").exists()


def test_a_text_model_is_refused_on_a_task(tmp_path, capsys):
    from blockloop.data.tokenizers import ByteTokenizer
    from blockloop.train.run import check_task_vocabulary

    task = get_task(WALK)
    with pytest.raises(BlockloopError, match="vocabulary \\(byte, 258 ids\\) is not the vocabulary of task"):
        check_task_vocabulary(ByteTokenizer(), WALK, task.vocab)
    other = TaskTokenizer("algorithm-5", get_task("algorithm-5").vocab)
    with pytest.raises(BlockloopError, match="not the vocabulary"):
        check_task_vocabulary(other, WALK, task.vocab)
    check_task_vocabulary(TaskTokenizer("random-walk", get_task("random-walk").vocab), WALK, task.vocab)  # variants share ids


def test_recurrent_models_train_and_score_on_task_windows(tmp_path, walk_dir, capsys):
    """The staircase family trains and is scored on task windows (each read from an empty state)."""
    run = tmp_path / "stair"
    args = [*TRAIN[2:]]
    args[args.index("--seq-len") + 1] = "20"  # a whole number of the staircase's 4-token chunks
    assert main(["train", "--task-dir", str(walk_dir), "--preset", "tiny-staircase", "--out", str(run), *args]) == 0
    assert "val task error" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(run), "--split", "test", "--json", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == WALK and 0 < result["tokens"] and 0.0 <= result["error"] <= 1.0


@pytest.mark.parametrize("name", ["tiny-staircase", "tiny-transformer-xl"])
def test_recurrent_models_read_each_overlapping_task_window_once_from_an_empty_state(name):
    """Algorithm windows overlap (the next starts at the last program start inside the previous one): a
    recurrent model carrying its state across them would read the overlap twice. Evaluation must equal
    scoring each window on its own, from an empty state."""
    _, _, seqs = windows_of("algorithm-3:6", sizes=(12, 2, 2), seq_len=64)
    assert (np.diff(seqs.starts) < 64).any()  # some windows overlap
    torch.manual_seed(0)
    model = build_model(from_name(name)).double().eval()
    inputs, labels = seqs.to_batch([seqs[i] for i in range(len(seqs))])
    logits = torch.cat([model(inputs[i : i + 1])[0] for i in range(len(seqs))])  # one window at a time, fresh
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    metrics = evaluate(model, seqs, batch_size=2)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-9)
