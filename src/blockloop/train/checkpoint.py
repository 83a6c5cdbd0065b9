"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of a run directory::

    RUN/metrics.jsonl
    RUN/checkpoints/step_0000100/{config.json, model.safetensors, tokenizer.json,
                                  optimizer.safetensors, optimizer.json, rng_rank*.safetensors,
                                  train_state.json}
    RUN/checkpoints/latest          name of the newest complete checkpoint

A checkpoint is assembled in a temporary directory and renamed into place, then ``latest`` is
replaced by rename too, so a run killed at any moment leaves the previous checkpoint intact. Nothing
is unpickled when loading: safetensors and JSON only, which is what ``weights_only`` loading guarantees.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from blockloop.choices import SAVE_DTYPES
from blockloop.config import ModelConfig, read_config_dict, save_config
from blockloop.errors import BlockloopError
from blockloop.families import config_from_dict
from blockloop.files import LOCK_FILE, atomic_write_text, check_new_folder, new_file_mode, running_here
from blockloop.nn.lora import split_fused_lora

LATEST = "latest"
KEEP_LAST = 2


def check_new_model_folder(out: Path | str) -> Path:
    """Where a conversion, import or export writes a model: never over a model or into a training run (whose
    checkpoints it would mix with), and otherwise a new or empty folder (:func:`blockloop.files.folder_in_place`)."""
    out = Path(out)
    if (out / "model.safetensors").exists() or (out / "config.json").exists():
        raise BlockloopError(f"{out} already holds a model; choose another --out")
    if (out / "checkpoints").exists():
        raise BlockloopError(f"{out} holds a training run; choose another --out")
    return check_new_folder(out)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def run_folder(path: Path) -> Path:
    """The training run a checkpoint belongs to, whether ``path`` is the run, its ``checkpoints`` folder or one
    ``step_*`` in it: what a served or benched model is named after (``step_0000400`` says nothing about it)."""
    path = Path(path).resolve()
    if path.name.startswith("step_") and path.parent.name == "checkpoints":
        path = path.parent
    return path.parent if path.name == "checkpoints" else path


def temporary_checkpoint(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is moved into place (every rank writes its RNG there)."""
    return checkpoint_root(run_dir) / f".tmp_step_{step:07d}"


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """The temporary directory a checkpoint for ``step`` is written into (fresh and empty).

    Checkpoints older than the newest complete one go first, so a disk that held two checkpoints has room
    for the next one (``--resume`` on a full disk makes progress instead of failing at every write).
    """
    prune_checkpoints(run_dir, keep=1)
    tmp = temporary_checkpoint(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(run_dir: Path, tmp: Path, step: int) -> Path:
    """Move a fully written checkpoint into place, point ``latest`` at it, drop old ones."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:07d}"
    if final.exists():  # moved aside whole, so a reader never sees a half-deleted step directory
        old = root / f".tmp_old_{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, final.name + "\n")
    prune_checkpoints(run_dir, keep=KEEP_LAST)
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints up to the one ``latest`` names, never that one.

    Folders numbered past ``latest`` (a run rolled back by pointing ``latest`` at an earlier step, as the errors
    about a damaged checkpoint advise) and incomplete ones are neither counted nor deleted: counted, they would push
    the live run's own earlier checkpoints out."""
    root = checkpoint_root(run_dir)
    latest = latest_name(root)
    newest = _step_number(root / latest) if latest is not None else None
    steps = [p for p in _complete_steps(run_dir) if newest is None or _step_number(p) <= newest]
    for old in steps[:-keep]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def discard_temporary(run_dir: Path) -> None:
    """Remove what interrupted writes left behind: partial checkpoints and ``.tmp-*`` files of atomic writes."""
    root = checkpoint_root(run_dir)
    for leftover in [*root.glob(".tmp*"), *Path(run_dir).glob(".tmp-*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a complete checkpoint (not only the leftovers of an interrupted first write)."""
    root = checkpoint_root(run_dir)
    return (root / LATEST).is_file() or any((p / "train_state.json").is_file() for p in root.glob("step_*"))


def latest_name(root: Path) -> str | None:
    """The checkpoint a run's ``checkpoints`` folder ``root`` names as its latest (None: none readable)."""
    try:
        return (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' writer, made to fail and to land as every other file here does: its I/O errors (a full disk, a
    folder another rank cannot see) are raised as the OSError they are, for :func:`write_failed` and the CLI to
    name, and the file gets the permissions any new file there gets, not the 0600 of the writer's own temporary
    file."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        raise os_error_of(exc, path) from exc
    os.chmod(path, new_file_mode(path.parent))


def os_error_of(exc: SafetensorError, path: Path) -> Exception:
    """The OSError inside a safetensors write error (its Rust I/O error, "os error N"), naming ``path``; or the
    error itself when it is not one."""
    code = re.search(r"os error (\d+)", str(exc))
    return exc if code is None else OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))


def write_failed(tmp: Path, exc: OSError, *states: dict[str, torch.Tensor] | dict[str, Any]) -> Exception:
    """Remove the partial checkpoint ``tmp`` after a failed write; a full disk becomes one line saying how much
    space a checkpoint needs and how much is free (any other error is returned as it is, for the CLI to report)."""
    shutil.rmtree(tmp, ignore_errors=True)
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return exc
    needed = sum(t.numel() * t.element_size() for t in _tensors(states))
    free = shutil.disk_usage(tmp.parent if tmp.parent.exists() else Path(".")).free
    return BlockloopError(
        f"no space left on the device of {tmp.parent} for the checkpoint: it needs about {_size(needed)}, "
        f"{_size(free)} is free; the previous checkpoint is kept; free some space and continue with --resume"
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _complete_steps(path: Path) -> list[Path]:
    """A run's complete checkpoints (weights in place), oldest first."""
    return sorted((p for p in checkpoint_root(path).glob("step_*") if (p / "model.safetensors").is_file()),
                  key=_step_number)


def _step_number(step_dir: Path) -> tuple[int, str]:
    """The step a ``step_*`` folder holds, for ordering: the names are zero-padded to seven digits only, so
    past 9,999,999 steps their text order is not their step order."""
    digits = step_dir.name.removeprefix("step_")
    return (int(digits), "") if digits.isdigit() else (-1, digits)


def resolve_checkpoint(path: Path) -> Path:
    """Accept a run directory, its ``checkpoints`` folder, or one checkpoint directory.

    ``latest`` must name a directory directly inside its own folder: a name that leads elsewhere
    (``../other-run``, an absolute path) is refused rather than followed.
    """
    path = Path(path)
    if not path.exists():
        raise BlockloopError(f"checkpoint not found: {path}; pass the --out directory of a training run")
    for root in (checkpoint_root(path), path):
        latest = root / LATEST
        if latest.exists() and not latest.is_file():
            raise BlockloopError(f"{latest} is a folder, not the file naming the newest checkpoint; the run is corrupt: "
                                 "remove it and write the name of one of its step_* directories into a file of that name")
        if latest.is_file():
            name = latest_name(root) or ""
            target = root / name
            if not name or Path(name).name != name or name in (".", ".."):
                raise BlockloopError(f"{latest} names {name!r}, not a checkpoint directory inside {root}; the run is "
                                     "corrupt: write the name of one of its step_* directories into it")
            if not (target / "model.safetensors").is_file():
                kept = _complete_steps(path)
                fix = (f"write {kept[-1].name} (its newest complete checkpoint) into {latest}" if kept else
                       "the run has no other checkpoint: restore model.safetensors from a copy, or retrain")
                raise BlockloopError(f"{latest} points at {target}, which is missing or incomplete (no model.safetensors); "
                                     f"the run is corrupt: {fix}")
            return target
    # A run killed between moving its first checkpoint into place and writing ``latest`` (commit_checkpoint) still
    # has that checkpoint: take the newest complete one.
    steps = _complete_steps(path)
    if steps:
        return steps[-1]
    if _is_hf_folder(path):
        raise BlockloopError(f"{path} is a Hugging Face model folder, not a blockloop checkpoint; import it first: "
                             f"blockloop convert --from-hf {shlex.quote(str(path))} --out RUN, then give RUN in its place")
    if (path / "model.safetensors").is_file():
        return path
    if checkpoint_root(path).is_dir() or (path / LOCK_FILE).is_file():  # a run that never wrote a checkpoint
        pid = running_here(path)
        if pid is not None:  # ... yet: it is still training
            raise BlockloopError(f"{path} is still training (process {pid}) and has not written its first checkpoint "
                                 "yet; wait for it (train writes one every --ckpt-interval steps and at the end)")
        raise BlockloopError(f"{path} holds no complete checkpoint (the run stopped before its first one was written); "
                             "train it again, without --resume")
    raise BlockloopError(f"no checkpoint in {path}; expected a run directory written by `blockloop train`")


def _is_hf_folder(path: Path) -> bool:
    """Whether ``path`` holds a Hugging Face model's ``config.json`` (an ``architectures`` or ``model_type`` key,
    neither of which a blockloop config has)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("architectures" in config or "model_type" in config)


def save_model_files(
    directory: Path | str, model: nn.Module, config: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None,
    *, dtype: torch.dtype | None = None,
) -> None:
    """config.json + model.safetensors; a tied tensor is stored once, under its first name.

    Aliases are found from the model's parameters, not from tensor storage: a gathered FSDP state dict
    holds separate copies of tied weights. ``dtype`` (see :func:`save_dtype`) casts floating-point tensors,
    for exports; loading casts them back into the model's own dtype.
    """
    directory = Path(directory)
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: its model's weights, under their own names
    state_dict = state_dict if state_dict is not None else model.state_dict()
    state_dict = {name.removeprefix("_orig_mod."): t for name, t in state_dict.items()}
    tied = _tied_names(model)
    tensors = {
        name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in state_dict.items() if name not in tied
    }
    directory.mkdir(parents=True, exist_ok=True)  # as torch.save or save_pretrained would: a new folder is fine
    save_config(config, directory / "config.json")
    save_tensors(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def save_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :data:`SAVE_DTYPES` name."""
    if name not in SAVE_DTYPES:
        raise BlockloopError(f"--save-dtype {name!r} is not one of {', '.join(SAVE_DTYPES)}")
    return getattr(torch, name)


def size_report(directory: Path, run_dir: Path) -> str:
    """One line: what checkpoint ``directory`` of ``run_dir`` weighs on disk, split into float32 weights and
    optimizer state (AdamW's two moments: twice the weights), and the command that writes the weights alone."""
    sizes = {p.name: p.stat().st_size for p in Path(directory).iterdir() if p.is_file()}
    weights, optimizer = sizes.get("model.safetensors", 0), sizes.get("optimizer.safetensors", 0)
    run_dir = Path(run_dir)
    return (
        f"each checkpoint is {_size(sum(sizes.values()))} (weights {_size(weights)} + optimizer state "
        f"{_size(optimizer)}, float32; the last {KEEP_LAST} are kept); the weights alone in bfloat16 ({_size(weights // 2)}): blockloop "
        f"convert --to weights --save-dtype bfloat16 --checkpoint {shlex.quote(str(run_dir))} --out "
        f"{shlex.quote(f'{run_dir}-weights')}"
    )


def _size(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def read_model_tensors(directory: Path | str, model: nn.Module) -> dict[str, torch.Tensor]:
    """model.safetensors, checked to hold exactly ``model``'s parameters (tied aliases stored once), each of the
    shape ``model`` (built from the checkpoint's config.json) expects."""
    directory = Path(directory)
    tensors = _read_safetensors(directory / "model.safetensors")
    split_fused_lora(tensors, model)
    expected = {name: t.shape for name, t in model.state_dict().items() if name not in _tied_names(model)}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise BlockloopError(
            f"checkpoint {directory} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]}); "
            "it was written by a different model"
        )
    wrong = [f"{name} {tuple(tensors[name].shape)} (config: {tuple(shape)})"
             for name, shape in expected.items() if tensors[name].shape != shape]
    if wrong:
        raise BlockloopError(f"checkpoint {directory}: tensor shapes do not match its config.json: {', '.join(wrong[:3])}; "
                             "the config was edited or belongs to another model")
    # Training stops before it would save a NaN (Trainer), so non-finite weights are damage to the file, which
    # would otherwise surface later as a NaN loss blamed on the learning rate, or as garbage text.
    damaged = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if damaged:
        raise BlockloopError(f"{directory / 'model.safetensors'} holds NaN or infinite values ({', '.join(damaged[:3])}): "
                             "corrupt; use an earlier checkpoint of the run")
    return tensors


def load_model_state(directory: Path | str, model: nn.Module) -> None:
    """Load model.safetensors into a plain (unwrapped) ``model``."""
    if not Path(directory).is_dir():  # not a checkpoint with a file missing: no checkpoint at all
        raise BlockloopError(f"{directory} is no folder; give the one save_model_files (or train) wrote")
    model.load_state_dict(read_model_tensors(directory, model), strict=False)


def save_optimizer(directory: Path, optimizer_state: dict[str, Any]) -> None:
    """Flatten an FQN-keyed optimizer state dict into tensors (safetensors) + hyperparameters (JSON)."""
    tensors, scalars = {}, {}
    for name, state in optimizer_state["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{name}/{key}"] = value
    save_tensors(tensors, directory / "optimizer.safetensors")
    write_json_atomic(directory / "optimizer.json", {"param_groups": optimizer_state["param_groups"], "scalars": scalars})


def load_optimizer(directory: Path) -> dict[str, Any]:
    tensors = _read_safetensors(directory / "optimizer.safetensors")
    path = directory / "optimizer.json"
    meta = read_json(path)
    if not (isinstance(meta, dict) and isinstance(meta.get("param_groups"), list) and isinstance(meta.get("scalars"), dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in meta["param_groups"])):
        raise BlockloopError(f"{path} does not hold the optimizer's param_groups and scalars; "
                             f"{_corrupt(path)}")
    state: dict[str, dict[str, Any]] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, slash, key = flat.rpartition("/")
        if not (name and slash and key):
            raise BlockloopError(f"{directory} holds optimizer state {flat!r}, not PARAMETER/NAME; "
                                 f"{_corrupt(path)}")
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def check_optimizer_state(directory: Path, optimizer_state: dict[str, Any], model: nn.Module, groups: int) -> None:
    """Refuse optimizer state that is not ``model``'s: state missing for a trained parameter would be started afresh
    without a word (and a moment of another shape fails mid-step), a parameter unknown to the model is dropped."""
    expected = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    saved = optimizer_state["state"]
    problems = [f"no state for {', '.join(sorted(set(expected) - set(saved))[:3])}"] if set(expected) - set(saved) else []
    if set(saved) - set(expected):
        problems.append(f"state for unknown parameters {', '.join(sorted(set(saved) - set(expected))[:3])}")
    wrong = [name for name in sorted(set(expected) & set(saved)) for key in ("exp_avg", "exp_avg_sq")
             if not torch.is_tensor(saved[name].get(key)) or saved[name][key].shape != expected[name]]
    if wrong:
        problems.append(f"moments missing or of the wrong shape for {', '.join(dict.fromkeys(wrong[:3]))}")
    listed = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    if len(optimizer_state["param_groups"]) != groups or sorted(listed) != sorted(expected):
        problems.append(f"{len(optimizer_state['param_groups'])} parameter groups over {len(listed)} parameters, "
                        f"the model trains {groups} over {len(expected)}")
    if problems:
        raise BlockloopError(f"the optimizer state in {directory} does not fit the model ({'; '.join(problems)}): it "
                             "belongs to another model or is damaged; resume from an earlier checkpoint, or start a new "
                             "run from this one with --init-from")


def save_rng(directory: Path, rank: int) -> None:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    save_tensors(tensors, directory / f"rng_rank{rank}.safetensors")


def check_process_count(directory: Path, world_size: int) -> None:
    """Refuse, on every rank alike, to resume a checkpoint written by another number of processes (one random
    state per rank, drawn on in each rank's own order). Called before any collective: a rank that went
    on while another stopped would wait on it forever, or die with the transport's traceback."""
    written = len(list(directory.glob("rng_rank*.safetensors")))
    ranks = [directory / f"rng_rank{rank}.safetensors" for rank in range(max(written, 1))]
    if not all(path.is_file() for path in ranks):  # e.g. no rng_rank0 at all: no process count to name
        missing = next(path for path in ranks if not path.is_file())
        raise missing_file(missing)
    if written != world_size:
        launch = "without torchrun" if written == 1 else f"with torchrun --nproc-per-node {written}"
        raise BlockloopError(f"{directory} was written by {written} process{'es' * (written != 1)}, this resume runs "
                             f"{world_size}; resume {launch}")


def load_rng(directory: Path, rank: int) -> None:
    path = directory / f"rng_rank{rank}.safetensors"
    if not path.is_file():
        raise missing_file(path)
    tensors = _read_safetensors(path)
    states = [tensors.get("torch_cpu"), *([tensors["torch_cuda"]] if "torch_cuda" in tensors else [])]
    if not all(torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1 for t in states):
        raise BlockloopError(f"{path} does not hold a random number generator state (torch_cpu, bytes); "
                             f"{_corrupt(path)}")
    try:
        torch.set_rng_state(tensors["torch_cpu"])
    except RuntimeError as exc:  # bytes of the wrong length
        raise BlockloopError(f"{path} holds an invalid random number generator state ({exc}); "
                             f"{_corrupt(path)}") from exc
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])


def load_checkpoint_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise missing_file(path)
    try:
        data = read_config_dict(path)
    except BlockloopError as exc:  # config.py knows no runs: the way out of a damaged checkpoint is said here
        raise BlockloopError(f"{exc}: {_fallback(directory)}") from None
    try:
        return config_from_dict(data)
    except BlockloopError as exc:  # readable JSON that describes no model: name the file it came from
        raise BlockloopError(f"{path}: {exc}; the config was edited or damaged: {_fallback(directory)}") from None


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise missing_file(path) from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockloopError(f"{path} is not valid JSON ({exc}); {_corrupt(path)}") from exc


TRAIN_STATE_KEYS = ("step", "data", "train_config", "run")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` with a step, in order. A line cut short (a kill or a full disk
    mid-append) is not a record: it is skipped, as every reader of the log must, rather than break the read."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").split("\n"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _is_count(value: Any, least: int = 0) -> bool:
    """Whether a JSON value is an integer of at least ``least`` (JSON's true and false are not integers)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# What inference and ``--init-from`` read from a checkpoint's train_state.json without rebuilding the run from it:
# the run's names (data, tokenizer, task) and the training window; a conversion writes only part of them.
_SAVED_NAMES = {"run": ("preset", "data", "tokenizer", "task", "task_dir"), "train_config": ("objective",)}


def read_saved_state(directory: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json (``{}`` where there is none, as in an import), checked to hold the names
    and window that ``eval``, ``generate`` and ``--init-from`` take from it: an edited or damaged value is named
    here, not met later as a traceback."""
    path = Path(directory) / "train_state.json"
    state = read_json(path) if path.is_file() else {}
    if not isinstance(state, dict) or not all(isinstance(state.get(k, {}), dict) for k in _SAVED_NAMES):
        raise BlockloopError(f"{path} is not an object with run and train_config objects; {_corrupt(path)}")
    bad = [f"{part}.{key} must be a string, got {state[part][key]!r}" for part, keys in _SAVED_NAMES.items()
           for key in keys if state.get(part, {}).get(key) is not None and not isinstance(state[part][key], str)]
    seq_len = state.get("train_config", {}).get("seq_len")
    if seq_len is not None and not _is_count(seq_len, least=1):
        bad.append(f"train_config.seq_len must be a positive integer, got {seq_len!r}")
    step = state.get("step")  # shown by info, recorded by eval
    if step is not None and not _is_count(step):
        bad.append(f"step must be a non-negative integer, got {step!r}")
    if state.get("converted_from") is not None and not isinstance(state["converted_from"], str):
        bad.append(f"converted_from must be a string, got {state['converted_from']!r}")
    if bad:
        raise BlockloopError(f"{path}: {bad[0]}; {_corrupt(path)}")
    return state


def read_train_state(directory: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json, checked to hold what ``--resume`` reads."""
    path = Path(directory) / "train_state.json"
    state = read_json(path)
    if not isinstance(state, dict):
        raise BlockloopError(f"{path} holds a JSON {type(state).__name__}, not an object; {_corrupt(path)}")
    missing = [key for key in TRAIN_STATE_KEYS if key not in state]
    if missing:
        raise BlockloopError(f"{path} lacks {', '.join(missing)}; the checkpoint is incomplete or was not written by "
                             "`blockloop train`: resume from an earlier one, or start a new run from it with --init-from")
    if not _is_count(state["step"]):
        raise BlockloopError(f"{path}: step must be a non-negative integer, got {state['step']!r}; {_corrupt(path)}")
    for key in ("data", "train_config", "run"):
        if not isinstance(state[key], dict):
            raise BlockloopError(f"{path}: {key} must be a JSON object, got {state[key]!r}; {_corrupt(path)}")
    # The data position: epoch and index (and, for recurrent models, the stream layout), all counts.
    data = state["data"]
    bad = [key for key in ("epoch", "index") if key not in data] + [
        key for key, value in data.items()
        if not _is_count(value) or value >= 2**62]  # + a seed: int64
    if bad:
        raise BlockloopError(f"{path}: data must hold the non-negative integers epoch and index, got {data!r}; "
                             f"{_corrupt(path)}")
    if "tokens" in state and not _is_count(state["tokens"]):
        raise BlockloopError(f"{path}: tokens must be a non-negative integer, got {state['tokens']!r}; "
                             f"{_corrupt(path)}")
    if not _is_count(state.get("world_size", 1), least=1):
        raise BlockloopError(f"{path}: world_size must be a positive integer, got {state['world_size']!r}; "
                             f"{_corrupt(path)}")
    if "tokens" not in state and not all(_is_count(n, least=1) for n in _batch_shape(state)):
        raise BlockloopError(f"{path}: the saved batch shape {_batch_shape(state)} is not positive integers; "
                             f"{_corrupt(path)}")
    return state


def tokens_trained(state: dict[str, Any]) -> int:
    """The tokens a run has trained on, from a checkpoint's train state (:func:`read_train_state`): saved since
    runs could change their batch shape on resume; for an older checkpoint, its steps times its own step size."""
    return state["tokens"] if "tokens" in state else state["step"] * math.prod(_batch_shape(state))


def _batch_shape(state: dict[str, Any]) -> list[Any]:
    """Batch size, accumulation, window and world size of a train state, as saved (1 where not saved)."""
    config = state["train_config"]
    return [config.get(key, 1) for key in ("batch_size", "grad_accum", "seq_len")] + [state.get("world_size", 1)]


def write_json_atomic(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise missing_file(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BlockloopError(f"{path} is corrupt ({exc}); {_fallback(path.parent)}") from exc


def _corrupt(path: Path) -> str:
    return f"the checkpoint is corrupt: {_fallback(path.parent)}"


def missing_file(path: Path) -> BlockloopError:
    """The error for a file a checkpoint lacks (a copy or a disk that lost it), with the way out."""
    return BlockloopError(f"{path} is missing; the checkpoint is incomplete: {_fallback(path.parent)}")


def _fallback(step_dir: Path) -> str:
    """What to do about a damaged checkpoint: point its run's ``latest`` at the newest other complete one (a
    checkpoint folder itself is refused as ``--out`` or ``--resume``), or retrain."""
    root = step_dir.parent
    if root.name != checkpoint_root(Path()).name:
        return "restore the file from a copy, use another checkpoint, or retrain"
    earlier = [p for p in _complete_steps(root.parent) if p.name != step_dir.name]
    if not earlier:
        return "the run has no other checkpoint: restore the file from a copy, or retrain"
    return f"use another of its checkpoints: write {earlier[-1].name} into {root / LATEST}, or retrain"


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that alias an earlier parameter (e.g. a tied LM head)."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        else:
            first[id(param)] = name
    return tied
