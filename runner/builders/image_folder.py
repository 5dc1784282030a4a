"""`data.source: image_folder`: torchvision's ImageFolder, walking each class folder without loops.

torchvision walks class folders with `os.walk(followlinks=True)`: a directory symlink back up the
tree (`cat/loop -> ..`) is followed until the path is too long, so 12 images became ~490 samples,
and the dog images reached through `cat/loop/dog/` were labelled cat. Here a class folder's files
are its own: a directory (through a symlink or not) is read once, and a directory symlink inside a
class folder that leads out of it (to the root, another class, anywhere else) is skipped and named
in one warning line. The class folders themselves may be symlinks to anywhere.
"""

from __future__ import annotations

import logging
import os

from torchvision import datasets

log = logging.getLogger(__name__)


class ContainedImageFolder(datasets.ImageFolder):
    """ImageFolder whose samples come from `class_files`."""

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        if is_valid_file is None:
            is_valid_file = lambda path: datasets.folder.has_file_allowed_extension(path, extensions)  # noqa: E731
        samples, skipped, empty = [], [], []
        for name in sorted(class_to_idx):
            found = [(path, class_to_idx[name]) for path in class_files(os.path.join(directory, name), skipped)
                     if is_valid_file(path)]
            samples += found
            if not found:
                empty.append(name)
        if skipped:
            log.warning("data.root: skipped %d directory symlink(s) that loop or lead out of their class folder "
                        "(their images would be read again or get that class's label): %s", len(skipped),
                        ", ".join(os.path.relpath(path, directory) for path in skipped[:5]))
        if empty and not allow_empty:  # torchvision's words, which describe_image_error reads
            raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. "
                                    f"Supported extensions are: {', '.join(extensions or ())}")
        return samples


def class_files(class_dir: str, skipped: list[str]) -> list[str]:
    """The files under `class_dir`, sorted; each directory read once; `skipped` gets the directory
    symlinks that lead back to a directory already read or out of `class_dir`."""
    top = os.path.realpath(class_dir)
    read: set[str] = set()
    files = []
    for folder, subfolders, names in os.walk(class_dir, followlinks=True):
        real = os.path.realpath(folder)
        read.add(real)
        kept = []
        for sub in sorted(subfolders):
            path = os.path.join(folder, sub)
            target = os.path.realpath(path)
            inside = target == top or target.startswith(top + os.sep)
            if target in read or (os.path.islink(path) and not inside) or target == top:
                skipped.append(path)
                continue
            read.add(target)
            kept.append(sub)
        subfolders[:] = kept  # os.walk descends only into these
        files += [os.path.join(folder, name) for name in sorted(names)]
    return files
