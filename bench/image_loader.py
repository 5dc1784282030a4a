"""Images per second through ckrun's ImageFolder source, decoded in the training process or by workers.

    python bench/image_loader.py [--images 600] [--size 256] [--crop 224] [--batch 32] [--steps 12]
                                 [--workers 0 1 2] [--step-ms 0 100] [--repeat 3]

Writes `--images` random JPEGs (`--size` pixels square, 10 classes) to a temporary folder, then
for each worker count asks the source for `--steps` batches in order, as the training loop does,
after one untimed batch (worker start-up). `--step-ms` stands for the training step that runs
between batches: sleeping, as the CPU does while a GPU computes, so workers can decode the next
batches meanwhile; 0 measures decoding alone. Wall-clock time (workers are other processes), the best of
`--repeat` runs: on a machine shared with other jobs, the run they slowed least.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from PIL import Image

from ckrun.runner.builders.data import Shape
from ckrun.runner.builders.image_loader import ImageFolderSource, usable_cores
from ckrun.runner.recipe.recipe import ImageFolderData


def write_images(root: Path, count: int, size: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for index in range(count):
        folder = root / f"class{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        # smooth noise (upsampled), so the JPEGs compress like photos rather than like static
        small = torch.randint(0, 256, (size // 8, size // 8, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(small.numpy()).resize((size, size), Image.BILINEAR).save(folder / f"{index}.jpg", quality=90)


def images_per_s(root: Path, workers: int, step_ms: float, args) -> float:
    data = ImageFolderData(source="image_folder", root=str(root), image_size=args.crop, workers=workers)
    source = ImageFolderSource(data, Shape("image_classification", False, num_classes=10, image_size=args.crop),
                               args.batch, seed=0)
    try:
        source.global_batch(0)  # start-up: the workers' fork and their first batches
        started = time.perf_counter()
        for step in range(1, args.steps + 1):
            source.global_batch(step)
            time.sleep(step_ms / 1000)
        return args.steps * args.batch / (time.perf_counter() - started)
    finally:
        source.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 100.0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a DataLoader worker runs; the in-process decode is then one thread too
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        write_images(root, args.images, args.size)
        print(f"{datetime.date.today()}, {platform.machine()} ({platform.processor() or 'cpu'}), {usable_cores()} usable "
              f"cores (os.cpu_count {os.cpu_count()}), Python {platform.python_version()}, torch {torch.__version__}, "
              f"torchvision {torchvision.__version__}; {args.images} JPEGs {args.size}px -> {args.crop}px, "
              f"batch {args.batch}, {args.steps} timed batches, best of {args.repeat}; load average "
              f"{os.getloadavg()[0]:.1f}\n")
        print("| step (ms) | " + " | ".join(f"workers {w} (img/s)" for w in args.workers) + " |")
        print("|---|" + "---|" * len(args.workers))
        for step_ms in args.step_ms:
            rates = [max(images_per_s(root, workers, step_ms, args) for _ in range(args.repeat)) for workers in args.workers]
            print(f"| {step_ms:g} | " + " | ".join(f"{rate:.0f}" for rate in rates) + " |")


if __name__ == "__main__":
    main()
