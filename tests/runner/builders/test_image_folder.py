"""An image folder's class holds its own images: directory symlinks that loop or lead out of the class
folder are not followed (12 images had become ~490 samples, dog images labelled cat)."""

from __future__ import annotations

import logging
import os

import pytest
from PIL import Image

from ckrun.runner.builders.image_folder import ContainedImageFolder


def _tree(root, layout: dict[str, int]) -> None:
    for folder, count in layout.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", (4, 4)).save(root / folder / f"{i}.png")


@pytest.mark.parametrize("links, expected_skipped", [
    ({"cat/loop": ".."}, 1),  # back up to the class folder's parent: the root, dog included
    ({"cat/self": "."}, 1),  # a loop on itself
    ({"cat/deep/up": "../.."}, 1),  # to an ancestor from deeper down
    ({"cat/dogs": "../dog"}, 1),  # another class's images
    ({"cat/again": "sub"}, 1),  # a folder of the class read twice
])
def test_symlinks_that_loop_or_leave_the_class_are_not_followed(tmp_path, caplog, links, expected_skipped):
    _tree(tmp_path, {"cat": 3, "cat/sub": 2, "cat/deep": 1, "dog": 4})
    for link, target in links.items():
        os.symlink(target, tmp_path / link)
    with caplog.at_level(logging.WARNING):
        dataset = ContainedImageFolder(str(tmp_path))
    labels = [dataset.classes[label] for _, label in dataset.samples]
    assert labels.count("cat") == 6 and labels.count("dog") == 4  # each image once, with its own class
    assert f"skipped {expected_skipped} directory symlink(s)" in caplog.text


def test_a_class_folder_may_itself_be_a_symlink_and_hold_symlinks_inside_it(tmp_path):
    _tree(tmp_path / "store", {"cats": 2, "cats/more": 1})
    (tmp_path / "root").mkdir()
    _tree(tmp_path / "root", {"dog": 1})
    os.symlink(tmp_path / "store" / "cats", tmp_path / "root" / "cat")  # a class kept elsewhere
    os.symlink("more", tmp_path / "store" / "cats" / "extra_view")  # inside the class, but read once
    dataset = ContainedImageFolder(str(tmp_path / "root"))
    assert sorted(dataset.classes[label] for _, label in dataset.samples) == ["cat"] * 3 + ["dog"]
