"""model.pretrained's weight files damaged in every way a download, a copy or a hostile file can leave them:
`ckrun validate` and the run each end in one line at model.pretrained naming the file and what to do
(`download it again` with the exact `hf download ... --force-download` for a Hub-layout cache), status 2,
before anything is built or written; the build that reads weights fetched after validate (online) says
the same. Generated: the file's kind (safetensors, a PyTorch .bin), where it sits (a Hub cache snapshot,
a local directory) and the damage (cut at any byte, a header length that lies, random bytes, pickled
objects, a dangling link, a FIFO or a device in its place)."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT
from ckrun.runner.builders.model import build_model
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.builders.weight_files import check_weight_files
from ckrun.runner.recipe.recipe import ModelSpec
from tests.runner.builders.hub_cache import FROM_HUB, commit_of, offline_cache, put_in_cache, save_tiny_llama

LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")
_names = itertools.count()


class _Code:  # a pickle that would call a function of its choosing when loaded
    def __init__(self, call):
        self.call = call

    def __reduce__(self):
        return self.call, ("echo loaded",)


def _truncated(data: bytes, draw) -> bytes:
    return data[: draw(st.integers(0, len(data) - 1))]


def _header_length_lies(data: bytes, draw) -> bytes:
    """The first 8 bytes (safetensors' header length; a zip's local header) replaced by different ones."""
    head = draw(st.binary(min_size=8, max_size=8).filter(lambda b: b != data[:8]))
    return head + data[8:]


def _random_bytes(data: bytes, draw) -> bytes:
    return draw(st.binary(max_size=4096))


DAMAGES = {"truncated": _truncated, "header length lies": _header_length_lies, "random bytes": _random_bytes}


@st.composite
def damaged_files(draw):
    """(the weights' kind, where they sit, a function that damages the directory)."""
    kind = draw(st.sampled_from(["safetensors", "bin"]))
    where = draw(st.sampled_from(["hub", "local"]))
    damage = draw(st.sampled_from([*DAMAGES, "pickled objects", "dangling link", "fifo", "device"]))
    if damage == "pickled objects":
        kind = "bin"
        call = draw(st.sampled_from([os.system, eval, print, shutil.rmtree]))

        def apply(path: Path) -> None:
            torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": _Code(call)}, path)
    elif damage in DAMAGES:
        def apply(path: Path) -> None:
            path.write_bytes(DAMAGES[damage](path.read_bytes(), draw))
    else:
        def apply(path: Path) -> None:
            path.unlink()
            if damage == "fifo":
                os.mkfifo(path)
            else:
                os.symlink("/dev/zero" if damage == "device" else path.with_name("gone"), path)
    return kind, where, damage, apply


def _weights_dir(base: Path, kind: str, directory: Path) -> Path:
    """A sound copy of `base` holding `kind` weights (a repo of PyTorch weights has pytorch_model.bin, which
    transformers reads where there are no safetensors)."""
    shutil.copytree(base, directory)
    if kind == "bin":
        from safetensors.torch import load_file

        torch.save(load_file(str(directory / "model.safetensors")), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    return directory


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base") / "saved")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=damaged_files())
def test_damaged_weights_are_one_line_at_model_pretrained_in_validate_the_run_and_the_build(
        case, base, ckrun, monkeypatch, tmp_path):
    kind, where, damage, apply = case
    name = f"m{next(_names)}"
    files = _weights_dir(base, kind, tmp_path / name)
    if where == "hub":  # the snapshot's link to its blob: content damage reaches the blob, the rest replaces the link
        (tmp_path / f"{name}-cache").mkdir()
        hub = offline_cache(monkeypatch, tmp_path / f"{name}-cache")
        files = put_in_cache(hub, f"org/{name}", files, commit_of(name))
        pretrained, fix = f"org/{name}", "download it again with `hf download org/"
    else:
        pretrained, fix = str(files), "save or copy the weights again"
    weights = "model.safetensors" if kind == "safetensors" else "pytorch_model.bin"
    apply(files / weights)
    out = tmp_path / f"{name}-run"
    for verb in (["validate"], []):
        code, _, err = ckrun(*verb, LLAMA, *FROM_HUB, f"model.pretrained={pretrained}", f"output.dir={out}")
        lines = [line for line in err.splitlines() if "model.pretrained:" in line]
        assert code == 2 and len(lines) == 1, (damage, err)
        assert f"{weights} " in lines[0] and fix in lines[0], (damage, lines)
    assert not out.exists()
    with pytest.raises(BuildError) as refused:  # weights fetched by the run after validate: the build reads them
        build_model(ModelSpec(source="transformers", name="LlamaForCausalLM", pretrained=pretrained))
    assert refused.value.key == "model.pretrained" and fix in refused.value.message


def test_a_sound_directory_passes_and_a_trainers_training_args_are_no_weights(base, tmp_path):
    """A Trainer's output holds training_args.bin, a pickled TrainingArguments: no weight file, never read."""
    directory = shutil.copytree(base, tmp_path / "trainer-output")
    torch.save({"args": _Code(print)}, directory / "training_args.bin")
    check_weight_files(directory, transformers=True)


def test_a_shard_the_index_names_but_the_directory_lacks_is_one_line(base, tmp_path):
    import json

    directory = shutil.copytree(base, tmp_path / "sharded")
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors is missing; save or copy"):
        check_weight_files(directory, transformers=True)


@pytest.mark.parametrize("source, name", [("torchvision", "resnet18"), ("python", "my_models:net")])
def test_a_state_dict_that_is_cut_short_is_one_line_for_every_model_source(tmp_path, source, name):
    from ckrun.runner.builders.pretrained import check_pretrained_dir, read_state

    directory = tmp_path / "weights"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"\x00" * 4)
    said = r"model.safetensors is not a whole safetensors file \(header too small\).*save or copy the weights again"
    with pytest.raises(ValueError, match=said):
        check_pretrained_dir(directory, source, name)  # validate
    with pytest.raises(ValueError, match=said):
        read_state(directory)  # the build
