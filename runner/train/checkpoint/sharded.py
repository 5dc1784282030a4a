"""Checkpoints of a distributed run, with torch.distributed.checkpoint (DCP): complete or invisible.

Every rank writes its own shards of the model and optimizer (DCP plans who writes what; replicated
DDP tensors are written once) into ROOT/.tmp-step-NNNNNNNN-dcp, plus its RNG state; rank 0 adds
trainer.json (step, scheduler, loss scaler, the recipe's fingerprint: plain JSON, no pickle). Then
all ranks meet at a barrier, and only after it does rank 0 write the COMPLETE marker (every file's
size) and rename the directory to step-NNNNNNNN. A kill of any rank at any moment before the
rename leaves a temporary directory that resume never looks at; a file cut short after it is
caught by the sizes in the marker.

The shards are written asynchronously (DCP's async_save, where torch has it): the step pays for
copying the state to host memory, training goes on, and the barrier and marker come once every
rank's writer is done (polled after each step, or at the next save, or at the run's end, whose
own save is written before the export). Until then the checkpoint is as invisible as one killed.

Loading goes through `get_state_dict`/`set_state_dict` and `dcp.load`, which reshard: a checkpoint
written by 2 ranks loads on 1 (no process group: DCP reads every shard) or on 4, and a single
process's state.pt loads into FSDP's shards (`load_full_into_shards`). DCP's .metadata
is a pickle that torch reads with pickle.load: resume only checkpoints you wrote.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ...disk.checkpoint_files import MARKER, CheckpointError
from ...parallel.ranks import Ranks, any_rank, barrier
from ...disk.files import save_torch
from ..output.numbers import plain_record
from .fingerprint import fingerprint
from .store import (fsync_path, checkpoint_dir, clear_final, complete_checkpoints, prune, restore_rng_state,
                         rng_state)

log = logging.getLogger(__name__)

METADATA = ".metadata"  # DCP's own index: its presence marks a sharded checkpoint
TRAINER_FILE = "trainer.json"
_SIZE = re.compile(r"^size (\d+) (\S+)$")


def is_sharded(checkpoint: Path) -> bool:
    return (checkpoint / METADATA).is_file()


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def save_sharded(trainer, root: Path, keep: int, wait: bool = False) -> Path:
    """Collective: every rank calls it at the same step. Returns the final directory, complete on return
    unless the save went on asynchronously (`finish_saving` completes it); `wait`: complete on return."""
    finish_saving(trainer)  # one save in flight at a time, the older one complete first
    ranks: Ranks = trainer.ranks
    final, temporary = checkpoint_dir(root, trainer.step), root / f".tmp-step-{trainer.step:08d}-dcp"
    if ranks.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    barrier(ranks)
    upload = _start_upload(trainer, temporary, wait)
    save_torch(rng_state(trainer.device), temporary / _rng_file(ranks.rank))
    fsync_path(temporary / _rng_file(ranks.rank))
    if ranks.is_main:
        _write_synced(temporary / TRAINER_FILE, json.dumps(_trainer_state(trainer)))
    flight = InFlight(upload, temporary, final, root, keep, trainer.step)
    if upload is None:
        _complete(ranks, flight)
    else:
        trainer.saving = flight
    return final


@dataclass
class InFlight:
    """A checkpoint whose shards DCP is still writing behind training: invisible until complete."""

    upload: Future | None  # None: written already
    temporary: Path
    final: Path
    root: Path
    keep: int
    step: int


def _start_upload(trainer, temporary: Path, wait: bool) -> Future | None:
    """DCP's async_save where torch has it (feature-detected) and the ranks are joined: the step pays
    only for staging (a copy of the state in host memory) and the files are written by a thread,
    over a gloo group of its own so its collectives never interleave with training's. Else (or
    `wait`) a blocking dcp.save, and None."""
    import torch.distributed.checkpoint as dcp

    async_save, tensors = getattr(dcp, "async_save", None), _tensors(trainer)
    if wait or async_save is None or not trainer.ranks.joined or not _stageable(tensors):
        dcp.save(tensors, checkpoint_id=str(temporary))
        return None
    started = async_save(tensors, checkpoint_id=str(temporary), process_group=_checkpoint_group())
    return getattr(started, "upload_completion", started)  # torch 2.15 may answer an AsyncSaveResponse


def _stageable(tensors: dict) -> bool:
    """Whether async_save can stage the state: it copies plain tensors (a DTensor's pieces) to host memory,
    but not a library's tensor subclass (torchao's quantized optimizer moments: memory.optimizer_state
    8bit, 4bit, fp8), which has no `new_empty`; such a state is written before training goes on."""
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(tensors):
        local = getattr(leaf, "_local_tensor", leaf)
        if isinstance(local, torch.Tensor) and type(local) not in (torch.Tensor, torch.nn.Parameter):
            return False
    return True


def _checkpoint_group():
    world = torch.distributed.group.WORLD
    if id(world) not in _GROUPS:  # every rank gets here at the same save: new_group is collective
        _GROUPS[id(world)] = torch.distributed.new_group(backend="gloo")
    return _GROUPS[id(world)]


_GROUPS: dict[int, object] = {}


def finish_saving(trainer, block: bool = True) -> None:
    """Complete the checkpoint in flight, if any (collective): wait for every rank's files, then mark
    it complete and rename it into place. `block=False`: only once every rank's upload is done."""
    flight: InFlight | None = trainer.saving
    if flight is None:
        return
    if not block and any_rank(not flight.upload.done(), trainer.ranks):
        return
    trainer.saving = None
    flight.upload.result()  # the writer thread's error (a full disk) is raised here
    _complete(trainer.ranks, flight)


def _complete(ranks: Ranks, flight: InFlight) -> None:
    barrier(ranks)  # every rank's shards are on disk: only now may the checkpoint look complete
    if ranks.is_main:
        _mark_complete(flight.temporary, flight.step)
        clear_final(flight.final)
        flight.temporary.rename(flight.final)
        fsync_path(flight.root)
        prune(flight.root, flight.keep)
    barrier(ranks)


def _tensors(trainer) -> dict:
    """Model and optimizer state as DCP saves and loads it: keyed by parameter name, sharded as trained."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    return {"model": model_state, "optimizer": optimizer_state}


def _options(trainer, **settings):
    """model.lora: the frozen base is neither saved nor expected back (model.pretrained rebuilds it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    adapted = trainer.recipe.model.lora is not None
    return StateDictOptions(ignore_frozen_params=adapted, strict=not adapted, **settings)


def _trainer_state(trainer) -> dict:
    """As JSON takes it: a torchao optimizer's scheduler state holds its learning rates as tensors."""
    return plain_record({"step": trainer.step, "world_size": trainer.ranks.world_size,
                         "scheduler": trainer.scheduler.state_dict(),
                         "scaler": trainer.scaler.state_dict() if trainer.scaler else {},
                         "recipe": fingerprint(trainer.recipe)})


def _write_synced(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    fsync_path(path)


def _mark_complete(directory: Path, step: int) -> None:
    files = sorted(p for p in directory.iterdir() if p.is_file())
    lines = [str(step), "format dcp", *(f"size {p.stat().st_size} {p.name}" for p in files)]
    _write_synced(directory / MARKER, "\n".join(lines) + "\n")
    fsync_path(directory)


def check_sizes(checkpoint: Path) -> None:
    """CheckpointError when a file the marker lists is missing or has another size than when saved."""
    for line in (checkpoint / MARKER).read_text(encoding="utf-8", errors="replace").splitlines():
        match = _SIZE.match(line)
        if not match:
            continue
        path = checkpoint / match.group(2)
        if not path.is_file() or path.stat().st_size != int(match.group(1)):
            raise CheckpointError(f"{checkpoint.name}: {match.group(2)} is missing or cut short (its size differs "
                                  "from the one recorded when it was saved)")


def read_trainer_state(checkpoint: Path) -> dict:
    check_sizes(checkpoint)
    try:
        state = json.loads((checkpoint / TRAINER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{checkpoint.name}: {TRAINER_FILE} cannot be read ({err})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{checkpoint.name}: {TRAINER_FILE} holds no training state")
    return state


def load_sharded(trainer, checkpoint: Path, state: dict) -> None:
    """Restore `trainer` from a sharded checkpoint (collective when the trainer's ranks are joined),
    on any world size; `state` is its trainer.json. RNG comes back only on the world size that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors = _tensors(trainer)
    with warnings.catch_warnings():  # one process reading every shard is the point here, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=not trainer.ranks.joined)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optimizer"], options=_options(trainer))
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    trainer.step = state["step"]
    rng = checkpoint / _rng_file(trainer.ranks.rank)
    if state.get("world_size") == trainer.ranks.world_size and rng.is_file():
        restore_rng_state(torch.load(rng, map_location="cpu", weights_only=True), trainer.device)
    else:
        log.info("resuming on %d rank(s) a checkpoint of %d: weights and optimizer state are resharded; each rank's "
                 "dropout keeps its own random stream", trainer.ranks.world_size, state.get("world_size", 0))


def load_full_into_shards(trainer, state: dict) -> None:
    """A single process's state.pt into FSDP's shards (collective): every rank reads the whole file and
    keeps its own shards of the weights and of the optimizer state. The file keys the optimizer's
    state by position; the current optimizer (built as the saving one was, over the same parameters
    in the same order) says which parameter each position is, so DCP gets it keyed by name."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=_optimizer_by_name(trainer, state["optimizer"]),
                   options=_options(trainer, full_state_dict=True))


def _optimizer_by_name(trainer, saved: dict) -> dict:
    names = {id(parameter): name for name, parameter in trainer.model.named_parameters()}
    groups = trainer.optimizer.param_groups
    sizes = [len(group["params"]) for group in groups]
    if [len(group["params"]) for group in saved["param_groups"]] != sizes:
        raise ValueError(f"its optimizer has parameter groups of {[len(g['params']) for g in saved['param_groups']]} "
                         f"parameters, the recipe's {sizes}")
    name_of = {index: names[id(parameter)] for group, now in zip(saved["param_groups"], groups, strict=True)
               for index, parameter in zip(group["params"], now["params"], strict=True)}
    return {"state": {name_of[index]: value for index, value in saved["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]]}


def set_aside_damaged(checkpoint: Path) -> None:
    target = checkpoint.with_name(f"damaged-{checkpoint.name}")
    try:
        shutil.rmtree(target, ignore_errors=True)
        checkpoint.rename(target)
    except OSError as err:
        log.warning("--resume: could not rename the damaged %s: %s", checkpoint.name, err.strerror or err)


def pick_sharded(root: Path, ranks: Ranks) -> tuple[Path, dict] | None:
    """The newest complete sharded checkpoint that reads, with its trainer.json; None when the newest
    loadable one is not sharded (a single-process state.pt) or there is none. Damaged ones are named
    in a warning and, once every rank has looked, moved aside by rank 0 (renamed, never deleted)."""
    chosen, damaged = None, []
    for checkpoint in reversed(complete_checkpoints(root)):
        if not is_sharded(checkpoint):
            break
        try:
            chosen = (checkpoint, read_trainer_state(checkpoint))
            break
        except CheckpointError as err:
            damaged.append((checkpoint, err))
    barrier(ranks)  # no rank renames a directory another is still reading
    for checkpoint, err in damaged:
        if ranks.is_main:
            log.warning("--resume: %s; taking an older checkpoint (the damaged one is kept as damaged-%s)", err,
                        checkpoint.name)
            set_aside_damaged(checkpoint)
    if damaged and chosen is None and not any(not is_sharded(c) for c in complete_checkpoints(root)):
        raise CheckpointError(f"no complete checkpoint in {root} can be loaded ({damaged[0][1]}); they are kept as "
                              "damaged-step-*; resume without them by choosing a new output.dir")
    return chosen
