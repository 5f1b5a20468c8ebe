"""Checkpoint files as the frameworks write them: read into state dicts, written back the same way.

Three formats, told apart by what the path holds, never by its name:

- `torch`: a `torch.save` of a dict holding the model's state dict (under `model`, `state_dict`
  or `model_state_dict` unless a key is named) and the optimizer's (`optimizer` or
  `optimizer_state_dict`); a bare state dict (every value a tensor) is `state_dict`, with no
  optimizer state.
- `trainer`: a transformers Trainer `checkpoint-N/` folder: `model.safetensors` or
  `pytorch_model.bin`, `optimizer.pt`, `trainer_state.json` (its `global_step`).
- `lightning`: a Lightning `.ckpt`, a `torch.save` dict with `state_dict` (keys prefixed by the
  LightningModule's attribute), `optimizer_states` (one per optimizer) and `global_step`.

torch (and safetensors, for a Trainer folder) is imported inside the functions that read and
write: the engine loads without it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TORCH, STATE_DICT, TRAINER, LIGHTNING = "torch", "state_dict", "trainer", "lightning"
FORMATS = (TORCH, STATE_DICT, TRAINER, LIGHTNING)
MODEL_KEYS = ("model", "state_dict", "model_state_dict")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict")
STEP_KEYS = ("step", "global_step")
_SAFETENSORS, _BIN, _OPTIMIZER = "model.safetensors", "pytorch_model.bin", "optimizer.pt"


class CheckpointFormatError(ValueError):
    """A checkpoint that cannot be read or written as one of the known formats."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint, read: its model and optimizer state dicts and where they came from."""

    path: Path
    format: str  # one of FORMATS
    model: dict[str, Any]  # state-dict key -> tensor, keys as stored (with any prefix)
    optimizer: dict[str, Any] | None  # `optimizer.state_dict()`; None: the checkpoint holds none
    step: int | None  # the optimizer steps it holds, where it says
    whole: Any = None  # the saved object (torch, lightning) or None (trainer: the folder is copied)
    model_key: str | None = None
    optimizer_key: str | None = None
    weights_file: str | None = None  # trainer: which file holds the weights


def _torch() -> Any:
    import torch

    return torch


def _torch_load(path: Path) -> Any:
    """`torch.load` of the user's own file, tensors only where it can (`weights_only`); a file
    with other objects (a Lightning checkpoint's hyper-parameters) is read in full."""
    import pickle

    torch = _torch()
    for weights_only in (True, False):
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        except pickle.UnpicklingError:
            continue  # objects other than tensors: read in full
        except Exception as exc:  # noqa: BLE001 - any failure to read is the same error to a user
            raise CheckpointFormatError(f"{path}: not a torch.save file, a Trainer checkpoint-N/ folder "
                                        f"or a Lightning .ckpt ({type(exc).__name__})") from None
    raise CheckpointFormatError(f"{path}: not a torch.save file, a Trainer checkpoint-N/ folder or a "
                                "Lightning .ckpt (torch.load cannot read it)")


def _tensors(d: Any) -> bool:
    torch = _torch()
    return isinstance(d, dict) and bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())


def _step(d: dict[str, Any]) -> int | None:
    for key in STEP_KEYS:
        if isinstance(d.get(key), int):
            return int(d[key])
    return None


def _pick(d: dict[str, Any], given: str | None, defaults: tuple[str, ...], flag: str, path: Path) -> str | None:
    if given is not None:
        if given not in d:
            raise CheckpointFormatError(f"{path}: no key {given!r} ({flag}); its keys are {', '.join(map(str, d))}")
        return given
    return next((k for k in defaults if k in d), None)


def load(path: str | Path, model_key: str | None = None, optimizer_key: str | None = None) -> Checkpoint:
    """Read a checkpoint of any known format; `CheckpointFormatError` for anything else."""
    path = Path(path)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or folder")
    if path.is_dir():
        return _load_trainer(path)
    whole = _torch_load(path)
    if isinstance(whole, dict) and isinstance(whole.get("state_dict"), dict) and "optimizer_states" in whole:
        states = whole["optimizer_states"]
        if len(states) > 1:
            raise CheckpointFormatError(f"{path}: a Lightning checkpoint of {len(states)} optimizers; "
                                        "the trace records one")
        return Checkpoint(path, LIGHTNING, whole["state_dict"], states[0] if states else None,
                          _step(whole), whole, "state_dict", "optimizer_states")
    if _tensors(whole):
        return Checkpoint(path, STATE_DICT, whole, None, None, whole)
    if isinstance(whole, dict):
        mk = _pick(whole, model_key, MODEL_KEYS, "--model-key", path)
        if mk is not None and _tensors(whole[mk]):
            ok = _pick(whole, optimizer_key, OPTIMIZER_KEYS, "--optimizer-key", path)
            opt = whole[ok] if ok is not None else None
            if opt is not None and not (isinstance(opt, dict) and "state" in opt and "param_groups" in opt):
                raise CheckpointFormatError(f"{path}: {ok!r} is no optimizer state dict (no 'state' and "
                                            "'param_groups'); name it with --optimizer-key")
            return Checkpoint(path, TORCH, whole[mk], opt, _step(whole), whole, mk, ok)
        keys = ", ".join(map(str, list(whole)[:8]))
        raise CheckpointFormatError(f"{path}: a dict with no model state dict under {mk or ' or '.join(MODEL_KEYS)} "
                                    f"(its keys: {keys}); name it with --model-key")
    raise CheckpointFormatError(f"{path}: a {type(whole).__name__}, not a torch.save dict of state dicts, "
                                "a Trainer checkpoint-N/ folder or a Lightning .ckpt")


def _load_trainer(path: Path) -> Checkpoint:
    if (path / f"{_SAFETENSORS}.index.json").exists() or (path / f"{_BIN}.index.json").exists():
        raise CheckpointFormatError(f"{path}: sharded weights (*.index.json) are not supported; "
                                    "save the checkpoint unsharded")
    if (path / _SAFETENSORS).exists():
        from safetensors.torch import load_file

        model, weights = load_file(path / _SAFETENSORS), _SAFETENSORS
    elif (path / _BIN).exists():
        model, weights = _torch_load(path / _BIN), _BIN
    else:
        raise CheckpointFormatError(f"{path}: a folder with no {_SAFETENSORS} or {_BIN}: not a Trainer "
                                    "checkpoint-N/ folder")
    opt = _torch_load(path / _OPTIMIZER) if (path / _OPTIMIZER).exists() else None
    state = path / "trainer_state.json"
    step = json.loads(state.read_text()).get("global_step") if state.exists() else None
    return Checkpoint(path, TRAINER, model, opt, step, None, weights_file=weights)


def save(base: Checkpoint, model: dict[str, Any], optimizer: dict[str, Any] | None, out: str | Path) -> Path:
    """Write `model` and `optimizer` to `out` in `base`'s format, with everything else `base`
    holds; written beside `out` under a temporary name and renamed, so `out` is whole or absent."""
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staged = tmp / out.name
        if base.format == TRAINER:
            _save_trainer(base, model, optimizer, staged)
        else:
            _torch().save(_whole(base, model, optimizer), staged)
        os.replace(staged, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _whole(base: Checkpoint, model: dict[str, Any], optimizer: dict[str, Any] | None) -> Any:
    if base.format == STATE_DICT:
        return model
    whole = dict(base.whole)
    whole[base.model_key] = model
    if base.format == LIGHTNING:
        whole["optimizer_states"] = [optimizer] if optimizer is not None else []
    elif base.optimizer_key is not None:
        whole[base.optimizer_key] = optimizer
    return whole


def _save_trainer(base: Checkpoint, model: dict[str, Any], optimizer: dict[str, Any] | None, out: Path) -> None:
    shutil.copytree(base.path, out)
    if base.weights_file == _SAFETENSORS:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(base.path / _SAFETENSORS, "pt") as f:
            meta = f.metadata()
        save_file({k: v.contiguous() for k, v in model.items()}, out / _SAFETENSORS, metadata=meta)
    else:
        _torch().save(model, out / _BIN)
    if optimizer is not None:
        _torch().save(optimizer, out / _OPTIMIZER)


def with_step(ckpt: Checkpoint, step: int) -> Checkpoint:
    """The same checkpoint, its step known from elsewhere (the trace, the file's name)."""
    return replace(ckpt, step=step)
