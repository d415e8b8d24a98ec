"""Warm restarts: zeropp's graphs served from Inductor's FX graph and AOTAutograd caches.

Inductor keys a compiled graph on the graph it is handed and on the `uuid()` of each custom pass,
and on a hit the passes do not run. So the uuid covers everything else that decides what the
passes make of a graph: their code, the Config, the topology (with this rank's place in it and
its process groups' names) and the model's layers. What the passes leave outside the graph, the
communication ledger's entries, is kept in a record beside Inductor's cache, keyed by the Dynamo
graph and that uuid, and entered into the ledger again on a hit.

The record holds a random token that is part of the uuid, so an entry of Inductor's cache is only
hit by a process that holds the record written with it: a deleted record, or an entry of a remote
cache, gives a miss (the passes run and write a new record), never a ledger without the graph.
Jobs that share the cache directory compile at the same time: one may read the record while another
is still compiling under its token, and then be served graphs the record did not yet hold. So the
record is read again when the served graphs are entered in the ledger, and a save adds to the
entries already recorded instead of replacing them (every entry of one record describes the same
graph, whichever job compiled it), so no entry an Inductor cache hit may need is ever dropped.

With a dump directory the graphs bypass the caches: the per-pass dump needs every pass to run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..config import GRAPH_NEUTRAL_FIELDS
from ..reports.ledger import GraphComm
from ..runtime.job import warn_for_the_job
from ..torch_compat import DYNAMO_TO_LOCAL_CLOSURE, dtensor_cache_keys_stable, inductor_cache_dir, inductor_config

if TYPE_CHECKING:
    from .pass_manager import PassManager

@functools.cache
def pass_code_version() -> str:
    """A hash of zeropp's source (the passes, the runtime ops and kernels, the backend): any
    change to the code that rewrites or records the graphs makes new cache keys."""
    from .. import passes, runtime

    digest = hashlib.sha256()
    for folder in (Path(__file__).parent, *map(Path, passes.__path__), *map(Path, runtime.__path__)):
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def passes_key(manager: PassManager) -> str:
    """What, besides the incoming graph, decides what `manager`'s passes produce."""
    config = {k: v for k, v in manager.config.to_dict().items() if k not in GRAPH_NEUTRAL_FIELDS}
    topology = manager.topology
    groups = {role: [group.name, list(group.ranks)] if group else None
              for role, group in (("world", topology.world), ("intra_node", topology.intra_node),
                                  ("inter_node", topology.inter_node), ("secondary", topology.secondary))}
    values = {
        "code": pass_code_version(),
        "config": config,
        "topology": {"rank": topology.rank, "world_size": topology.world_size,
                     "ranks_per_node": topology.ranks_per_node, "device": topology.device.type, "groups": groups},
        # A pass given to the backend in place of zeropp's own is known by its function's name.
        "passes": [(p.name, p.stage, p.run.__module__, p.run.__qualname__) for p in manager.passes],
        "layers": list(manager.layers),
    }
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=repr).encode()).hexdigest()


def to_local_as_method(gm: fx.GraphModule) -> None:
    """Rewrites the Dynamo graph's `DTensor.to_local()` calls, where Dynamo recorded each as a call to
    a closure made while tracing (named "prim_to_local"), into the method call, so that AOTAutograd's
    cache takes the graph (it refuses closures, and every restart would trace and partition the
    whole step again) and `local_shards.local_shard_inputs` finds the reads it replaces. Only
    closures that pass no arguments are rewritten (then they are the method call exactly); torch
    versions that record the method call leave nothing to rewrite."""
    rewritten = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _argumentless_to_local(node.target):
            with gm.graph.inserting_before(node):
                method = gm.graph.call_method("to_local", tuple(node.args), dict(node.kwargs))
            method.meta = dict(node.meta)
            node.replace_all_uses_with(method)
            gm.graph.erase_node(node)
            rewritten = True
    if rewritten:
        gm.recompile()


def _argumentless_to_local(target: Any) -> bool:
    if getattr(target, "__name__", None) != DYNAMO_TO_LOCAL_CLOSURE or not getattr(target, "__closure__", None):
        return False
    captured = dict(zip(target.__code__.co_freevars, (cell.cell_contents for cell in target.__closure__)))
    return not any(captured.values())


def _graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The Dynamo graph as the caches see it: its code, its inputs' types, shapes and dtypes, and
    whether it is compiled for training. A frame traced again under `torch.no_grad()` (evaluation)
    gives the same code and inputs but compiles to a forward alone, whose record must not take the
    place of the training graphs'."""
    digest = hashlib.sha256(gm.code.encode())
    digest.update(repr(torch.is_grad_enabled()).encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            strides = tuple(x.stride()) if x.layout == torch.strided else None
            digest.update(repr((type(x).__name__, tuple(x.shape), strides, x.dtype, x.device.type,
                                x.requires_grad)).encode())
        else:
            digest.update(repr((type(x).__name__, x)).encode())
    return digest.hexdigest()


def _inductor_caches_on(overrides: Mapping[str, Any]) -> bool:
    def setting(name: str) -> Any:
        return overrides.get(name, getattr(inductor_config, name))

    return not setting("force_disable_caches") and bool(setting("fx_graph_cache") or setting("fx_graph_remote_cache"))


@dataclass
class PassCache:
    """The cache identity of one Dynamo graph's passes, and the record of what they produced."""

    uuid: str  # what zeropp's custom-pass hooks give Inductor as their uuid()
    path: Path  # the record

    @classmethod
    def open(cls, manager: PassManager, gm: fx.GraphModule, example_inputs: Sequence[Any],
             inductor_options: Mapping[str, Any]) -> PassCache | None:
        """The cache of `gm`'s compilation; None where the graphs must bypass the caches (a dump
        directory is set) or Inductor's caches are off."""
        if manager.config.dump_dir is not None or not _inductor_caches_on(inductor_options):
            return None
        warn_if_restarts_retrace(example_inputs)
        key = passes_key(manager)
        record_name = hashlib.sha256((key + _graph_key(gm, example_inputs)).encode()).hexdigest()
        path = Path(inductor_cache_dir()) / "zeropp" / f"{record_name}.json"
        record = _read_record(path)
        token = record["token"] if record else secrets.token_hex(8)
        return cls(f"zeropp-{key}-{token}", path)

    def save(self, graphs: list[GraphComm]) -> None:
        """Adds `graphs` to the record under this compilation's token, keeping the recorded graphs of
        other kinds (written atomically: ranks and jobs may share the cache directory)."""
        token = self.uuid.rsplit("-", 1)[1]
        mine = [{**g.to_dict(), "graph": g.kind} for g in graphs]
        kinds = {entry["kind"] for entry in mine}
        entries = [entry for entry in self.stored() if entry["kind"] not in kinds] + mine
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"token": token, "graphs": entries}, f)
        os.replace(f.name, self.path)

    def stored(self) -> list[dict[str, Any]]:
        """The ledger entries the record holds now, graph names without the graph id."""
        record = _read_record(self.path)
        return record["graphs"] if record else []

    def restore(self, manager: PassManager) -> None:
        """Enters the recorded graphs the passes did not produce (Inductor served them) in the ledger."""
        produced = {g.kind for g in manager.graphs}
        for entry in self.stored():
            if entry["kind"] not in produced:
                comm = GraphComm.from_dict({**entry, "graph": f"{manager.graph_id}.{entry['kind']}",
                                            "frame": manager.frame, "one_layer": manager.one_layer})
                manager.record(comm, restored=True)


def warn_if_restarts_retrace(example_inputs: Sequence[Any]) -> None:
    """Warns where a restarted job would trace and partition the whole step again: torch versions
    whose AOTAutograd cache key of a DTensor input holds its device mesh's Python hash miss that
    cache in every new process where the hash is randomized: unless PYTHONHASHSEED is fixed, and
    before Python 3.12 whatever it is (the mesh's hash covers None fields, and hash(None) was the
    object's address)."""
    if dtensor_cache_keys_stable() or not any(isinstance(x, DTensor) for x in example_inputs):
        return
    retraces = (f"torch {torch.__version__} keys AOTAutograd's cache on a per-process hash of the sharded "
                "parameters' device mesh, so a restarted job traces and partitions the whole step again "
                "(Inductor's FX graph cache still serves the compiled code)")
    if not _none_hash_stable():
        warn_for_the_job(f"{retraces}: on Python {sys.version_info.major}.{sys.version_info.minor} even with a "
                         "fixed PYTHONHASHSEED; use Python 3.12 or later with `PYTHONHASHSEED=0`, or a torch with "
                         "stable DTensor cache keys (2.13 has them)", stacklevel=2)
    elif os.environ.get("PYTHONHASHSEED", "random") == "random":
        warn_for_the_job(f"{retraces}; launch with a fixed PYTHONHASHSEED (e.g. `PYTHONHASHSEED=0 torchrun ...`) "
                         "or use a torch with stable DTensor cache keys (2.13 has them)", stacklevel=2)


def _none_hash_stable() -> bool:
    return sys.version_info >= (3, 12)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or unreadable: the passes run and write a new one
    return record if isinstance(record, dict) and {"token", "graphs"} <= record.keys() else None
