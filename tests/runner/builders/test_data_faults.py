"""Data that cannot be trained on: one line at the recipe's data key, exit 2, never a traceback.
Broken image files are generated (every truncation, random bytes), not picked by hand."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from conftest import BERT_TINY, ROOT
from ckrun.runner.builders.data import Shape
from ckrun.runner.builders.image_loader import ImageFolderSource
from ckrun.runner.builders.model import BuildError
from ckrun.runner.recipe.recipe import ImageFolderData

TEXT_RECIPE = Path(BERT_TINY).read_text()
SMALL = ["data.seq_len=32", "train.batch_size=4", "train.steps=2", "train.device=cpu", "model.config.hidden_size=32",
         "model.config.intermediate_size=64", "model.config.max_position_embeddings=32"]
CNN_RECIPE = (ROOT / "recipes" / "classic_cifar_cnn.yaml").read_text()
CNN_DATA = CNN_RECIPE[CNN_RECIPE.index("data:\n"):CNN_RECIPE.index("train:\n")]
CNN_SMALL = ["model.config.width=4", "train.batch_size=4", "train.steps=2", "train.device=cpu"]


def text_recipe(tmp_path: Path, data_lines: str) -> Path:
    recipe = tmp_path / "recipe.yaml"
    data = "data:\n  source: synthetic           # random tokens, 15% masked; the same for the same seed\n"
    assert data in TEXT_RECIPE
    recipe.write_text(TEXT_RECIPE.replace(data, f"data:\n{data_lines}"))  # data keys start at line 22
    return recipe


def image_recipe(tmp_path: Path, root: Path) -> Path:
    recipe = tmp_path / "cnn.yaml"
    without_eval = CNN_RECIPE.split("\neval:\n")[0] + "\n"  # its eval reads synthetic data's held-out stream
    recipe.write_text(without_eval.replace(CNN_DATA, f"data:\n  source: image_folder\n  root: {root}\n  image_size: 32\n\n"))
    return recipe


def line_of(recipe: Path, text: str) -> int:
    return next(i for i, line in enumerate(recipe.read_text().splitlines(), 1) if text in line)


def png(size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def image_root(tmp_path: Path, classes: dict[str, dict[str, bytes]]) -> Path:
    root = tmp_path / "images"
    root.mkdir()
    for name, files in classes.items():
        (root / name).mkdir()
        for filename, content in files.items():
            (root / name / filename).write_bytes(content)
    return root


def assert_one_line_at(err: str, recipe: Path, line: int, key: str, fragment: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{recipe}:{line}:3: {key}: ") and fragment in lines[0], lines[0]


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank lines"])
def test_a_text_file_with_no_text(tmp_path, ckrun, content):
    (tmp_path / "corpus.txt").write_text(content)
    recipe = text_recipe(tmp_path, f"  source: text\n  paths: [{tmp_path / 'corpus.txt'}]\n")
    code, _, err = ckrun(recipe, *SMALL, f"output.dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_line_at(err, recipe, 23, "data.paths", "the text files hold no text")


def test_text_files_that_match_nothing_or_are_too_short(tmp_path, ckrun):
    recipe = text_recipe(tmp_path, f"  source: text\n  paths: ['{tmp_path}/*.md']\n")
    code, _, err = ckrun(recipe, *SMALL, f"output.dir={tmp_path / 'a'}")
    assert code == 2
    assert_one_line_at(err, recipe, 23, "data.paths", "no files match")
    (tmp_path / "short.md").write_text("a few words")
    code, _, err = ckrun(recipe, *SMALL, f"output.dir={tmp_path / 'b'}")
    assert code == 2
    assert_one_line_at(err, recipe, 23, "data.paths", "fewer than one sample of 32")


@pytest.mark.parametrize("files, fragment", [({}, "is empty"), ({"notes.txt": "hello"}, "holds no tokenizer transformers can load")],
                         ids=["empty", "no tokenizer files"])
def test_a_tokenizer_directory_without_a_tokenizer(tmp_path, ckrun, files, fragment):
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    (tmp_path / "tok").mkdir()
    for name, text in files.items():
        (tmp_path / "tok" / name).write_text(text)
    recipe = text_recipe(tmp_path, f"  source: text\n  paths: [{tmp_path / 'corpus.txt'}]\n  tokenizer: {tmp_path / 'tok'}\n")
    code, _, err = ckrun(recipe, *SMALL, f"output.dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_line_at(err, recipe, 24, "data.tokenizer", fragment)


@pytest.mark.parametrize("classes, fragment", [
    ({}, "has no class folders"),
    ({"cat": {}, "dog": {"a.png": png()}}, "class folder(s) cat hold no images"),
    ({"cat": {"notes.txt": b"not an image"}}, "class folder(s) cat hold no images (.jpg"),
], ids=["no class folders", "a class without images", "only other files"])
def test_an_image_folder_without_images(tmp_path, ckrun, classes, fragment):
    recipe = image_recipe(tmp_path, image_root(tmp_path, classes))
    code, _, err = ckrun(recipe, *CNN_SMALL, f"output.dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_line_at(err, recipe, line_of(recipe, "  root: "), "data.root", fragment)


@pytest.mark.parametrize("workers", [0, 2], ids=["in process", "in workers"])
def test_a_corrupt_image_is_named_when_it_is_read(tmp_path, ckrun, workers):
    root = image_root(tmp_path, {"cat": {"a.png": png(), "b.png": b"\x89PNG\r\n\x1a\n broken"}, "dog": {"c.png": png()}})
    recipe = image_recipe(tmp_path, root)
    code, _, err = ckrun(recipe, *CNN_SMALL, f"data.workers={workers}", f"output.dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_line_at(err, recipe, line_of(recipe, "  root: "), "data.root",
                       f"cannot read image {root}/cat/b.png: not an image PIL can read")
    assert not active_children()  # the workers were shut down, not left to the garbage collector


def active_children() -> list[int]:
    """This process's live child processes (Linux: /proc; elsewhere the check is skipped)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return []
    pids = [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
    return [pid for pid in pids if _state(pid) not in ("Z", None)]


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None  # gone meanwhile


def good_image(kind: str) -> bytes:
    out = io.BytesIO()
    pattern = bytes((i * 37 + i // 16 * 11) % 256 for i in range(16 * 16 * 3))  # fixed: the same file every call
    Image.frombytes("RGB", (16, 16), pattern).save(out, format=kind)
    return out.getvalue()


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["PNG", "JPEG", "BMP"]), data=st.data())
def test_any_broken_image_file_loads_or_is_named(tmp_path_factory, kind, data):
    raw = good_image(kind)
    broken = data.draw(st.one_of(st.integers(0, len(raw) - 1).map(lambda cut: raw[:cut]), st.binary(max_size=64)))
    root = image_root(tmp_path_factory.mktemp("img"), {"cat": {f"x.{kind.lower()}": broken}})
    source = ImageFolderSource(ImageFolderData(source="image_folder", root=str(root), image_size=8, workers=0),
                               Shape("image_classification", False, num_classes=2, image_size=8), 1, 0)
    try:
        batch = source.global_batch(0)
    except BuildError as err:
        assert err.key == "data.root" and str(err).startswith(f"cannot read image {root}/cat/x.{kind.lower()}: ")
        assert "\n" not in str(err)
    else:
        assert batch.inputs["images"].shape == (1, 3, 8, 8)  # PIL could read what was left
