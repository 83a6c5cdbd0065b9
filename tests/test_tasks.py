"""State-tracking tasks: generated streams re-checked by independent interpreters, files, metric and CLI."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.data.tasks import IGNORE_INDEX, TASKS, generate_splits, load_task, task_error, write_task
from blockloop.errors import BlockloopError

SMALL = (60, 20, 20)


@pytest.fixture(scope="module")
def streams():
    """Each task's splits at a small size, generated once for the module."""
    return {name: generate_splits(task, seed=7, sizes=SMALL) for name, task in TASKS.items()}


def words_and_labels(name, stream):
    vocab = TASKS[name].vocab
    words = vocab.decode(stream.inputs).split()
    labels = [None if i == IGNORE_INDEX else vocab.words[i] for i in stream.labels.tolist()]
    return words, labels


def sequences(words, labels):
    """Split a stream at each END into (words, labels) of one program or walk; END itself is unlabelled."""
    out, start = [], 0
    for i, word in enumerate(words):
        if word == "END":
            assert labels[i] is None
            out.append((words[start:i], labels[start:i]))
            start = i + 1
    assert start == len(words), "the stream must end with END"
    return out


# ------------------------------------------------------------------ algorithm
def run_program(words, labels, names):
    """Re-execute one program from its words, checking every label; returns statement kinds seen.

    Written from the task's description, not from the generator: parse statements at ';', apply them,
    and demand the printed value at each print's ';' and no label anywhere else.
    """
    values: dict[str, int] = {}
    seen = Counter()
    statements, start = [], 0
    for i, word in enumerate(words):
        if word == ";":
            statements.append((words[start : i + 1], labels[start : i + 1]))
            start = i + 1
    assert start == len(words) and len(statements) == 100

    def apply(stmt, holds):
        """Apply a state-changing statement (only if ``holds``); the range rule applies either way."""
        if stmt[1] == "=":
            assert len(stmt) == 4 and stmt[0] in names and stmt[0] not in values, stmt
            if holds:
                values[stmt[0]] = int(stmt[2])
            return "assign"
        assert len(stmt) == 3 and stmt[1] in ("++", "--") and stmt[0] in values, stmt
        new = values[stmt[0]] + (1 if stmt[1] == "++" else -1)
        assert 1 <= new <= 10, f"{stmt} would take {stmt[0]}={values[stmt[0]]} out of range"
        seen["at the edge"] += values[stmt[0]] in (1, 10)
        if holds:
            values[stmt[0]] = new
        return stmt[1]

    for stmt, stmt_labels in statements:
        if stmt[0] == "print":
            assert len(stmt) == 3 and stmt[1] in values, stmt
            assert stmt_labels == [None, None, str(values[stmt[1]])]
            seen["print"] += 1
            continue
        assert all(label is None for label in stmt_labels), stmt
        if stmt[0] == "if":
            var, op, right, colon, *body = stmt[1:]
            assert var in values and op in "<>" and colon == ":", stmt
            right_value = values[right] if right in names else int(right)
            holds = values[var] < right_value if op == "<" else values[var] > right_value
            kind = apply(body, holds)
            seen[f"if {'true' if holds else 'false'} {kind}"] += 1
            seen["if on a variable" if right in names else "if on a constant"] += 1
        else:
            seen[apply(stmt, True)] += 1
    return seen


@pytest.mark.parametrize("name, names", [("algorithm-3", "x y z"), ("algorithm-5", "x y z u v")])
def test_algorithm_labels_match_an_independent_interpreter(streams, name, names):
    seen = Counter()
    for split, stream in streams[name].items():
        programs = sequences(*words_and_labels(name, stream))
        assert len(programs) == SMALL[("train", "valid", "test").index(split)]
        for words, labels in programs:
            seen += run_program(words, labels, names.split())
    # Every kind of statement, both outcomes of an if, and both kinds of comparison really occur.
    for kind in ("assign", "++", "--", "print", "if true ++", "if false --", "if true assign", "if false assign",
                 "if on a variable", "if on a constant"):
        assert seen[kind] > 0, (kind, seen)
    # Values often sit at 1 or 10, so the out-of-range rejection is exercised, never violated.
    assert seen["at the edge"] > 0
    used = set(TASKS[name].vocab.decode(streams[name]["train"].inputs).split())
    assert set(names.split()) <= used


def test_algorithm_labels_only_at_the_semicolon_of_a_print(streams):
    vocab = TASKS["algorithm-3"].vocab
    stream = streams["algorithm-3"]["train"]
    labelled = np.flatnonzero(stream.labels != IGNORE_INDEX)
    assert len(labelled) > 0
    assert (stream.inputs[labelled] == vocab.id(";")).all()
    assert (stream.inputs[labelled - 2] == vocab.id("print")).all()
    assert {vocab.words[i] for i in stream.labels[labelled]} <= {str(k) for k in range(1, 11)}
    prints = np.flatnonzero(stream.inputs == vocab.id("print"))
    assert len(prints) == len(labelled)


# ---------------------------------------------------------------- random walk
def test_random_walk_labels_match_a_resimulation(streams):
    headings = [(-1, 0), (0, 1), (1, 0), (0, -1)]  # north, east, south, west
    blocked = 0
    for stream in streams["random-walk"].values():
        for actions, labels in sequences(*words_and_labels("random-walk", stream)):
            assert len(actions) == 400 and set(actions) <= {"L", "R", "F"}
            row, col, heading = 4, 4, 0
            for action, label in zip(actions, labels):
                if action == "L":
                    heading = (heading - 1) % 4
                elif action == "R":
                    heading = (heading + 1) % 4
                else:
                    r, c = row + headings[heading][0], col + headings[heading][1]
                    if 0 <= r < 8 and 0 <= c < 8:
                        row, col = r, c
                    else:
                        blocked += 1
                assert label == f"r{row}c{col}"
    assert blocked > 0, "no move ever hit a wall"


def test_random_walk_stream_layout(streams):
    vocab = TASKS["random-walk"].vocab
    stream = streams["random-walk"]["valid"]
    assert len(stream.inputs) == len(stream.labels) == SMALL[1] * 401
    ends = np.flatnonzero(stream.inputs == vocab.id("END"))
    assert (ends == np.arange(400, len(stream.inputs), 401)).all()
    assert (stream.labels[ends] == IGNORE_INDEX).sum() == len(ends) == (stream.labels == IGNORE_INDEX).sum()


# -------------------------------------------------------- seeds and splits
@pytest.mark.parametrize("name", list(TASKS))
def test_generation_is_deterministic_per_seed_and_split(streams, name):
    again = generate_splits(TASKS[name], seed=7, sizes=SMALL)
    other = generate_splits(TASKS[name], seed=8, sizes=SMALL)
    bigger_train = generate_splits(TASKS[name], seed=7, sizes=(SMALL[0] + 5, *SMALL[1:]))
    for split, stream in streams[name].items():
        assert np.array_equal(stream.inputs, again[split].inputs)
        assert np.array_equal(stream.labels, again[split].labels)
        assert not np.array_equal(stream.inputs[:500], other[split].inputs[:500])
    # Each split has its own seed: a larger training set leaves validation and test unchanged.
    for split in ("valid", "test"):
        assert np.array_equal(bigger_train[split].inputs, streams[name][split].inputs)
    # ... and the splits do not share a single program or walk.
    split_sets = {
        split: {" ".join(words) for words, _ in sequences(*words_and_labels(name, stream))}
        for split, stream in streams[name].items()
    }
    assert len(split_sets["train"]) == SMALL[0]
    assert not split_sets["train"] & split_sets["valid"] and not split_sets["train"] & split_sets["test"]
    assert not split_sets["valid"] & split_sets["test"]


# ---------------------------------------------------------------------- metric
def test_task_error_counts_labelled_positions_only():
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX, 1], [0, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    logits = torch.zeros(2, 4, 3)
    logits[0, 1, 2] = 1.0  # right
    logits[0, 3, 2] = 1.0  # wrong (label 1)
    logits[1, 0, 0] = 1.0  # right
    logits[0, 0, 1] = logits[0, 2, 1] = 5.0  # unlabelled positions: never counted
    assert task_error(logits, labels) == pytest.approx(1 / 3)
    assert task_error(logits.flatten(0, 1), labels.flatten()) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no labelled"):
        task_error(logits, torch.full((2, 4), IGNORE_INDEX))
    with pytest.raises(ValueError, match="do not match"):
        task_error(logits, labels[:, :3])


# ----------------------------------------------------------------------- files
def test_write_and_load_round_trip(streams, tmp_path):
    out = write_task("random-walk", tmp_path / "walk", seed=7, sizes=SMALL)
    data = load_task(out)
    assert data.name == "random-walk" and data.vocab.words == TASKS["random-walk"].vocab.words
    assert data.meta["seed"] == 7 and data.meta["sizes"] == {"train": 60, "valid": 20, "test": 20}
    assert data.meta["details"]["grid_size"] == 8
    for split, stream in streams["random-walk"].items():
        assert isinstance(data.splits[split].inputs, np.memmap)
        assert np.array_equal(data.splits[split].inputs, stream.inputs)
        assert np.array_equal(data.splits[split].labels, stream.labels)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"


def test_write_refuses_bad_input(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(BlockloopError, match="not empty"):
        write_task("algorithm-3", tmp_path / "full", seed=0, sizes=(1, 1, 1))
    with pytest.raises(BlockloopError, match="unknown task 'algorithm-4'.*algorithm-3, algorithm-5, random-walk"):
        write_task("algorithm-4", tmp_path / "a", seed=0)
    with pytest.raises(BlockloopError, match="three positive counts"):
        write_task("algorithm-3", tmp_path / "a", seed=0, sizes=(1, 0, 1))
    (tmp_path / "empty").mkdir()
    assert load_task(write_task("algorithm-3", tmp_path / "empty", seed=0, sizes=(2, 1, 1))).meta["sizes"]["test"] == 1


def test_a_task_larger_than_memory_is_refused_before_and_during_generation(tmp_path, monkeypatch):
    """The generators grow Python lists (algorithm) or allocate numpy arrays (random walk): sizes past the machine's
    memory ran for hours, or ended in numpy's allocation traceback."""
    from blockloop.data.tasks import files

    too_big = r"needs at least [\d,.]+ GiB of memory, more than this machine has; use smaller sizes or shorter"
    for name in ("algorithm-3", "random-walk"):
        with pytest.raises(BlockloopError, match=f"task {name} at sizes 100000000000/1/1 {too_big}"):
            write_task(name, tmp_path / "a", seed=0, sizes=(10**11, 1, 1))
    # A length no model reads whole is refused at once, whatever memory would hold (it wrote for many minutes).
    with pytest.raises(BlockloopError, match="algorithm-3:999999999': its sequences take at least 2999999998 tokens"):
        write_task("algorithm-3:999999999", tmp_path / "a", seed=0, sizes=(1, 1, 1))
    # Within the machine's memory by that count, refused by the allocation itself: the same message.
    monkeypatch.setattr(files, "physical_memory", lambda: float("inf"))
    monkeypatch.setattr(np, "empty", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(BlockloopError, match=f"task random-walk at sizes 2/1/1 {too_big}"):
        write_task("random-walk", tmp_path / "a", seed=0, sizes=(2, 1, 1))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "meta.json").unlink(), "no meta.json"),
        (lambda d: (d / "meta.json").write_text("{not json"), "corrupt"),
        (lambda d: (d / "meta.json").write_text(json.dumps({"format": 1})), "corrupt"),
        (lambda d: (d / "meta.json").write_text(json.dumps({"format": 99})), "format 99"),
        (lambda d: (d / "valid" / "labels.bin").unlink(), "labels.bin is missing"),
        (lambda d: (d / "train" / "inputs.bin").write_bytes(b"\0" * 10), "truncated or corrupt"),
        # the right size, ids past the vocabulary (random bytes): named here, not an IndexError in the loss
        (lambda d: (d / "train" / "labels.bin").write_bytes(b"\xff\x7f" * ((d / "train" / "labels.bin").stat().st_size // 2)),
         "labels.bin holds ids outside the task's"),
        (lambda d: (d / "test" / "inputs.bin").write_bytes(b"\xff\xff" * ((d / "test" / "inputs.bin").stat().st_size // 2)),
         "inputs.bin holds ids outside the task's"),
    ],
)
def test_load_reports_missing_and_corrupt_files(tmp_path, damage, match):
    out = write_task("algorithm-5", tmp_path / "alg", seed=1, sizes=(2, 1, 1))
    damage(out)
    with pytest.raises(BlockloopError, match=match):
        load_task(out)


# ------------------------------------------------------------------------- CLI
def test_cli_tasks_list_and_make(tmp_path, capsys):
    assert main(["tasks", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in TASKS) and "10000/1000/1000" in out
    assert "NAME:N is a task at another length" in out  # the variants were named only by train --help and errors
    target = tmp_path / "alg3"
    assert main(["tasks", "make", "algorithm-3", "--out", str(target), "--seed", "3", "--sizes", "5,2,2", "--no-progress"]) == 0
    assert f"wrote algorithm-3 (seed 3) to {target}: train 5 (" in capsys.readouterr().out
    data = load_task(target)
    expected = generate_splits(TASKS["algorithm-3"], seed=3, sizes=(5, 2, 2))
    assert np.array_equal(data.splits["test"].labels, expected["test"].labels)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["tasks", "make", "maze", "--out", "{tmp}/x"], "unknown task 'maze'; choose one of: algorithm-3"),
        (["tasks", "make", "random-walk", "--out", "{tmp}/x", "--sizes", "10,1"], "three positive counts"),
        (["tasks", "make", "random-walk", "--out", "{tmp}/x", "--sizes", "10,a,1"], "--sizes expects"),
        (["tasks", "make", "random-walk", "--out", "{tmp}/x", "--seed", "-1", "--sizes", "1,1,1"], "--seed: must be an integer >= 0"),
        (["tasks", "make", "random-walk", "--out", "{tmp}"], "not empty"),
        (["tasks", "make", "random-walk", "--out", "{tmp}/occupied"], "occupied is a file, not a folder"),
        # The first statement of a program always assigns, so one-statement programs never print: nothing to learn.
        (["tasks", "make", "algorithm-3:1", "--out", "{tmp}/x", "--sizes", "3,2,2"],
         "task algorithm-3:1 (seed 0) drew no labelled position in its train split of 3; give longer sequences"),
    ],
)
def test_cli_tasks_errors_are_one_line(tmp_path, capsys, argv, match):
    (tmp_path / "occupied").write_text("")
    code = main([arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR
    assert len(err.splitlines()) == 1 and match in err, err
