"""ImageFolder batches decoded ahead of the training step by DataLoader worker processes.

A batch is still the pure function of (seed, step) that `epoch_rows` gives: the DataLoader's
batch sampler yields the rows of steps start, start+1, ... in order, each worker decodes whole
batches, and the loader hands them back in sampler order. So a run resumed at step N, or one with
another micro-batch, sees exactly the batches a run with workers=0 sees. Asked for a step out of
order (a resume in the same process, an evaluation going back to its first batch), the loader
shuts its workers down and starts again at that step.

A file a worker cannot decode comes back as data (`Unreadable`), not as an exception: torch
re-raises a worker's exception in the main process as a RuntimeError holding the worker's
traceback, and a broken file is one line on `data.root`. Workers ignore SIGINT and SIGTERM: a
Ctrl-C reaches the whole process group, and the training process, not its workers, decides when
to stop (after the current step) and then shuts them down. A worker whose training process died
notices (torch checks its parent) and exits.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..problems import first_line
from ..recipe.recipe import ImageFolderData
from .data import Batch, BatchSource, Shape, epoch_rows
from .resolve import BuildError

log = logging.getLogger(__name__)

MOST_WORKERS = 8  # beyond this, decoding rarely gets faster and each worker holds its prefetched batches


def choose_workers(wanted: int | None, key: str = "data") -> int:
    """`wanted`, or the automatic choice for this machine; either is logged with its reason."""
    if wanted is not None:
        log.info("%s: %d image decoding worker(s), as %s.workers says", key, wanted, key)
        return wanted
    cores = usable_cores()
    workers = 0 if cores <= 2 else min(MOST_WORKERS, cores - 1)
    if workers:
        log.info("%s: %d image decoding workers (%d CPU cores: one left for the training process, at most %d; "
                 "set %s.workers to choose)", key, workers, cores, MOST_WORKERS, key)
    else:
        log.info("%s: images decoded in the training process (%d CPU core(s): a worker would compete with the "
                 "training step for them; set %s.workers to use workers anyway)", key, cores, key)
    return workers


def usable_cores() -> int:
    counter = getattr(os, "process_cpu_count", None)  # Python 3.13+: honours the affinity mask
    if counter is not None:
        return counter() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Unreadable:
    """A file a worker could not decode, sent back in place of its batch."""

    path: str
    reason: str

    def error(self) -> BuildError:
        return BuildError("data.root", f"cannot read image {self.path}: {self.reason}; remove or replace it, "
                          "then continue with --resume")


def decode_rows(dataset, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor] | Unreadable:
    """(images, labels) of `rows`, or the first file that PIL cannot read (found when first used,
    not by reading every file up front)."""
    images, labels = [], []
    for row in rows:
        try:
            image, label = dataset[row]
        except Exception as err:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError... for broken files
            return Unreadable(str(dataset.samples[row][0]), describe_image_error(err))
        images.append(image)
        labels.append(label)
    return torch.stack(images), torch.tensor(labels)


class StepRows(Sampler):
    """The rows of steps start, start+1, ... for a DataLoader's sampler (one list per batch), without end:
    the loader is shut down when the run no longer asks."""

    def __init__(self, count: int, batch_size: int, seed: int, start: int):
        self.count, self.batch_size, self.seed, self.start = count, batch_size, seed, start

    def __iter__(self):
        step = self.start
        while True:
            yield epoch_rows(self.count, step, self.batch_size, self.seed)
            step += 1


class _Batches(Dataset):
    """dataset[rows] is the decoded batch of those rows: a worker decodes whole batches."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, rows: list[int]):
        return decode_rows(self.dataset, rows)


def _ignore_stop_signals(_worker_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _as_is(batch):
    return batch


class StepLoader:
    """Batches by step, decoded ahead by `workers` processes; asked out of order, it starts again there."""

    def __init__(self, dataset, batch_size: int, seed: int, workers: int, prefetch: int, pin_memory: bool):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.workers, self.prefetch, self.pin_memory = workers, prefetch, pin_memory
        self._batches, self._next = None, 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None or step != self._next:
            if self._batches is not None:
                log.debug("image loader: step %d asked for while step %d was next; restarting its workers there",
                          step, self._next)
            self.close()
            self._batches, self._next = iter(self._loader(step)), step
        result = next(self._batches)
        self._next += 1
        if isinstance(result, Unreadable):
            self.close()
            raise result.error()
        return result

    def _loader(self, start: int) -> DataLoader:
        return DataLoader(
            _Batches(self.dataset), batch_size=None, sampler=StepRows(len(self.dataset), self.batch_size, self.seed, start),
            num_workers=self.workers, prefetch_factor=self.prefetch if self.workers else None,  # torch refuses it without workers
            pin_memory=self.pin_memory, collate_fn=_as_is, worker_init_fn=_ignore_stop_signals,
            # its own generator: the loader draws worker seeds from it, and drawing them from torch's
            # global one would move the dropout stream, so workers would change the losses
            generator=torch.Generator().manual_seed(self.seed),
        )

    def close(self) -> None:
        """Shut the workers down now (not whenever the garbage collector gets to the iterator)."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)  # private, so looked up, not assumed
        if shutdown is not None:
            shutdown()


class ImageFolderSource(BatchSource):
    """Images decoded and transformed by DataLoader workers (below), or in this
    process with workers 0; the same batches either way."""

    @classmethod
    def build(cls, data, shape, batch_size, seed, *, label_ids=None, pin_memory=False) -> ImageFolderSource:
        return cls(data, shape, batch_size, seed, pin_memory)  # pinned batches copy to the GPU while it computes

    def __init__(self, data: ImageFolderData, shape: Shape, batch_size: int, seed: int, pin_memory: bool = False):
        from torchvision import transforms

        transform = transforms.Compose([
            transforms.Resize(data.image_size), transforms.CenterCrop(data.image_size), transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])
        self.dataset = _image_folder(data.root, transform)
        self.shape, self.batch_size, self.seed = shape, batch_size, seed
        workers = choose_workers(data.workers)
        self.loader = StepLoader(self.dataset, batch_size, seed, workers, data.prefetch, pin_memory) if workers else None

    @property
    def rows(self) -> int:
        return len(self.dataset)

    def global_batch(self, step: int) -> Batch:
        if self.loader is not None:
            images, labels = self.loader.batch(step)
        else:
            images, labels = self._decode(epoch_rows(len(self.dataset), step, self.batch_size, self.seed))
        key = "pixel_values" if self.shape.by_keyword else "images"
        return Batch({key: images}, labels, self.shape.by_keyword)

    def _decode(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        decoded = decode_rows(self.dataset, rows)
        if isinstance(decoded, Unreadable):
            raise decoded.error()
        return decoded

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()


def _image_folder(root: str, transform):
    """torchvision's ImageFolder, with its errors (no class folder, a class folder without images)
    turned into one line on data.root."""
    from .image_folder import ContainedImageFolder

    directory = Path(root).expanduser()
    if not directory.is_dir():
        raise BuildError("data.root", f"no local directory {root!r}; give a folder with one sub-folder per class")
    classes = sorted(entry for entry in directory.iterdir() if entry.is_dir())
    if not classes:
        raise BuildError("data.root", f"{root} has no class folders; put each class's images in a sub-folder of it")
    try:
        dataset = ContainedImageFolder(str(directory), transform=transform)  # no symlink loops, no other class's images
    except (FileNotFoundError, OSError) as err:
        raise BuildError("data.root", f"{root}: {describe_image_error(err)}") from None
    if len(dataset) == 0:
        raise BuildError("data.root", f"{root} holds no images")
    return dataset


def describe_image_error(err: Exception) -> str:
    if isinstance(err, FileNotFoundError) and "no valid file for the classes" in str(err):
        classes = str(err).split("classes ", 1)[1].split(". Supported", 1)[0]
        return f"class folder(s) {classes} hold no images (.jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp)"
    if "cannot identify image file" in str(err):
        return "not an image PIL can read (corrupt, cut short, or another format)"
    return first_line(getattr(err, "strerror", None) or err, 200)
