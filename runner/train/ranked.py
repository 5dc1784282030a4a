"""The loop's few places that differ per rank: the batch share, who writes, how state is saved.

Every rank runs the same loop; collectives keep them in step. Only rank 0 writes metrics.jsonl and
the recipe's other sinks (runner/train/output/sinks.py), the resolved recipe and the exported model. Decisions that end or skip a step
(a stop request, a non-finite loss, the memory cap) are taken on reduced values, so all ranks take
them together and none waits forever in a collective the others left.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..builders.data import Batch
from ..parallel.ranks import Ranks
from .run.guard import StopRequest
from .checkpoint.sharded import save_sharded
from .step import label_count


def rank_share(batch: Batch, ranks: Ranks) -> tuple[Batch, torch.Tensor | None]:
    """This rank's slice of the global batch (one per data-parallel group: the ranks of a tensor group
    train on the same one), and the denominator that makes its loss its group's part of the global
    mean: labels of the whole batch / data-parallel groups (gradients are then averaged over them)."""
    if not ranks.joined:
        return batch, None
    start, stop = ranks.share(len(batch.labels))
    return batch.slice(start, stop), label_count(batch.labels) / ranks.data_size


def stop_agreed(stop: StopRequest, ranks: Ranks) -> bool:
    """Whether any rank was asked to stop; torchrun signals ranks one by one, so they must agree on
    the step to stop after, or one would wait in the next step's collectives for ever."""
    if not ranks.joined:
        return stop.requested
    signal = torch.tensor([stop.signum or 0], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        signal = signal.cuda()
    torch.distributed.all_reduce(signal, op=torch.distributed.ReduceOp.MAX)
    if signal.item() and not stop.requested:
        stop.signum = int(signal.item())
    return stop.requested


def save_state(trainer, root: Path, save_checkpoint, wait: bool = False) -> Path:
    """A checkpoint of the trainer: sharded (DCP, collective; `wait`: complete on return, not written
    behind the next steps) when ranks are joined, else state.pt."""
    keep = trainer.recipe.output.keep_checkpoints
    if trainer.ranks.joined:
        return save_sharded(trainer, root, keep, wait)
    return save_checkpoint(root, trainer.step, trainer.state(), keep)


@contextlib.contextmanager
def process_group_scope():
    """Leave the process group when the run ends, so torchrun sees a clean exit. After a normal end the
    ranks first meet: one still exporting while another tears down gloo's connections aborts the
    other (std::terminate, SIGABRT). After an error there is no meeting: a peer may be gone."""
    joined = lambda: torch.distributed.is_available() and torch.distributed.is_initialized()  # noqa: E731
    try:
        yield
    except BaseException:
        if joined():
            torch.distributed.destroy_process_group()
        raise
    if joined():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def full_weights(trainer) -> dict | None:
    """FSDP, HSDP, TP: the whole model's state dict gathered on rank 0 (on the CPU; collective, every rank
    calls it; the others get {}). None when the model is not split: its own state_dict is whole."""
    if not trainer.ranks.joined or not trainer.recipe.distributed.shards:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return tie_like(trainer.model, weights)


def tie_like(model: torch.nn.Module, weights: dict) -> dict:
    """`weights` with the names of one shared parameter (tied embeddings and head) holding one tensor
    again: gathering copies each name to the CPU on its own, and the export, which keeps a tensor
    once per storage as save_pretrained and safetensors' save_model do, stored both."""
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(parameter), name)
        if owner != name and owner in weights and name in weights:
            weights[name] = weights[owner]
    return weights
