"""The trainer: loss falls, golden curve, exact resume, accumulation, NaN stop, checkpoints, DDP/FSDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockloop.errors import BlockloopError
from blockloop.train import checkpoint as ckpt
from blockloop.train.optim import build_optimizer, lr_at
from blockloop.train.run import RunSpec, load_trained, prepare_run, sequences
from blockloop.train.trainer import TrainConfig, Trainer, TrainingDiverged

GOLDEN = Path(__file__).parent / "golden" / "tiny_shakespeare_losses.json"
SRC = Path(__file__).resolve().parents[1] / "src"


def make_trainer(out: Path, **overrides) -> Trainer:
    spec = RunSpec(preset="tiny", data="shakespeare", tokenizer="byte")
    run = prepare_run(spec, seed=0, show_progress=False)
    settings = dict(
        steps=8, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_interval=4, eval_batches=2,
        log_interval=1, ckpt_interval=2, device="cpu", progress=False, seed=0,
    )
    config = TrainConfig(**{**settings, **overrides})
    train, val = sequences(run.splits, config.seq_len)
    return Trainer(run.model, run.model_config, run.tokenizer, train, val, config, out, run_info=spec.to_dict())


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in lines if "loss" in m]


def val_losses(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["val_loss"] for m in lines if "val_loss" in m]


def test_loss_falls(tmp_path):
    trainer = make_trainer(tmp_path / "run", steps=60, eval_interval=60, ckpt_interval=60)
    before = trainer.validate()["val_loss"]
    after = trainer.fit()["val_loss"]
    curve = losses(tmp_path / "run")
    assert after < before - 1.0
    assert sum(curve[-10:]) / 10 < sum(curve[:10]) / 10 - 1.0


def test_golden_loss_curve(tmp_path):
    """Fixed seed, tiny preset, CPU: the first steps' losses must not drift (catches silent regressions).

    After an intended change to the model, data order or optimizer, regenerate with
    BLOCKLOOP_UPDATE_GOLDEN=1 and say why in the commit.
    """
    make_trainer(tmp_path / "run", steps=6, ckpt_interval=6).fit()
    curve = losses(tmp_path / "run")
    if os.environ.get("BLOCKLOOP_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"losses": curve}, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert curve == pytest.approx(golden, rel=1e-4)


def test_killed_run_resumes_with_the_same_losses(tmp_path):
    make_trainer(tmp_path / "straight").fit()

    def crash(step, metrics):
        if step == 5:
            raise KeyboardInterrupt  # killed after step 5; the last checkpoint is step 4

    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path / "killed").fit(on_step=crash)
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    resumed = make_trainer(tmp_path / "killed")
    resumed.resume(tmp_path / "killed")
    assert resumed.step == 4
    resumed.fit()
    assert losses(tmp_path / "killed") == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)
    straight = load_trained(tmp_path / "straight").model.state_dict()
    for name, tensor in load_trained(tmp_path / "killed").model.state_dict().items():
        torch.testing.assert_close(tensor, straight[name], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_or_sigterm_ends_the_step_keeps_it_in_a_checkpoint_and_the_resume_matches(tmp_path, signum, capsys):
    """A Ctrl-C at step 3 of a run checkpointed every 4 used to lose steps 1-3: the run now ends the step it is in,
    writes it and stops; resumed, it gives the losses and weights of a run never stopped. A second signal stops at
    once (not waiting for the step)."""
    make_trainer(tmp_path / "straight").fit()

    def signal_at_3(step, metrics):
        if step == 3:
            os.kill(os.getpid(), signum)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path / "stopped", ckpt_interval=4).fit(on_step=signal_at_3)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # handlers put back
    assert "stopping after this step, with a checkpoint" in capsys.readouterr().err
    assert (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip() == "step_0000003"
    resumed = make_trainer(tmp_path / "stopped", ckpt_interval=4)
    resumed.resume(tmp_path / "stopped")
    assert resumed.step == 3
    resumed.fit()
    assert losses(tmp_path / "stopped") == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)

    def twice_at_2(step, metrics):
        if step == 2:
            os.kill(os.getpid(), signum)
            os.kill(os.getpid(), signum)  # raises here, inside the step's work, before any checkpoint of step 2

    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path / "twice", ckpt_interval=4).fit(on_step=twice_at_2)
    assert not (tmp_path / "twice" / "checkpoints" / "latest").exists()


def test_a_stop_during_validation_cuts_it_short_and_keeps_the_step(tmp_path, capsys):
    """A stop during a large validation waited for all of it (18 s in an audit; a scheduler's grace period can be
    shorter): the first signal now ends the validation at the next batch, and the step is checkpointed."""
    trainer = make_trainer(tmp_path / "run", eval_interval=4, eval_batches=50, ckpt_interval=8)
    validated = []

    class StoppedInValidation(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args, **kwargs):
            if not self.training:
                validated.append(1)
                if len(validated) == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
            return self.model(*args, **kwargs)

    trainer.forward = StoppedInValidation(trainer.forward)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert len(validated) == 1  # not the 50 batches asked for
    assert "step 4: validation cut short by the stop, not logged" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    assert val_losses(tmp_path / "run") == []  # a validation cut short is not logged as if whole


def test_the_trainer_refuses_what_would_fail_later_or_mix_two_runs(tmp_path):
    """Library misuse that failed only at the first step or the first save, or silently: a torch.compile wrapper
    (its weights saved as _orig_mod.*), data cut to another seq_len (a forward error, or tokens miscounted), and a
    fresh run into a folder holding another (their checkpoints and metrics interleaved)."""
    from blockloop.errors import ConfigError

    make_trainer(tmp_path / "run", steps=2).fit()
    fresh = make_trainer(tmp_path / "run", steps=2)
    with pytest.raises(BlockloopError, match="already holds a run; resume it"):
        fresh.fit()
    assert ckpt.read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 2  # left as it was
    t = make_trainer(tmp_path / "other")
    with pytest.raises(ConfigError, match="torch.compile wrapper; pass the model itself and TrainConfig"):
        Trainer(torch.compile(t.model), t.model_config, t.tokenizer, t.train_data, None, t.config, tmp_path / "x")
    from blockloop.data.loader import PackedSequences

    shorter = PackedSequences(t.train_data.tokens, 16)
    with pytest.raises(ConfigError, match="the train data's windows are 16 tokens, the config's seq_len 32"):
        Trainer(t.model, t.model_config, t.tokenizer, shorter, None, t.config, tmp_path / "y")


def test_resume_with_a_new_weight_decay_uses_it(tmp_path):
    """A training flag given with --resume wins over the checkpoint's, also inside the optimizer's param groups."""
    make_trainer(tmp_path / "run", steps=2, weight_decay=0.1).fit()
    resumed = make_trainer(tmp_path / "run", steps=4, weight_decay=0.0)
    resumed.resume(tmp_path / "run")
    assert [group["weight_decay"] for group in resumed.optimizer.param_groups] == [0.0, 0.0]
    assert all(state["exp_avg"].abs().sum() > 0 for state in resumed.optimizer.state.values())  # moments restored


def test_gradient_accumulation_matches_the_larger_batch(tmp_path):
    make_trainer(tmp_path / "big", steps=3, batch_size=4).fit()
    make_trainer(tmp_path / "accum", steps=3, batch_size=2, grad_accum=2).fit()
    assert losses(tmp_path / "accum") == pytest.approx(losses(tmp_path / "big"), abs=1e-5)


def test_accumulated_micro_batches_that_score_different_numbers_of_targets_weigh_each_target_equally(tmp_path):
    """Under PrefixLM each micro-batch draws its own breakpoint, so each scores a different number of targets: the
    accumulated gradient and the logged loss must be those of one batch holding both (a mean over every scored
    target), not the mean of the two micro-batch means."""
    trainer = make_trainer(tmp_path / "run", steps=1, batch_size=2, grad_accum=2, objective="prefix_lm", grad_clip=0.0)
    seen, grads = [], {}
    collate = trainer.collate
    trainer.collate = lambda *args: seen.append(collate(*args)) or seen[-1]
    trainer.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    logged = trainer._train_step()
    scored = [int((batch["targets"] != -100).sum()) for batch in seen]
    assert len(set(scored)) == 2  # the two micro-batches score different numbers of targets
    _, loss = trainer.model(**{key: torch.cat([batch[key] for batch in seen]) for key in seen[0]})
    loss.backward()
    assert logged == pytest.approx(loss.item(), rel=1e-5)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-block", "tiny-encdec", "tiny-double"])
def test_ranks_share_validation_batches_and_a_rank_without_rows_counts_nothing(tmp_path, preset):
    """Five windows, two ranks of batch 2: the global batches are windows 0-3 and 4, so rank 1 has no row in the
    second and runs a stand-in that must not count; the two ranks' sums are one process's at batch 4, also where
    the batch is reshaped with noise drawn row by row (block padding, span corruption) or for the whole batch (a
    block partition). (A process group of one: the all-reduce leaves each rank's own sums, added here.)"""
    import numpy as np
    import torch.distributed as torch_dist

    from blockloop.data.loader import PackedSequences
    from blockloop.families import build_model, from_name
    from blockloop.train.distributed import DistInfo
    from blockloop.train.evaluate import evaluate

    torch.manual_seed(0)
    model = build_model(from_name(preset))
    windows = PackedSequences(np.random.default_rng(0).integers(0, 256, 5 * 64 + 1).astype(np.uint16), 64)
    assert len(windows) == 5
    whole = evaluate(model, windows, batch_size=4)
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        parts = [evaluate(model, windows, batch_size=2, dist=DistInfo(rank=r, world_size=2)) for r in (0, 1)]
    finally:
        torch_dist.destroy_process_group()
    assert sum(part["tokens"] for part in parts) == whole["tokens"]
    if preset == "tiny":
        assert [part["tokens"] for part in parts] == [3 * 64, 2 * 64]
    assert sum(p["loss"] * p["tokens"] for p in parts) == pytest.approx(whole["loss"] * whole["tokens"], rel=1e-6)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path / "run")
    forward, calls = trainer.forward, []

    def poisoned(**batch):
        calls.append(1)
        logits, loss = forward(**batch)
        return logits, loss * float("nan") if len(calls) == 3 else loss

    trainer.forward = poisoned
    with pytest.raises(TrainingDiverged, match="loss became nan at step 3"):
        trainer.fit()
    directory = ckpt.resolve_checkpoint(tmp_path / "run")
    assert directory.name == "step_0000002"
    model = load_trained(tmp_path / "run").model
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_weights_broken_by_an_update_after_a_finite_loss_are_never_checkpointed(tmp_path):
    """The loss is computed before the update: an update that makes the weights infinite (here, at step 4) leaves
    that step's loss finite. The checkpoint of step 4 is refused, so the last one stays the last good one."""
    trainer = make_trainer(tmp_path / "run")
    step = trainer.optimizer.step

    def breaking_step(*args, **kwargs):
        result = step(*args, **kwargs)
        if trainer.step == 3:  # the update of the 4th step (the counter moves after it)
            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("inf"))
        return result

    trainer.optimizer.step = breaking_step
    with pytest.raises(TrainingDiverged, match="the weights stopped being finite numbers at step 4"):
        trainer.fit()
    assert ckpt.resolve_checkpoint(tmp_path / "run").name == "step_0000002"
    assert all(torch.isfinite(p).all() for p in load_trained(tmp_path / "run").model.parameters())


def test_checkpoints_are_complete_rotated_and_corruption_is_reported(tmp_path):
    make_trainer(tmp_path / "run").fit()
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000006", "step_0000008"]
    files = {p.name for p in (root / "step_0000008").iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.safetensors", "train_state.json", "rng_rank0.safetensors"} <= files
    model_file = root / "step_0000008" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(BlockloopError, match="corrupt"):
        load_trained(tmp_path / "run")
    (root / "latest").write_text("step_0000099\n")
    with pytest.raises(BlockloopError, match="missing or incomplete .* write step_0000008 .* into"):
        load_trained(tmp_path / "run")
    for step in root.glob("step_*"):  # no checkpoint left whole: the message still says what to do
        (step / "model.safetensors").unlink()
    (root / "latest").write_text("step_0000008\n")
    with pytest.raises(BlockloopError, match="no model.safetensors.*no other checkpoint: restore model.safetensors "
                                             "from a copy, or retrain"):
        load_trained(tmp_path / "run")


def test_checkpoints_past_ten_million_steps_rotate_and_resolve_in_step_order(tmp_path):
    """Step folders are zero-padded to seven digits, so past 9,999,999 their text order is not their step order."""
    for step in (9_999_999, 10_000_000, 10_000_001):
        write_checkpoint(tmp_path, step)
    root = ckpt.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_10000000", "step_10000001"]
    (root / "latest").unlink()  # killed before ``latest`` was written: the newest complete checkpoint is taken
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_10000001"


def write_checkpoint(run: Path, step: int) -> None:
    tmp = ckpt.begin_checkpoint(run, step)
    (tmp / "model.safetensors").write_bytes(b"")
    (tmp / "train_state.json").write_text("{}")
    ckpt.commit_checkpoint(run, tmp, step)


def test_rotation_counts_only_the_complete_checkpoints_up_to_latest(tmp_path):
    """A run rolled back (``latest`` pointed at an earlier step) keeps its two newest checkpoints as it goes on:
    a later-numbered folder of the abandoned future, or an incomplete one, neither counts nor goes (counted, it
    pushed out the live run's checkpoint before)."""
    for step in (10, 15, 50):
        write_checkpoint(tmp_path, step)
    root = ckpt.checkpoint_root(tmp_path)
    (root / "latest").write_text("step_0000015\n")
    (root / "step_0000060").mkdir()  # incomplete: no weights
    write_checkpoint(tmp_path, 16)
    write_checkpoint(tmp_path, 17)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000016", "step_0000017", "step_0000050",
                                                           "step_0000060"]


def test_schedule_warms_up_then_decays_to_the_floor():
    kw = dict(lr=1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(100, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(55, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(55, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_at(80, schedule="constant", **kw) == 1.0
    cosine = [lr_at(s, schedule="cosine", **kw) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(cosine, cosine[1:]))


def test_weight_decay_skips_norms_biases_and_embeddings():
    from blockloop.families import build_model, from_name

    model = build_model(from_name("tiny-neox"))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model.body.blocks[0].attn.qkv.weight) in decayed
    assert id(model.lm_head.weight) in decayed  # untied head is a projection, not a lookup
    assert id(model.embed.weight) not in decayed
    assert id(model.body.blocks[0].attn.qkv.bias) not in decayed
    assert id(model.body.blocks[0].norm1.weight) not in decayed
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


TORCHRUN_TRAIN = [
    "train", "--preset", "tiny", "--data", "shakespeare", "--tokenizer", "byte", "--steps", "3", "--seq-len", "32",
    "--lr", "3e-3", "--warmup-steps", "1", "--log-interval", "1", "--eval-interval", "3", "--eval-batches", "1",
    "--device", "cpu", "--no-progress",
]


def _launch(out: Path, *args: str, nproc: int = 1) -> list[float]:
    """Run the CLI as a real process (under torchrun when nproc > 1) and return its logged losses."""
    if nproc == 1:
        command = [sys.executable, "-m", "blockloop.cli", *args, "--out", str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "blockloop.cli", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_processes_match_one_process_with_the_same_global_batch(tmp_path, strategy):
    single = _launch(tmp_path / "single", *TORCHRUN_TRAIN, "--batch-size", "4")
    double = _launch(tmp_path / "double", *TORCHRUN_TRAIN, "--batch-size", "2", "--distributed", strategy, nproc=2)
    assert len(double) == 3
    assert double == pytest.approx(single, abs=1e-5)
    # validation too: the two ranks share the batches of 4 that one process reads, rather than both reading 2
    assert val_losses(tmp_path / "double") == pytest.approx(val_losses(tmp_path / "single"), abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_resume_matches_single_process_resume(tmp_path, strategy, capsys):
    """Checkpoints written by two ranks (sharded for FSDP) restore like a single process's."""
    resume = ["train", "--resume", "--steps", "5", "--no-progress"]
    _launch(tmp_path / "single", *TORCHRUN_TRAIN, "--batch-size", "4")
    single = _launch(tmp_path / "single", *resume)
    _launch(tmp_path / "double", *TORCHRUN_TRAIN, "--batch-size", "2", "--distributed", strategy, nproc=2)
    double = _launch(tmp_path / "double", *resume, nproc=2)
    assert len(double) == 5
    assert double == pytest.approx(single, abs=1e-5)
    # what --resume will need is on show: each rank's data position is saved
    from blockloop.cli import main

    capsys.readouterr()
    assert main(["info", str(tmp_path / "double")]) == 0
    assert "by 2 processes (torchrun --nproc-per-node 2 to resume)" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "single")]) == 0 and "processes" not in capsys.readouterr().out


def _torchrun(cwd: Path, *args: str, node: tuple[int, int] | None = None) -> subprocess.Popen:
    """The CLI under torchrun in ``cwd``: two processes of one standalone launch, or one node (rank, port) of a
    two-node launch on this host."""
    launch = ["--standalone", "--nproc-per-node=2"] if node is None else [
        "--nnodes=2", f"--node-rank={node[0]}", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={node[1]}"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch, "-m", "blockloop.cli", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_ranks_that_write_to_different_folders_are_refused_before_training(tmp_path):
    """Two nodes whose relative --out are different folders (other working directories): every rank stops with
    the one-line reason before a step, instead of failing in the first checkpoint with a transport traceback."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    nodes = []
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        nodes.append(_torchrun(tmp_path / f"node{rank}", *TORCHRUN_TRAIN, "--out", "run", node=(rank, port)))
    for rank, node in enumerate(nodes):
        _, err = node.communicate(timeout=300)
        assert node.returncode != 0
        # (the launcher's own report of a failed worker follows, as for any failing worker; no blockloop frame)
        assert "error: not every rank sees the run folder run that rank 0 locked" in err and str(SRC) not in err, err
        assert not (tmp_path / f"node{rank}" / "run" / "checkpoints").exists()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from blockloop.files import run_lock
with run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_rank_does_not_take_its_own_launchs_lock_for_another_run(tmp_path):
    """Rank 0 holds the run's lock for the whole launch (the workers of one torchrun agent): to rank 1 resuming a
    run killed before its first checkpoint, that lock is not another run still training; to a process of another
    launch it is."""
    from blockloop.files import held_by_this_job, running_here

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    launch = {**os.environ, "PYTHONPATH": str(SRC), "TORCHELASTIC_RUN_ID": "launch-1"}
    # "rank 0": a child of this process, as rank 1's checks below run in this process's child too
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "run")], env=launch,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        ask = ("import sys; from pathlib import Path; from blockloop.files import held_by_this_job, running_here; "
               "print(held_by_this_job(Path(sys.argv[1])), running_here(Path(sys.argv[1])))")
        rank1 = subprocess.run([sys.executable, "-c", ask, str(tmp_path / "run")], env=launch, capture_output=True,
                               text=True, check=True).stdout.split()
        assert rank1 == ["True", "None"]
        assert (held_by_this_job(tmp_path / "run"), running_here(tmp_path / "run")) == (False, holder.pid)
    finally:
        holder.kill()
        holder.wait()


# Each tiny preset through FSDP on a one-rank process group (its weights are DTensors all the same), as the family
# spec shards it, two windows (recurrent models carry their state into the second); prints, per preset, whether
# sharding as the spec says kept loss and gradients equal to the plain model's, and whether per-layer units fail.
FSDP_FAMILIES = """
import copy, sys, torch, torch.distributed as dist
from blockloop.data.collate import step_generator
from blockloop.families import PRESETS, build_model, collate_for, from_name, spec_of
from blockloop.train.distributed import DistInfo, parallelize
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)

def train_two_windows(model, config, x):
    spec, state, losses = spec_of(config), None, []
    for window in x.chunk(2, dim=1):
        batch = collate_for(config)(window[:, :-1], window[:, 1:], step_generator(0, 0))
        if spec.recurrent(config):
            _, loss, state = model(**batch, state=state, return_state=True)
            state = state.detach()  # truncated BPTT, as the trainer does
        else:
            _, loss = model(**batch)
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]

for name in [p for p in PRESETS if p.startswith("tiny")]:
    config = from_name(name)
    torch.manual_seed(0)
    plain = build_model(config)
    unit = spec_of(config).sequence_multiple(config)
    x = torch.randint(0, config.vocab_size, (2, 2 * (8 * unit + 1)))
    want = train_two_windows(copy.deepcopy(plain), config, x)
    per_layer = spec_of(config).shard_per_layer(config)
    sharded = parallelize(copy.deepcopy(plain), "fsdp", DistInfo(0, 0, 2), torch.device("cpu"), per_layer=per_layer)
    got = train_two_windows(sharded, config, x)
    same = got[0] == want[0] and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[1], want[1]))
    layer_units = "-"
    if not per_layer:
        try:
            train_two_windows(parallelize(copy.deepcopy(plain), "fsdp", DistInfo(0, 0, 2), torch.device("cpu")), config, x)
            layer_units = "works"
        except RuntimeError as exc:
            layer_units = "fails" if "DTensor" in str(exc) else repr(exc)
    print(name, same, layer_units, flush=True)
"""


@pytest.mark.slow
def test_fsdp_shards_every_family_without_changing_its_training(tmp_path):
    """A family whose model reads a layer's weights outside the layer's forward (cross K/V, a recurrent core's
    K/V of carried state) crashed under --distributed fsdp with per-layer units; its spec makes the model one
    unit, and per-layer units stay where they work."""
    script = tmp_path / "fsdp_families.py"
    script.write_text(FSDP_FAMILIES)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {name: (same, layer_units) for name, same, layer_units in map(str.split, result.stdout.splitlines())}
    assert {"tiny-double", "tiny-encdec", "tiny-transformer-xl", "tiny-feedback", "tiny", "tiny-block"} <= set(rows)
    assert all(same == "True" for same, _ in rows.values()), rows
    # The one-unit fallback is taken only where per-layer units fail.
    assert {name for name, (_, layer_units) in rows.items() if layer_units != "-"} == {
        name for name, (_, layer_units) in rows.items() if layer_units == "fails"}, rows
    assert rows["tiny-double"][1] == rows["tiny-transformer-xl"][1] == "fails" and rows["tiny"][1] == "-"


@pytest.mark.slow
def test_torchrun_ranks_draw_their_own_dropout_masks(tmp_path):
    """Every rank builds the same weights from one seed, then draws its own noise: identical dropout masks on two
    ranks would make two half batches one batch's worth of regularisation."""
    _launch(tmp_path / "run", *TORCHRUN_TRAIN, "--steps", "2", "--eval-interval", "2", "--batch-size", "2",
            "--set", "dropout=0.1", nproc=2)
    step = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert (step / "rng_rank0.safetensors").read_bytes() != (step / "rng_rank1.safetensors").read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_cuda_bf16_training_loss_falls(tmp_path, compile_model):
    trainer = make_trainer(tmp_path / "run", steps=60, device="cuda", compile=compile_model, eval_interval=60, ckpt_interval=60)
    assert trainer.autocast_dtype == torch.bfloat16
    before = trainer.validate()["val_loss"]
    assert trainer.fit()["val_loss"] < before - 1.0


def test_model_files_take_string_paths_and_load_trained_checks_its_device(tmp_path):
    """The library's checkpoint functions take a str as load_config and load_trained do (they called .mkdir and
    / on it), and load_trained checks a device name as --device does, before reading anything."""
    from blockloop.families import build_model, from_name
    from blockloop.train.checkpoint import load_model_state, save_model_files

    config = from_name("tiny")
    model, copy = build_model(config), build_model(config)
    save_model_files(str(tmp_path / "weights"), model, config)
    load_model_state(str(tmp_path / "weights"), copy)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values()))
    # a torch.compile wrapper saves its model's weights under their own names (they were _orig_mod.*, refused on
    # loading; with tied weights the save itself failed)
    with pytest.raises(BlockloopError, match="holds a model without its tokenizer"):
        load_trained(tmp_path / "weights")
    with pytest.raises(BlockloopError, match="is no folder; give the one save_model_files"):
        load_model_state(tmp_path / "nowhere", copy)
    save_model_files(tmp_path / "compiled", torch.compile(model), config)
    fresh = build_model(config)
    load_model_state(tmp_path / "compiled", fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    with pytest.raises(BlockloopError, match="'tpu7' is not a device"):
        load_trained(tmp_path / "no-run", device="tpu7")
    if not torch.cuda.is_available():
        with pytest.raises(BlockloopError, match="CUDA is not available"):
            load_trained(tmp_path / "no-run", device="cuda")
