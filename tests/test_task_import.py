"""Own state-tracking data: `blockloop tasks import` to a task directory, then train and eval on it as on a built-in task."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.data.tasks import IGNORE_INDEX, TaskSequences, import_task, load_task
from blockloop.errors import BlockloopError
from blockloop.train import checkpoint as ckpt

TRAIN = ["--preset", "tiny", "--seq-len", "16", "--steps", "3", "--batch-size", "4", "--eval-interval", "3",
         "--eval-batches", "2", "--log-interval", "3", "--warmup-steps", "1", "--device", "cpu", "--no-progress"]


def parity_sequences(count: int, seed: int = 0) -> list[dict[str, list]]:
    """Distinct sequences asking for the running parity of the b's at every other position (null elsewhere) and
    at the last."""
    rng = random.Random(seed)
    sequences, seen = [], set()
    while len(sequences) < count:
        tokens = [rng.choice("ab") for _ in range(rng.randint(3, 9))]
        if "".join(tokens) in seen:
            continue
        seen.add("".join(tokens))
        labels, parity = [], 0
        for i, token in enumerate(tokens):
            parity ^= token == "b"
            labels.append(f"p{parity}" if i % 2 or i == len(tokens) - 1 else None)
        sequences.append({"tokens": tokens, "labels": labels})
    return sequences


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def stream_sequences(stream, vocab) -> list[tuple[list[str], list[str | None]]]:
    """The (tokens, labels) of a written split, read back through the vocabulary and split at END."""
    words = vocab.words
    out, tokens, labels = [], [], []
    for i, label in zip(np.asarray(stream.inputs), np.asarray(stream.labels)):
        if words[i] == "END":
            assert label == IGNORE_INDEX
            out.append((tokens, labels))
            tokens, labels = [], []
        else:
            tokens.append(words[i])
            labels.append(None if label == IGNORE_INDEX else words[label])
    assert not tokens
    return out


def test_import_round_trips_every_sequence_into_a_seeded_split(tmp_path):
    records = parity_sequences(50)
    data = write_jsonl(tmp_path / "parity.jsonl", records)
    out = import_task(data, tmp_path / "parity", seed=3, valid_fraction=0.2, test_fraction=0.1)
    task = load_task(out)
    assert task.name == "parity" and task.vocab.words == ("_", "END", "a", "b", "p0", "p1")
    assert task.meta["sizes"] == {"train": 35, "valid": 10, "test": 5}
    read = {split: stream_sequences(task.splits[split], task.vocab) for split in ("train", "valid", "test")}
    as_pairs = [(r["tokens"], r["labels"]) for r in records]
    # Every sequence lands in exactly one split, whole, and each split keeps the file's order.
    everything = read["train"] + read["valid"] + read["test"]
    assert sorted(map(str, everything)) == sorted(map(str, as_pairs))
    for split in read.values():
        positions = [as_pairs.index(pair) for pair in split]
        assert positions == sorted(positions)
    # Same seed, same split; another seed, another one.
    again = load_task(import_task(data, tmp_path / "again", name="parity", seed=3, valid_fraction=0.2, test_fraction=0.1))
    other = load_task(import_task(data, tmp_path / "other", name="parity", seed=4, valid_fraction=0.2, test_fraction=0.1))
    for split in ("train", "valid", "test"):
        assert np.array_equal(again.splits[split].inputs, task.splits[split].inputs)
        assert np.array_equal(again.splits[split].labels, task.splits[split].labels)
    assert not np.array_equal(other.splits["test"].inputs, task.splits["test"].inputs)


def test_given_split_files_and_a_reused_vocabulary(tmp_path):
    files = {split: write_jsonl(tmp_path / f"{split}.jsonl", parity_sequences(n, seed))
             for split, n, seed in (("train", 20, 0), ("valid", 4, 1), ("test", 3, 2))}
    task = load_task(import_task(files["train"], tmp_path / "given", valid=files["valid"], test=files["test"]))
    assert task.meta["sizes"] == {"train": 20, "valid": 4, "test": 3}
    assert [len(s) for s in map(lambda s: stream_sequences(task.splits[s], task.vocab), ("valid", "test"))] == [4, 3]
    # Integers are words too; --vocab-from keeps the earlier ids and refuses a word outside them, naming its line.
    extra = write_jsonl(tmp_path / "extra.jsonl", [{"tokens": ["b", "a"], "labels": [None, "p1"]},
                                                   {"tokens": ["a", 7], "labels": [None, "p0"]}])
    with pytest.raises(BlockloopError, match=r"extra.jsonl:2: '7' is not in the vocabulary given with --vocab-from"):
        import_task(files["train"], tmp_path / "x", valid=extra, test=extra, vocab_from=tmp_path / "given")
    same = write_jsonl(tmp_path / "same.jsonl", [{"tokens": ["b", "b"], "labels": [None, "p0"]}])
    reused = load_task(import_task(files["train"], tmp_path / "reused", valid=same, test=same, vocab_from=tmp_path / "given"))
    assert reused.vocab.words == task.vocab.words


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([], r"holds no sequences \(it is empty\)"),
        (["", "  "], r"holds no sequences \(it is empty\)"),
        ([{"tokens": ["a"], "labels": ["p0"]}, "{not json"], r"data.jsonl:2: not valid JSON"),
        ([{"tokens": ["a", "b"], "labels": ["p0"]}], r"data.jsonl:1: 2 tokens but 1 labels"),
        ([{"tokens": ["a"]}], r'data.jsonl:1: expected an object \{"tokens"'),
        ([{"tokens": [], "labels": []}], "data.jsonl:1: the sequence has no tokens"),
        ([{"tokens": ["a b"], "labels": [None]}], "holds whitespace"),
        ([{"tokens": ["END"], "labels": [None]}], "'END' is reserved"),
        ([{"tokens": ["\ud800"], "labels": [None]}], "is not valid UTF-8 text"),  # JSON's escape of a lone surrogate
        ([{"tokens": [1.5], "labels": [None]}], "1.5 is not a string or a whole number"),
        ([{"tokens": ["a"], "labels": ["p0"]}] * 2,
         r"holds 2 sequences: valid takes 1 \(--valid-fraction 0.1\) and test 1 \(--test-fraction 0.1\), leaving none"),
    ],
)
def test_import_errors_name_the_problem(tmp_path, lines, match):
    data = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(BlockloopError, match=match):
        import_task(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_names_a_line_that_is_not_utf8(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"tokens": ["a"], "labels": ["p0"]}\n{"tokens": ["caf\xe9"], "labels": [null]}\n')
    with pytest.raises(BlockloopError, match=r"data.jsonl:2: not UTF-8 text \(byte 16 of the line\)"):
        import_task(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_skips_a_byte_order_mark(tmp_path):
    """Some editors start a UTF-8 file with a byte-order mark, which JSON does not allow."""
    plain = tmp_path / "plain.jsonl"
    write_jsonl(plain, parity_sequences(20))
    data = tmp_path / "data.jsonl"
    data.write_bytes("\ufeff".encode() + plain.read_bytes())
    marked, plain = (load_task(import_task(path, tmp_path / path.stem)) for path in (data, plain))
    assert marked.vocab.words == plain.vocab.words
    assert all(np.array_equal(marked.splits[s].inputs, plain.splits[s].inputs) for s in ("train", "valid", "test"))


def test_import_refuses_bad_choices(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", parity_sequences(20))
    unlabelled = write_jsonl(tmp_path / "none.jsonl", [{"tokens": ["a"], "labels": [None]}])
    cases = [
        (dict(name="random-walk"), "'random-walk' is the built-in task random-walk's; choose another with --name"),
        (dict(name="a b:c/d"), "'a b:c/d' holds whitespace; choose another"),
        (dict(valid=data), "give both --valid and --test"),
        (dict(valid_fraction=1.5), "--valid-fraction must be between 0 and 1"),
        (dict(valid_fraction=0.6, test_fraction=0.6), "leave nothing to train on; keep their sum below 1"),
        # Sums below 1 that still round every sequence into valid and test blame the fractions, not the file.
        (dict(valid_fraction=0.5, test_fraction=0.49), r"valid takes 10 \(--valid-fraction 0.5\) and test 10"),
        (dict(valid=data, test=data, seed=3), "--seed draws the splits from DATA, but --valid and --test give them"),
        (dict(valid=data, test=data, valid_fraction=0.2, test_fraction=0.2),
         "--valid-fraction and --test-fraction draw the splits"),
        (dict(valid=data, test=unlabelled), r"the test split \(.*none.jsonl\) has no labelled positions"),
    ]
    for kwargs, match in cases:
        with pytest.raises(BlockloopError, match=match):
            import_task(data, tmp_path / "out", **kwargs)
    for source, what in ((tmp_path, "is a directory"), (tmp_path / "missing.jsonl", "does not exist")):
        with pytest.raises(BlockloopError, match=f"{re.escape(str(source))} {what}; give a .jsonl file"):
            import_task(source, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(BlockloopError, match="already exists and is not empty"):
        import_task(data, tmp_path / "full")


def test_a_sequence_longer_than_the_window_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", parity_sequences(20))
    task = load_task(import_task(data, tmp_path / "parity"))
    longest = task.meta["details"]["longest_sequence"]
    assert longest == max(len(r["tokens"]) for r in parity_sequences(20)) + 1
    TaskSequences(task.splits["train"], longest, end_id=task.vocab.id("END"))
    with pytest.raises(BlockloopError, match=f"a sequence of {longest} tokens, longer than --seq-len {longest - 1}"):
        TaskSequences(task.splits["train"], longest - 1, end_id=task.vocab.id("END"))


def test_cli_import_train_and_eval_without_repeating_the_directory(tmp_path, capsys):
    data = write_jsonl(tmp_path / "parity.jsonl", parity_sequences(60))
    task_dir, run = tmp_path / "mine", tmp_path / "run"
    assert main(["tasks", "import", data, "--out", str(task_dir), "--name", "parity", "--seed", "1"]) == 0
    assert "imported task parity (6 words)" in capsys.readouterr().out
    assert main(["train", "--task-dir", str(task_dir), "--out", str(run), *TRAIN]) == 0
    assert "on task:parity with the task:parity tokenizer" in capsys.readouterr().out
    # The checkpoint records the directory: eval finds it; the same split scored through --task-dir agrees.
    assert main(["eval", "--checkpoint", str(run), "--split", "test", "--json", "--device", "cpu"]) == 0
    stored = json.loads(capsys.readouterr().out)
    assert main(["eval", "--checkpoint", str(run), "--task-dir", str(task_dir), "--split", "test", "--json",
                 "--device", "cpu"]) == 0
    named = json.loads(capsys.readouterr().out)
    labels = np.asarray(load_task(task_dir).splits["test"].labels)
    assert stored == named and stored["task"] == "parity" and stored["tokens"] == (labels != IGNORE_INDEX).sum()
    # New evaluation data: with the training vocabulary it scores; built alone (other ids, new words) it is refused.
    fresh = write_jsonl(tmp_path / "fresh.jsonl", parity_sequences(30, seed=9))
    assert main(["tasks", "import", fresh, "--out", str(tmp_path / "fresh"), "--name", "parity",
                 "--vocab-from", str(task_dir)]) == 0
    assert main(["eval", "--checkpoint", str(run), "--task-dir", str(tmp_path / "fresh"), "--device", "cpu"]) == 0
    capsys.readouterr()
    other = write_jsonl(tmp_path / "other.jsonl", [{"tokens": ["a", "c"], "labels": [None, "p2"]}] * 30)
    assert main(["tasks", "import", other, "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    cases = [
        (["eval", "--checkpoint", str(run), "--task-dir", str(tmp_path / "other"), "--device", "cpu"],
         "the model does not know the words c p2"),
        (["tasks", "import", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "m")], "missing.jsonl does not exist"),
        (["train", "--task", "parity", "--out", str(tmp_path / "r2"), *TRAIN], "unknown task 'parity'"),
        (["train", "--task", "random-walk", "--task-dir", str(task_dir), "--out", str(tmp_path / "r2"), *TRAIN],
         "holds task parity, not random-walk"),
        (["eval", "--checkpoint", str(run), "--split", "all", "--device", "cpu"], "a task is scored one split at a time"),
    ]
    for argv, match in cases:
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == EXIT_USER_ERROR and len(err.splitlines()) == 1 and match in err, (argv, err)
    # A moved task directory: the stored path is gone, and eval says how to point at it.
    task_dir.rename(tmp_path / "moved")
    assert main(["eval", "--checkpoint", str(run), "--device", "cpu"]) == EXIT_USER_ERROR
    assert "which is gone; pass --task-dir" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--task-dir", str(tmp_path / "moved"), "--device", "cpu"]) == 0
    # --resume too: the gone folder is named with its fix, and --task-dir gives the new place of the same task.
    resume = ["train", "--resume", "--out", str(run), "--steps", "4", "--no-progress"]
    assert main(resume) == EXIT_USER_ERROR
    assert "task folder " + str(task_dir) + " is gone; if it moved, name it with --task-dir" in capsys.readouterr().err
    assert main([*resume, "--task-dir", str(tmp_path / "fresh")]) == EXIT_USER_ERROR  # same words, other sequences
    assert "is not the data" in capsys.readouterr().err
    assert main([*resume, "--task-dir", str(tmp_path / "moved")]) == 0
    assert ckpt.read_metrics(run / "metrics.jsonl")[-1]["step"] == 4


def test_an_unknown_word_names_a_few_of_a_large_vocabulary_not_all():
    """An imported task of 5,000 words printed all of them in the one error line (29 KB)."""
    from blockloop.data.tasks.base import TaskVocab
    from blockloop.data.tasks.tokenizer import SHOWN_WORDS, TaskTokenizer

    many = TaskTokenizer("big", TaskVocab(["END", *(f"w{i}" for i in range(4999))]))
    with pytest.raises(BlockloopError) as refused:
        many.encode("w1 hello")
    message = str(refused.value)
    assert message.startswith("'hello' is not a word of task big; its words: _ END w0 ") and message.endswith(
        "... (5001 in all)") and len(message.split()) < SHOWN_WORDS + 20
    few = TaskTokenizer("small", TaskVocab(["END", "L", "R"]))
    with pytest.raises(BlockloopError, match="'x' is not a word of task small; its words: _ END L R$"):
        few.encode("x")

