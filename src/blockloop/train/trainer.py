"""The one training loop every model family uses.

A model only has to map ``(inputs, targets)`` to ``(logits, loss)``. The trainer owns everything
around that: AdamW and the schedule, gradient accumulation and clipping, bf16 autocast on CUDA,
optional ``torch.compile``, DDP/FSDP through :mod:`blockloop.train.distributed`, periodic validation,
metrics (stdout, JSONL, a progress bar with tokens/s and ETA) and atomic, exactly-resumable
checkpoints. A non-finite loss stops the run before anything is written, so the last checkpoint on
disk is always a good one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from tqdm import tqdm

from blockloop import progress
from blockloop.config import ModelConfig
from blockloop.data.collate import step_generator
from blockloop.data.loader import PackedSequences, StreamBatches, TrainBatches
from blockloop.data.tasks.windows import TaskSequences
from blockloop.data.tokenizers import Tokenizer
from blockloop.device import auto_dtype
from blockloop.errors import BlockloopError, ConfigError, check_context
from blockloop.families import spec_of
from blockloop.files import atomic_write_text
from blockloop.nn.loss import IGNORE_INDEX
from blockloop.signals import stop_at_safe_point
from blockloop.train import checkpoint as ckpt
from blockloop.train.config import TrainConfig
from blockloop.train.distributed import DistInfo, barrier, mean_across_ranks, parallelize, sum_across_ranks
from blockloop.train.evaluate import EvaluationStopped, evaluate
from blockloop.train.flops import mfu
from blockloop.train.optim import build_optimizer, lr_at


class TrainingDiverged(BlockloopError):
    """The loss or the weights stopped being finite numbers."""


StepCallback = Callable[[int, dict[str, float]], None]
# Adds a training-only term to the model's loss, e.g. distillation from a teacher that must stay out of the
# model (and so out of checkpoints): (batch, logits, loss) -> loss. Validation reports the model's own loss.
LossHook = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """Trains ``model`` on ``train_data`` and writes checkpoints/metrics under ``out_dir``."""

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        train_data: PackedSequences | TaskSequences,
        val_data: PackedSequences | TaskSequences | None,
        config: TrainConfig,
        out_dir: Path,
        *,
        run_info: dict[str, Any] | None = None,
        dist_info: DistInfo = DistInfo(),
        loss_hook: LossHook | None = None,
        data_fingerprint: str | None = None,
    ) -> None:
        check_context(config.seq_len, model_config.context_length, "a training window (--seq-len)",
                      "lower --seq-len or pick a preset with a longer context")
        spec = spec_of(model_config)
        spec.check_seq_len(model_config, config.seq_len)
        if hasattr(model, "_orig_mod"):  # its state dict names every weight _orig_mod.*: checkpoints would not load
            raise ConfigError("the model is a torch.compile wrapper; pass the model itself and TrainConfig(compile=True)")
        for role, data in (("train", train_data), ("validation", val_data)):
            if data is not None and data.seq_len != config.seq_len:  # the forward would fail, or tokens miscount
                raise ConfigError(f"the {role} data's windows are {data.seq_len} tokens, the config's seq_len "
                                  f"{config.seq_len}; cut the data with the config's seq_len")
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.loss_hook = loss_hook
        self.out_dir, self.run_info, self.dist = Path(out_dir), run_info or {}, dist_info
        self.data_fingerprint = data_fingerprint
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", dist_info.local_rank)
        named = {"fp32": torch.float32, "bf16": torch.bfloat16}  # choices.PRECISIONS
        precision = auto_dtype(self.device) if config.precision == "auto" else named[config.precision]
        self.autocast_dtype = precision if precision != torch.float32 else None

        self.model = model.to(self.device)
        self.train_model = parallelize(self.model, config.distributed, dist_info, self.device,
                                       per_layer=spec.shard_per_layer(model_config))
        if dist_info.rank > 0:  # every rank built the same weights from one seed; its dropout masks are its own
            torch.manual_seed(config.seed + dist_info.rank)
        self.forward = torch.compile(self.train_model) if config.compile else self.train_model
        self.optimizer = build_optimizer(
            self.train_model,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.beta1, config.beta2),
            decay_embeddings=config.decay_embeddings,
            fused=self.device.type == "cuda",
            hidden_lr_scale=model_config.hidden_lr_multiplier,
        )
        self.train_data, self.val_data = train_data, val_data
        self.collate = spec.collate(model_config, config.objective)
        # Recurrent models (staircase family) train with truncated BPTT: contiguous streams, and the state
        # each micro-batch's streams reached is carried (detached) into their next segment. It is not saved:
        # after --resume the streams continue from the saved position with an empty state. Data whose windows
        # are independent (task windows: whole sequences, overlapping) is read window by window from an empty
        # state, in shuffled batches, as for any model.
        self.recurrent = spec.recurrent(model_config) and not getattr(train_data, "independent_windows", False)
        if self.recurrent:
            self.batches = StreamBatches(
                train_data, config.batch_size, groups=config.grad_accum, rank=dist_info.rank, world_size=dist_info.world_size
            )
        else:
            self.batches = TrainBatches(
                train_data, config.batch_size, seed=config.seed, groups=config.grad_accum, rank=dist_info.rank,
                world_size=dist_info.world_size,
            )
        self.stream_states: list[Any] = [None] * config.grad_accum
        self.step = 0
        self.size_reported = False  # the first checkpoint written says how big checkpoints are
        self.tokens_per_step = config.batch_size * config.grad_accum * config.seq_len * dist_info.world_size
        self.tokens_seen = 0  # summed step by step: a resumed run may change its batch shape (what --tokens counts)
        self.flops_per_token = spec.training_flops_per_token(model_config, config.seq_len)

    # ----------------------------------------------------------------- resume
    def resume(self, checkpoint_dir: Path) -> None:
        """Restore model, optimizer, data position, step and RNG from a checkpoint directory."""
        directory = ckpt.resolve_checkpoint(checkpoint_dir)
        ckpt.check_process_count(directory, self.dist.world_size)
        state = ckpt.read_train_state(directory)
        self._check_same_data(directory, state)
        # The saved param_groups carry the hyperparameters the run was written with (weight decay, betas): loading
        # them would silently undo a flag given with --resume, which wins, as for every other training setting.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        optimizer_state = ckpt.load_optimizer(directory)
        ckpt.check_optimizer_state(directory, optimizer_state, self.model, len(self.optimizer.param_groups))
        set_state_dict(
            self.train_model,
            self.optimizer,
            model_state_dict=ckpt.read_model_tensors(directory, self.model),
            optim_state_dict=optimizer_state,
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        for group, setting in zip(self.optimizer.param_groups, settings):
            group.update(setting)
        self.batches.load_state_dict(state["data"])
        self.step = state["step"]
        self.tokens_seen = ckpt.tokens_trained(state)
        ckpt.load_rng(directory, self.dist.rank)
        if self.dist.is_main:
            self._truncate_metrics(self.step)

    def _check_same_data(self, directory: Path, state: dict[str, Any]) -> None:
        """Refuse to resume on training data other than the run's: the saved data position (epoch, index) would go
        on in other text, silently. Checkpoints written before fingerprints were saved are not checked."""
        saved = state.get("data_fingerprint")
        if saved is None or self.data_fingerprint is None or saved == self.data_fingerprint:
            return
        data = self.run_info.get("task") or self.run_info.get("data") or "the training data"
        raise BlockloopError(f"{data} is not the data {directory} was trained on (it changed since, or the tokenizer "
                             "reads it differently), so its saved position would continue in other text; restore that "
                             "data to --resume, or start a new run from the checkpoint with --init-from")

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics logged after the checkpoint, so the resumed log reads like an uninterrupted one, and a
        last line cut short (a kill or a full disk mid-append) that would otherwise break every later read."""
        path = self.out_dir / "metrics.jsonl"
        if path.is_file():
            kept = [record for record in ckpt.read_metrics(path) if record["step"] <= step]
            atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))

    # ------------------------------------------------------------------ train
    def fit(self, on_step: StepCallback | None = None) -> dict[str, float]:
        """Run until ``config.steps``; returns the last logged metrics."""
        cfg = self.config
        if self.step == 0 and ckpt.has_checkpoint(self.out_dir):  # not resumed: its checkpoints would mix with ours
            raise BlockloopError(f"{self.out_dir} already holds a run; resume it (Trainer.resume) or train into "
                                 "another folder")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.train_model.train()
        # The bar is closed also when training stops on an error (a diverged loss, Ctrl-C). One process stops at the
        # end of the step it is in and keeps it in a checkpoint; ranks under torchrun would see the signal at other
        # steps and wait on each other's collectives, so they stop at once (their last checkpoint is kept).
        with progress.bar(total=cfg.steps, initial=self.step, unit="step",
                          disable=not (cfg.progress and self.dist.is_main)) as bar, \
                stop_at_safe_point("this step, with a checkpoint", enabled=self.dist.world_size == 1) as stop:
            last: dict[str, float] = {}
            window_start, window_tokens = time.perf_counter(), 0
            while self.step < cfg.steps:
                lr = lr_at(
                    self.step, lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                    schedule=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio,
                )
                for group in self.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                loss = self._train_step()
                self.step += 1
                self.tokens_seen += self.tokens_per_step
                window_tokens += self.tokens_per_step
                if not math.isfinite(loss):
                    raise self._diverged(f"loss became {loss} at step {self.step}")
                metrics = {"step": self.step, "loss": loss, "lr": lr}
                bar.update(1)
                if self.step % cfg.log_interval == 0 or self.step == cfg.steps:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    metrics["tokens_per_s"] = window_tokens / elapsed
                    achieved = mfu(self.flops_per_token * metrics["tokens_per_s"] / self.dist.world_size, self.device)
                    if achieved is not None:
                        metrics["mfu"] = achieved
                    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{metrics['tokens_per_s']:.3g}")
                    self._log(metrics)
                    window_start, window_tokens = time.perf_counter(), 0
                if self.val_data is not None and (self.step % cfg.eval_interval == 0 or self.step == cfg.steps):
                    if self.dist.is_main:  # the bar stands still meanwhile: say why
                        tqdm.write(f"step {self.step}: validating on up to {cfg.eval_batches} batches")
                    try:  # a stop asked for meanwhile cuts it short: the step is checkpointed without it
                        validation = self.validate(stopped=lambda: stop.requested)
                        metrics.update(validation)
                        self._log({"step": self.step, **validation})
                    except EvaluationStopped:
                        tqdm.write(f"step {self.step}: validation cut short by the stop, not logged")
                if self.step % cfg.ckpt_interval == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
                last = metrics
                if on_step is not None:
                    on_step(self.step, metrics)
                if stop.requested and self.step < cfg.steps:
                    if self.step % cfg.ckpt_interval:
                        self.save_checkpoint()
                    raise KeyboardInterrupt
        return last

    def _train_step(self) -> float:
        """One optimizer step over ``grad_accum`` micro-batches (on every rank): the gradient of the mean loss over
        all the step's scored targets, as one large batch would give.

        Each micro-batch's loss is a mean over its own scored targets (those not ``IGNORE_INDEX``), and the
        objectives that leave some unscored (PrefixLM breakpoints, block padding, span lengths, task labels) score
        a different number in each; so each loss is weighted by its share of the step's scored targets, not by
        1/grad_accum.
        DDP and FSDP average gradients over ranks, hence the factor world_size.
        """
        cfg = self.config
        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        batches, fresh_streams = [], []
        for micro in range(cfg.grad_accum):
            # Each rank draws its own batch noise (span corruption, block padding, PrefixLM breakpoints), as the
            # rows of one larger batch would; one process draws what rank 0 does.
            draw = (self.step * cfg.grad_accum + micro) * self.dist.world_size + self.dist.rank
            batch = self.collate(*self.batches.next_batch(), step_generator(cfg.seed, draw))
            batches.append({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
            fresh_streams.append(self.recurrent and self.batches.starts_streams)
        scored = [(batch["targets"] != IGNORE_INDEX).sum() for batch in batches]
        step_scored = sum_across_ranks(torch.stack(scored).sum(), self.dist).clamp(min=1)
        total = torch.zeros((), device=self.device)
        for micro, batch in enumerate(batches):
            sync = micro == cfg.grad_accum - 1
            no_sync = getattr(self.train_model, "no_sync", None)
            with (nullcontext() if sync or no_sync is None else no_sync()), autocast:
                if self.recurrent:
                    state = None if fresh_streams[micro] else self.stream_states[micro]
                    logits, loss, state = self.forward(**batch, state=state, return_state=True)
                    self.stream_states[micro] = state.detach()
                else:
                    logits, loss = self.forward(**batch)
                if self.loss_hook is not None:
                    loss = self.loss_hook(batch, logits, loss)
                share = scored[micro] / step_scored
                (loss * share * self.dist.world_size).backward()
            total += loss.detach() * share
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.train_model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum_across_ranks(total, self.dist).item()

    def validate(self, stopped: Callable[[], bool] | None = None) -> dict[str, float]:
        """The validation metrics; ``stopped`` ends it early (:class:`~blockloop.train.evaluate.EvaluationStopped`)."""
        result = evaluate(
            self.forward if self.dist.world_size == 1 else self.model,
            self.val_data,
            batch_size=self.config.batch_size,
            max_batches=self.config.eval_batches,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            objective=self.config.objective,
            dist=self.dist,
            stopped=stopped,
        )
        metrics = {"val_loss": result["loss"], "val_perplexity": result["perplexity"]}
        if "error" in result:  # a labelled-position task: its error is the number that matters
            metrics["val_error"] = result["error"]
        return metrics

    # ------------------------------------------------------------ checkpoints
    def _diverged(self, what: str) -> TrainingDiverged:
        latest = ckpt.checkpoint_root(self.out_dir) / ckpt.LATEST
        kept = f"the last good checkpoint is in {self.out_dir}" if latest.exists() else "no checkpoint was written"
        return TrainingDiverged(f"{what}; {kept}; lower --lr or raise --warmup-steps")

    def _check_finite_weights(self) -> None:
        """The loss, checked every step, comes before the update that may break the weights (a huge step, an
        overflowing gradient): before a checkpoint is written, the weights themselves are checked, on every rank."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        broken = torch.stack([~torch.isfinite(p.detach()).all() for p in local]).any().float()
        if mean_across_ranks(broken, self.dist).item() > 0:
            raise self._diverged(f"the weights stopped being finite numbers at step {self.step} (the loss before "
                                 "that update was finite)")

    def save_checkpoint(self) -> Path | None:
        """Write a complete checkpoint for the current step (every rank takes part, rank 0 writes); weights that
        are no longer finite are never written."""
        self._check_finite_weights()
        model_state, optim_state = get_state_dict(
            self.train_model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        tmp = ckpt.temporary_checkpoint(self.out_dir, self.step)
        if self.dist.is_main:
            tmp = ckpt.begin_checkpoint(self.out_dir, self.step)
        barrier(self.dist)
        final = None
        try:  # a failed write (a full disk) leaves no partial directory behind
            ckpt.save_rng(tmp, self.dist.rank)
            if self.dist.is_main:
                ckpt.save_model_files(tmp, self.model, self.model_config, model_state)
                self.tokenizer.save(tmp)
                ckpt.save_optimizer(tmp, optim_state)
                ckpt.write_json_atomic(
                    tmp / "train_state.json",
                    {
                        "step": self.step,
                        "tokens": self.tokens_seen,
                        "data": self.batches.state_dict(),
                        "data_fingerprint": self.data_fingerprint,
                        "world_size": self.dist.world_size,
                        "train_config": dataclasses.asdict(self.config),
                        "run": self.run_info,
                    },
                )
        except OSError as exc:
            raise ckpt.write_failed(tmp, exc, model_state, optim_state) from exc
        barrier(self.dist)
        if self.dist.is_main:
            final = ckpt.commit_checkpoint(self.out_dir, tmp, self.step)
            if not self.size_reported:
                tqdm.write(ckpt.size_report(final, self.out_dir))
                self.size_reported = True
        barrier(self.dist)
        return final

    def _log(self, metrics: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        log = self.out_dir / "metrics.jsonl"
        try:
            with open(log, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        except OSError as exc:  # a full disk: a write's error names no file
            raise OSError(exc.errno, exc.strerror, str(log)) from None
        shown = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        tqdm.write(shown)


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"
