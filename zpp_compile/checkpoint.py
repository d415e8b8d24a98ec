"""`save_checkpoint` / `load_checkpoint`: torch.distributed.checkpoint (DCP) with a checksum per
saved tensor, and a load that never leaves the model or the optimizer half-overwritten.

DCP writes every rank's shards and reads them back at any world size (resharding on load), but
it loads in place: a damaged file found midway leaves part of the model overwritten, and damaged
bytes inside a tensor load without an error. Here `save_checkpoint` writes a DCP checkpoint and,
beside it, `zeropp_checksums.json`: for every saved tensor, a checksum over the tensor as a
whole, computed from each rank's shard at its place in the tensor and summed, so it is verified
at any world size; for every other saved value, a hash. `load_checkpoint` reads the checkpoint
into fresh buffers, verifies every checksum, agrees with every rank that all of them succeeded
(a collective over the model's process group, which has `Config.collective_timeout_s`), and
only then copies into the optimizer and the model. The price is room for a second copy of this
rank's model and optimizer shards while loading.

The checksums live in a file of their own rather than in DCP's metadata: rank 0 writes it after
DCP's save has finished, so a save interrupted midway leaves no checksum file and is refused;
it can be checked before DCP reads anything; and it needs no custom DCP planner or storage
writer, so the checkpoint stays one that torch's own `dcp.load` reads.

[Note: buffers in checkpoints] Buffers are each rank's own: `shard` gives every rank rank 0's (of
a model built on a device), and a forward that updates them (BatchNorm's running statistics, in
training mode) updates each rank's copy from its own batch, as under FSDP2, or DDP without buffer
broadcasts. A checkpoint holds rank 0's copy (DCP keeps one copy of a tensor every rank saves, here
the lowest rank's, so that what is stored is what rank 0 checksummed), and a load gives every rank
that copy, each rank verifying its own against the checksum.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from .runtime.agreement import RankMismatchError, check_same_call
from .runtime.registry import REGISTRY
from .runtime.topology import Topology
from .sharding.initialization import listing, shard_rows

CHECKSUM_FILE = "zeropp_checksums.json"
_FORMAT = "zeropp-checksums-1"
_PRIME = 2**31 - 1  # checksums are sums mod this prime, of 16-bit words times weights below it
_WORDS_PER_STEP = 1 << 22  # words hashed at once, so the int64 temporaries stay small


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message names the file or tensor and what
    to do. A failed load leaves the model and the optimizer as they were."""


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Saves the sharded model and its optimizer's state to the directory `path` (a collective).

    Every rank writes its own shards (torch.distributed.checkpoint) into a directory beside `path`;
    rank 0 then writes the checksums and puts the new checkpoint in the place of `path`, so that a
    save that stops anywhere leaves the checkpoint `path` held before, or the new one, never
    neither (`_put_in_place`). Buffers are rank 0's (see [Note: buffers in checkpoints]). The
    checkpoint loads at any world size with `load_checkpoint`, or with
    `torch.distributed.checkpoint` directly ({"model": ..., "optim": ...} as `get_state_dict`
    returns them). Pass `optimizer=None` to save the model alone.
    """
    group, topology = _process_group(model, "save_checkpoint")
    path = Path(path)
    _every_rank_calls(topology, "save_checkpoint", path)
    state = _state_dicts(model, optimizer)
    entries = _flatten(state)
    partial = {name: _checksum_part(value) for name, value in entries.items() if isinstance(value, DTensor)}
    staging = _beside(path, "saving")
    prepared = _prepare_staging(path, staging) if dist.get_rank(group) == 0 else None
    _agree(group, "save_checkpoint", prepared, f"Nothing was saved; {path} is as it was")
    try:
        dcp.save(state, checkpoint_id=staging, process_group=group,
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
        raise CheckpointError(f"zpp.save_checkpoint: writing {path} failed: {_summary(error)}; {path} is as it was "
                              "before this save") from error
    everyone = _all_gather(group, partial, f"zpp.save_checkpoint: saving {path}",
                           f"{path} is as it was before this save")
    problem = None
    if dist.get_rank(group) == 0:
        problem = _write_checksums(staging, entries, everyone) or _put_in_place(staging, path)
    _agree(group, "save_checkpoint", problem, f"{path} holds the new checkpoint or the one before, whichever is "
           "complete (load_checkpoint finds it)")


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Loads a checkpoint written by `save_checkpoint` into the sharded model and its optimizer
    (a collective), at any world size.

    Everything is read and verified before anything is copied: a missing, truncated or damaged
    file, or a checksum that does not match, raises `CheckpointError` on every rank and leaves the
    model and the optimizer exactly as they were. Pass `optimizer=None` to load the model alone.
    """
    group, topology = _process_group(model, "load_checkpoint")
    path = _complete_one(Path(path))
    _every_rank_calls(topology, "load_checkpoint", path)
    had_state = optimizer is not None and bool(optimizer.state)
    try:
        problem, saved = _read_checksums(path, optimizer)
        template = _state_dicts(model, optimizer)
        _agree(group, "load_checkpoint", problem or _entries_differ(path, saved, template),
               "The model and optimizer are unchanged")
        fresh = _fresh(template, saved)
        problem, unreadable = None, []
        try:
            dcp.load(fresh, checkpoint_id=path, process_group=group)
        except (Exception, CheckpointException) as error:  # CheckpointException derives from BaseException
            problem = f"torch.distributed.checkpoint could not read {path} ({_summary(error)})"
            unreadable = _unreadable_records(path, dist.get_rank(group), dist.get_world_size(group))
        entries = _flatten(fresh)
        local = [] if problem else _verify_local(entries, saved)
        partial = {} if problem else {n: _checksum_part(v) for n, v in entries.items() if isinstance(v, DTensor)}
        everyone = _all_gather(group, (problem, unreadable, local, partial), "zpp.load_checkpoint: the ranks could "
                               "not agree on the load", "Nothing was copied into the model or the optimizer")
        _raise_on_problems(path, everyone, saved)
    except BaseException:
        if optimizer is not None and not had_state:
            optimizer.state.clear()  # made by torch's get_state_dict, which steps once with zero gradients
        raise
    if optimizer is not None:  # first: it validates its param groups before it changes anything
        set_optimizer_state_dict(model, optimizer, fresh["optim"])
    set_model_state_dict(model, fresh["model"])


def _process_group(model: nn.Module, caller: str) -> tuple[dist.ProcessGroup, Topology]:
    """The model's process group (its `Config.collective_timeout_s` bounds every collective of a
    save or a load) and topology."""
    state = REGISTRY.state_of(model) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"zpp.{caller} needs a model sharded by zpp_compile.shard (or a module holding one), got "
                         f"{type(model).__name__}; for an unsharded model use torch.save / torch.load")
    return state.topology.mesh.get_group(), state.topology


def _every_rank_calls(topology: Topology, caller: str, path: Path) -> None:
    """Raises within `Config.collective_timeout_s` unless every rank is calling `caller` now: a
    peer that hangs or died before the call, or calls something else, is named instead of
    holding this rank in the first collective of DCP's."""
    try:
        check_same_call(topology, f"zpp.{caller}")
    except RankMismatchError as error:
        raise CheckpointError(f"zpp.{caller}({str(path)!r}) did not start: {error}") from error


def _beside(path: Path, role: str) -> Path:
    """The directory beside `path` that a save writes into (`role` "saving") or keeps the checkpoint
    it replaces in until the new one is in place ("previous")."""
    path = Path(os.path.abspath(path))
    return path.with_name(f".{path.name}.zeropp-{role}")


def _prepare_staging(path: Path, staging: Path) -> str | None:
    """Rank 0, before a save: refuses a `path` holding anything but a checkpoint (which the save
    replaces whole), and clears what an interrupted save left beside it."""
    if path.exists():
        others = [] if path.is_dir() else [path.name]
        others += [] if not path.is_dir() else sorted(entry.name for entry in path.iterdir() if not _is_dcp_file(entry))
        if others:
            return (f"{path} exists and holds files that are not a checkpoint's ({listing(others)}); a save replaces "
                    "the whole directory: save to a new or empty directory, or move those files")
    shutil.rmtree(staging, ignore_errors=True)
    if (path / ".metadata").is_file():  # else what a stopped save moved aside may be the last complete one
        shutil.rmtree(_beside(path, "previous"), ignore_errors=True)
    return None


def _is_dcp_file(entry: Path) -> bool:
    name = entry.name
    return entry.is_file() and (name.startswith(".metadata") or ".distcp" in name or CHECKSUM_FILE in name)


def _put_in_place(staging: Path, path: Path) -> str | None:
    """Rank 0: the complete checkpoint in `staging` becomes `path`; what `path` held is kept beside
    it until then, so that at every moment one complete checkpoint can be found from `path`
    (`_complete_one`). Returns what went wrong, if anything."""
    previous = _beside(path, "previous")
    try:
        if path.exists():
            shutil.rmtree(previous, ignore_errors=True)
            _move(path, previous)
        _move(staging, path)
        shutil.rmtree(previous, ignore_errors=True)
    except OSError as error:
        return (f"putting the new checkpoint in place failed ({error}); it is complete in {staging}, and the one "
                f"{path} held before is {path if path.exists() else previous}")
    return None


def _move(source: Path, target: Path) -> None:
    os.replace(source, target)


def _complete_one(path: Path) -> Path:
    """`path`, or, where a save was stopped between moving the checkpoint `path` held aside and
    putting the new one in its place, that previous checkpoint (the last save that finished)."""
    previous = _beside(path, "previous")
    if not path.exists() and (previous / ".metadata").is_file() and (previous / CHECKSUM_FILE).is_file():
        warnings.warn(f"zpp.load_checkpoint: {path} is missing: a save into it stopped while putting the new "
                      f"checkpoint in place. Loading the checkpoint it held before, kept at {previous}", stacklevel=3)
        return previous
    return path


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _map_leaves(state: Any, fn: Callable[[str, Any], Any], prefix: str = "") -> Any:
    """`state` rebuilt with `fn(name, value)` applied to every leaf, named as DCP names them: keys
    joined by dots, a list holding tensors by index, a list holding none as one value."""
    if isinstance(state, Mapping):
        return {key: _map_leaves(value, fn, f"{prefix}{key}.") for key, value in state.items()}
    if isinstance(state, (list, tuple)) and _holds_tensor(state):
        return type(state)(_map_leaves(value, fn, f"{prefix}{i}.") for i, value in enumerate(state))
    return fn(prefix[:-1], state)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(_holds_tensor(item) for item in items)


def _flatten(state: Any) -> dict[str, Any]:
    leaves: dict[str, Any] = {}
    _map_leaves(state, lambda name, value: leaves.setdefault(name, value))
    return leaves


def _fresh(state: Any, saved: dict[str, dict]) -> Any:
    """`state` with every tensor replaced by an uninitialized one of the dtype it was saved in
    (DTensors keep their sharding): DCP reads into these, never into the model's or the
    optimizer's own tensors. The saved dtype, so that checksums are over the saved bytes; the
    copy into the model casts."""
    def fresh(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        dtype = saved.get(name, {}).get("dtype", str(value.dtype))
        return torch.empty_like(value, dtype=getattr(torch, dtype.removeprefix("torch.")))
    return _map_leaves(state, fresh)


def _words(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's bytes as unsigned words of 8 or 16 bits (flat, in element order), and words per
    element. A word never spans two elements, so a shard boundary never splits one."""
    itemsize = tensor.element_size()
    word = torch.uint8 if itemsize == 1 else torch.int16
    return tensor.detach().contiguous().reshape(-1).view(word), max(1, itemsize // 2)


def _checksum(tensor: torch.Tensor, first_element: int = 0) -> tuple[int, int]:
    """Two position-weighted sums of the tensor's words, mod the prime P: word k of the whole
    tensor weighs (k mod (P-1)) + 1 in one sum and the square of that in the other. The sums over
    a shard, given where it starts in the whole tensor, add up (mod P) to those of the whole, at
    any world size. A word is smaller than P and no weight is a multiple of it, so one changed
    word always changes both sums; other damage matches both with a chance of about 1 in P**2."""
    words, per_element = _words(tensor)
    mask = (1 << (8 * words.element_size())) - 1
    first = first_element * per_element
    linear = squared = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _WORDS_PER_STEP):
        chunk = words[start:start + _WORDS_PER_STEP].to(torch.int64) & mask
        weight = torch.arange(first + start, first + start + chunk.numel(), device=words.device) % (_PRIME - 1) + 1
        linear = (linear + (chunk * weight % _PRIME).sum()) % _PRIME
        squared = (squared + (chunk * (weight * weight % _PRIME) % _PRIME).sum()) % _PRIME
    return int(linear), int(squared)


def _checksum_part(tensor: DTensor) -> tuple[int, int]:
    """This rank's part of the checksum of a dim-0 sharded tensor, or of a replicated 0-d one
    (rank 0's copy counts once)."""
    if tuple(tensor.placements) == (Replicate(),) and tensor.dim() == 0:
        return _checksum(tensor.to_local()) if tensor.device_mesh.get_local_rank() == 0 else (0, 0)
    if tuple(tensor.placements) != (Shard(0),):
        raise CheckpointError(
            f"zpp checkpoints hold zeropp's dim-0 sharded tensors; got placements {tensor.placements}"
        )
    start, _ = shard_rows(tensor)
    return _checksum(tensor.to_local(), start * math.prod(tensor.shape[1:]))


def _combined(partials: list[dict[str, tuple[int, int]]], name: str) -> list[int]:
    """The checksum of tensor `name` as a whole, from every rank's part of it."""
    return [sum(part[name][i] for part in partials) % _PRIME for i in range(2)]


def _object_hash(value: Any) -> str:
    """A hash of a saved value that is not a tensor (e.g. the optimizer's hyperparameters), over its
    pickled form, which DCP stores and which survives a round trip unchanged."""
    return hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()


def _write_checksums(path: Path, entries: dict[str, Any], partials: list[dict[str, tuple[int, int]]]) -> str | None:
    """Rank 0: writes the checksum file (atomically); returns what went wrong, if anything."""
    checksums: dict[str, dict] = {}
    for name, value in entries.items():
        if isinstance(value, DTensor):
            sums = _combined(partials, name)
        elif isinstance(value, torch.Tensor):
            sums = list(_checksum(value))
        else:
            checksums[name] = {"object_sha256": _object_hash(value)}
            continue
        checksums[name] = {"dtype": str(value.dtype), "shape": list(value.shape), "checksum": sums}
    try:
        staged = path / f".{CHECKSUM_FILE}.tmp"
        staged.write_text(json.dumps({"format": _FORMAT, "entries": checksums}, indent=1))
        staged.replace(path / CHECKSUM_FILE)
    except OSError as error:
        return f"writing {path / CHECKSUM_FILE} failed ({error}); the checkpoint cannot be verified: save it again"
    return None


def _read_checksums(path: Path, optimizer: torch.optim.Optimizer | None) -> tuple[str | None, dict[str, dict]]:
    """The saved checksums, after checking that every file DCP will read exists and is complete;
    or what is wrong (the same on every rank when they see the same files)."""
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        return f"{path} is not a checkpoint (it has no .metadata file); check the path", {}
    checksum_file = path / CHECKSUM_FILE
    try:
        document = json.loads(checksum_file.read_text())
        if document.get("format") != _FORMAT:
            raise ValueError(f"unknown format {document.get('format')!r}")
        saved = document["entries"]
    except FileNotFoundError:
        return (f"{path} has no {CHECKSUM_FILE}: it was not written by zpp.save_checkpoint, or that save did not "
                "finish. Load an earlier checkpoint (or, if you trust it, load it with "
                "torch.distributed.checkpoint)"), {}
    except (OSError, ValueError, KeyError) as error:
        return f"{checksum_file} is damaged ({error}); load an earlier checkpoint", {}
    if optimizer is not None and not any(name.startswith("optim.") for name in saved):
        return f"{path} holds no optimizer state (it was saved with optimizer=None); pass optimizer=None", {}
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:
        return f"{metadata_file} is damaged ({type(error).__name__}: {error}); load an earlier checkpoint", {}
    return _check_file_sizes(path, metadata.storage_data), saved


def _check_file_sizes(path: Path, storage: Mapping[Any, Any]) -> str | None:
    """Every data file the metadata names exists and reaches the last byte it places there."""
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            return f"{file} is missing; copy the whole checkpoint directory, or load an earlier checkpoint"
        if file.stat().st_size < size:
            return (f"{file} is truncated ({file.stat().st_size} bytes; the checkpoint's metadata places data up to "
                    f"byte {size}): the save or a copy of it did not finish. Copy it again or load an earlier "
                    "checkpoint")
    return None


def _entries_differ(path: Path, saved: dict[str, dict], template: dict[str, Any]) -> str | None:
    """What the checkpoint and this model and optimizer do not both hold (DCP itself ignores
    what the checkpoint holds beyond what is asked for)."""
    entries = _flatten(template)
    sections = {name.split(".")[0] for name in entries}
    extra = sorted(name for name in saved if name.split(".")[0] in sections and name not in entries)
    missing = sorted(set(entries) - set(saved))
    reshaped = [f"{name} {tuple(saved[name]['shape'])} in the checkpoint, {tuple(value.shape)} here"
                for name, value in entries.items()
                if isinstance(value, torch.Tensor) and name in saved and "shape" in saved[name]
                and tuple(saved[name]["shape"]) != tuple(value.shape)]
    if not extra and not missing and not reshaped:
        return None
    found = [f"missing from the checkpoint: {listing(missing)}"] if missing else []
    found += [f"in the checkpoint but not in this model or optimizer: {listing(extra)}"] if extra else []
    found += [f"of other shapes: {listing(reshaped, 4)}"] if reshaped else []
    return (f"{path} does not fit this model and optimizer ({'; '.join(found)}). Load a checkpoint of the same "
            "architecture and optimizer; an optimizer that has no state yet while the parameters have gradients "
            "shows no state to load into: call optimizer.zero_grad(set_to_none=True) first")


def _verify_local(entries: dict[str, Any], saved: dict[str, dict]) -> list[str]:
    """Names of the loaded replicated tensors and other values that do not match their checksum
    (every rank holds them whole)."""
    damaged = []
    for name, value in entries.items():
        if name not in saved or isinstance(value, DTensor):
            continue
        if isinstance(value, torch.Tensor):
            if list(_checksum(value)) != saved[name].get("checksum"):
                damaged.append(name)
        elif _object_hash(value) != saved[name].get("object_sha256"):
            damaged.append(name)
    return damaged


def _all_gather(group: dist.ProcessGroup, value: Any, doing: str, outcome: str) -> list[Any]:
    """Every rank's `value`; a peer that died or hangs makes this raise within the group's timeout,
    saying what this rank was `doing` and the `outcome` for the user."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(everyone, value, group=group)
    except Exception as error:
        raise CheckpointError(f"{doing} ({error}); a peer died or hung past Config.collective_timeout_s. "
                              f"{outcome}") from error
    return everyone


def _agree(group: dist.ProcessGroup, caller: str, problem: str | None, outcome: str) -> None:
    """Raises on every rank if any rank found a problem; `outcome` says what that leaves (and what
    a peer lost meanwhile leaves)."""
    problems = {p for p in _all_gather(group, problem, f"zpp.{caller}: the ranks could not agree", outcome) if p}
    if problems:
        raise CheckpointError(f"zpp.{caller}: {'; '.join(sorted(problems))}. {outcome}")


def _raise_on_problems(path: Path, everyone: list[tuple], saved: dict[str, dict]) -> None:
    """Raises on every rank (each sees every rank's results) if any rank failed to read, or if a
    checksum does not match: of a tensor as a whole, from its parts on every rank, or of a value
    some rank holds whole."""
    failures = sorted({problem for problem, _, _, _ in everyone if problem})
    if failures:
        unreadable = sorted({record for _, records, _, _ in everyone for record in records})
        where = f": these cannot be read, the files are damaged: {listing(unreadable)}" if unreadable else ""
        raise CheckpointError(f"zpp.load_checkpoint: {'; '.join(failures)}{where}. Load an earlier checkpoint. "
                              "The model and optimizer are unchanged")
    damaged = {name for _, _, local, _ in everyone for name in local}
    partials = [partial for _, _, _, partial in everyone]
    for name in partials[0]:
        if name in saved and _combined(partials, name) != saved[name]["checksum"]:
            damaged.add(name)
    if damaged:
        files = _files_holding(path, damaged)
        raise CheckpointError(
            f"zpp.load_checkpoint: {path} is damaged: the values read for {listing(sorted(damaged))} do not match the "
            f"checksums saved with them (stored in {', '.join(files)}). Load an earlier checkpoint. The model and "
            "optimizer are unchanged"
        )


def _unreadable_records(path: Path, rank: int, world_size: int) -> list[str]:
    """After DCP failed to read: which stored records (this rank checks every world_size-th)
    cannot be deserialized, as "name in file"."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    records = sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset))
    failed = []
    for index, info in records[rank::world_size]:
        if info.transform_descriptors:
            continue  # stored through a transform (e.g. compressed): not readable as is
        is_tensor = not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        try:
            with open(path / info.relative_path, "rb") as file:
                file.seek(info.offset)
                torch.load(io.BytesIO(file.read(info.length)), map_location="cpu", weights_only=is_tensor)
        except Exception:
            failed.append(f"{index.fqn} in {path / info.relative_path}")
    return failed


def _files_holding(path: Path, names: set[str]) -> list[str]:
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    return sorted({str(path / info.relative_path) for index, info in storage.items() if index.fqn in names})


def _summary(error: BaseException) -> str:
    """A DCP error in one line per failing rank (its own text is every rank's whole traceback)."""
    if isinstance(error, CheckpointException):
        failures = sorted(error.failures.items())
        return "; ".join(f"rank {rank}: {_first_line(failure)}" for rank, (failure, _) in failures)
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    """The error's type and first sentence (torch.load's failures go on with advice that does not
    apply to a damaged file)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0] if text else ''}"
