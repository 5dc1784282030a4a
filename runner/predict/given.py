"""The estimate of a model someone already built, with an example batch of theirs: the Python API's way in.

`GivenModelEstimator` is the recipe's `Estimator` (the same fake step, plan application, tracker and
allocator model) with two things taken from the caller instead of built from a recipe: the model,
copied onto fake tensors (its weights are not copied: the copy allocates nothing, and the caller's
model is left as it was), and the batch. The recipe it still takes holds the training settings
(batch size, optimizer, precision, clipping) in ckrun's own schema.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..builders.contract import logits_from
from ..builders.data import Batch
from ..plan.memory_plan import MemoryPlan
from .estimate import Estimator, unavailable_on_fake_errors

LABELS = "labels"  # the key of the labels in a batch given as a dict, as transformers' Trainer names them


class BatchError(TypeError):
    """An example batch ckrun cannot read: the message says what it takes."""


def example_batch(batch) -> tuple[dict[str, torch.Tensor], bool, torch.Tensor | None]:
    """(the model's inputs, whether they go by keyword, the labels or None) from what a training loop feeds:
    a tensor, a dict of tensors (`labels` among them, as for transformers), or a pair (inputs, labels)."""
    labels = None
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2 or not isinstance(batch[1], torch.Tensor):
            raise BatchError(f"a batch given as a {type(batch).__name__} is (inputs, labels), two items with "
                             f"tensor labels; got {len(batch)} items")
        batch, labels = batch
    if isinstance(batch, torch.Tensor):
        return {"input": batch}, False, labels
    if isinstance(batch, dict) and batch and all(isinstance(k, str) for k in batch):
        bad = [k for k, v in batch.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise BatchError(f"batch[{bad[0]!r}] is a {type(batch[bad[0]]).__name__}; every value of a batch "
                             "dict is a tensor")
        inputs = {k: v for k, v in batch.items() if k != LABELS}
        return inputs, True, batch.get(LABELS, labels)
    raise BatchError(f"the batch is a {type(batch).__name__}; give a tensor, a dict of tensors (labels under "
                     "'labels') or a pair (inputs, labels)")


def batch_size(batch) -> int:
    inputs, _, _ = example_batch(batch)
    sizes = {t.shape[0] for t in inputs.values() if t.dim() > 0}
    if len(sizes) != 1:
        raise BatchError(f"the batch's tensors disagree on the batch size (first dimensions {sorted(sizes)})")
    return sizes.pop()


class GivenModelEstimator(Estimator):
    """`Estimator` of `model` (not built from the recipe) on `batch` (not the recipe's data)."""

    def __init__(self, model: nn.Module, batch, recipe, device: str = "cpu", facts=None):
        self.given, self.given_batch = model, example_batch(batch)
        super().__init__(recipe, device, facts)

    def _build_model(self) -> nn.Module:
        """A copy whose parameters and buffers are fake CPU tensors of the same shapes (called inside the
        fake mode): the module tree is deep-copied with each of them already in deepcopy's memo, so no
        weight is copied or allocated, and tied weights stay tied."""
        memo: dict[int, torch.Tensor] = {}
        for module in self.given.modules():
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if id(tensor) not in memo:
                    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
                    memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else fake
        with unset_fake_temporarily():  # the rest of the tree as deepcopy copies it, outside the fake mode
            return copy.deepcopy(self.given, memo)

    def _stand_in_batch(self) -> Batch:
        inputs, by_keyword, labels = self.given_batch
        inputs = {k: v.detach().to("cpu") for k, v in inputs.items()}
        if labels is None:  # zeros of the logits' shape less the classes: the values do not change memory
            labels = torch.zeros(self._logits_shape(inputs, by_keyword)[:-1], dtype=torch.long)
        return Batch(inputs, labels.detach().to("cpu"), by_keyword)

    def _logits_shape(self, inputs: dict[str, torch.Tensor], by_keyword: bool) -> torch.Size:
        with unavailable_on_fake_errors("the example batch's forward"), self.fake_mode, torch.no_grad(), self._device_behaviour(MemoryPlan()):
            fake = {k: self.fake_mode.from_tensor(v) for k, v in inputs.items()}
            output = self.model(**fake) if by_keyword else self.model(*fake.values())
            return logits_from(output, self.model).shape

