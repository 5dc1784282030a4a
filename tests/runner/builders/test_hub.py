"""model.pretrained by Hub name: found in a Hub-layout cache the test builds, offline, as transformers finds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import ROOT, read_metrics
from ckrun.runner.builders.hub import hub_name
from tests.runner.builders.hub_cache import (
    FROM_HUB, TINY_CONFIG, commit_of, offline_cache, put_in_cache, save_tiny_llama,
)

LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    return offline_cache(monkeypatch, tmp_path)


def _train(ckrun, out: Path, *overrides: str):
    return ckrun(LLAMA, *FROM_HUB, f"output.dir={out}", *overrides)


def test_a_hub_name_trains_from_the_cache_offline_as_from_its_files(ckrun, hub, tmp_path):
    files = save_tiny_llama(tmp_path / "saved", seed=7)  # not the recipe's seed, whose weights are another start
    put_in_cache(hub, "tiny-org/tiny-llama", files, commit_of("one"))
    code, _, err = _train(ckrun, tmp_path / "hub", "model.pretrained=tiny-org/tiny-llama")
    assert code == 0, err
    code, _, err = _train(ckrun, tmp_path / "local", f"model.pretrained={files}")
    assert code == 0, err
    from_hub, from_files = read_metrics(tmp_path / "hub"), read_metrics(tmp_path / "local")
    assert [r["loss"] for r in from_hub] == [r["loss"] for r in from_files]
    code, _, err = _train(ckrun, tmp_path / "fresh", TINY_CONFIG)  # random weights of that shape: another loss
    assert code == 0, err
    assert read_metrics(tmp_path / "fresh")[0]["loss"] != from_hub[0]["loss"]


def test_a_bf16_checkpoint_trains_from_fp32_master_weights_as_its_estimate_says(ckrun, hub, tmp_path):
    """transformers 5 loads a checkpoint in the dtype it was saved in; ckrun's precision is autocast over
    fp32 weights, which the estimate predicts: loaded in bf16, the run would hold other bytes and train
    other arithmetic than the recipe says."""
    import torch

    from ckrun.runner.builders.model import build_model
    from ckrun.runner.recipe.recipe import ModelSpec

    files = save_tiny_llama(tmp_path / "saved", dtype=torch.bfloat16)
    put_in_cache(hub, "tiny-org/bf16", files, commit_of("bf16"))
    model = build_model(ModelSpec(source="transformers", name="LlamaForCausalLM", pretrained="tiny-org/bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    code, out, err = ckrun("estimate", LLAMA, *FROM_HUB, "model.pretrained=tiny-org/bf16", "--device", "cpu", "--json")
    assert code == 0, err
    code, _, err = _train(ckrun, tmp_path / "run", "model.pretrained=tiny-org/bf16")
    assert code == 0, err
    # the second step: the first creates the optimizer state, and the estimate is of the steps after it
    assert json.loads(out)["peak_bytes"] == read_metrics(tmp_path / "run")[1]["peak_mem_bytes"]


def test_a_model_not_in_the_cache_is_one_line_naming_the_download_and_the_cache(ckrun, hub, tmp_path):
    out = tmp_path / "run"
    code, _, err = _train(ckrun, out, "model.pretrained=tiny-org/absent")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.pretrained:" in err and "HF_HUB_OFFLINE is set" in err and f"the Hugging Face cache {hub}" in err
    assert (f"hf download tiny-org/absent --include '*.json' --include '*.safetensors' --cache-dir {hub}") in err
    assert not out.exists()  # before any training


def test_a_cached_config_without_weights_is_refused_before_training(ckrun, hub, tmp_path, capsys):
    files = save_tiny_llama(tmp_path / "saved")
    (files / "model.safetensors").unlink()
    put_in_cache(hub, "tiny-org/no-weights", files, commit_of("config only"))
    capsys.readouterr()  # what importing transformers said, before the command
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, "model.pretrained=tiny-org/no-weights")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "holds no weights" in err and "hf download tiny-org/no-weights" in err


def test_model_revision_picks_a_tag_or_a_commit_of_the_cache(ckrun, hub, tmp_path):
    repo = "tiny-org/tiny-llama"
    put_in_cache(hub, repo, save_tiny_llama(tmp_path / "a", seed=1), commit_of("a"))
    put_in_cache(hub, repo, save_tiny_llama(tmp_path / "b", seed=2), commit_of("b"), refs=("v2",))
    losses = {}
    for name, revision in [("main", None), ("tag", "v2"), ("commit", commit_of("b"))]:
        pinned = [f"model.revision={revision}"] if revision else []
        code, _, err = _train(ckrun, tmp_path / name, f"model.pretrained={repo}", *pinned)
        assert code == 0, err
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name)]
    assert losses["tag"] == losses["commit"] != losses["main"]
    code, _, err = _train(ckrun, tmp_path / "none", f"model.pretrained={repo}", "model.revision=v3")
    assert code == 2 and "at revision v3 is not in the Hugging Face cache" in err and "--revision v3" in err


def test_model_revision_needs_a_hub_model(ckrun, tmp_path):
    files = save_tiny_llama(tmp_path / "saved")
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, f"model.pretrained={files}", "model.revision=v1")
    assert code == 2 and "model.revision:" in err and "is a local directory" in err, err
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, "model.revision=v1")
    assert code == 2 and "model.revision:" in err and "set model.pretrained to a Hub name" in err, err


def test_validate_checks_the_hub_config_and_keys_its_pass_on_the_resolved_commit(ckrun, hub, tmp_path):
    """The pass kept for one commit of main is not taken for the next: main moved to a config whose position
    table is shorter than the recipe's sequence, and validate says so."""
    repo = "tiny-org/moving"
    put_in_cache(hub, repo, save_tiny_llama(tmp_path / "a"), commit_of("old"))
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, f"model.pretrained={repo}", "data.seq_len=64")
    assert code == 0, err
    kept = json.loads((Path(os.environ["XDG_CACHE_HOME"]) / "ckrun" / "model_checks.json").read_text())
    assert [entry["max_positions"] for entry in kept.values()] == [64]  # the Hub config's table, not LlamaConfig's 2048
    put_in_cache(hub, repo, save_tiny_llama(tmp_path / "b", max_position_embeddings=32), commit_of("new"))
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, f"model.pretrained={repo}", "data.seq_len=64")
    assert code == 2 and "data.seq_len: 64 tokens exceed LlamaForCausalLM's 32 positions" in err, err


def test_an_unreachable_hub_falls_back_to_the_cache_as_transformers_does(ckrun, hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    put_in_cache(hub, "tiny-org/cached", save_tiny_llama(tmp_path / "saved"), commit_of("c"))
    capsys.readouterr()
    code, _, err = _train(ckrun, tmp_path / "run", "model.pretrained=tiny-org/cached", "train.steps=1")
    assert code == 0, err
    code, _, err = ckrun("validate", LLAMA, *FROM_HUB, "model.pretrained=tiny-org/uncached")
    assert code == 2 and len(err.splitlines()) == 1 and "the Hub cannot be reached" in err, err


def _child(args: list[str], env: dict) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | env
    return subprocess.run([sys.executable, "-m", "ckrun", *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=600)


def test_hf_home_and_hf_hub_cache_choose_the_cache_in_a_fresh_process(tmp_path):
    """The variables themselves, read as huggingface_hub reads them when a ckrun process starts."""
    files = save_tiny_llama(tmp_path / "saved")
    home = tmp_path / "hf-home"
    put_in_cache(home / "hub", "tiny-org/tiny-llama", files, commit_of("one"))
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = _child([LLAMA, *FROM_HUB, "train.steps=1", f"output.dir={tmp_path / 'run'}",
                   "model.pretrained=tiny-org/tiny-llama"], env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"commit {commit_of('one')} in {home / 'hub'}" in done.stderr
    elsewhere = tmp_path / "elsewhere"
    done = _child(["validate", LLAMA, *FROM_HUB, "model.pretrained=tiny-org/tiny-llama"],
                  {**env, "HF_HUB_CACHE": str(elsewhere)})
    assert done.returncode == 2 and f"--cache-dir {elsewhere}" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("path", ["./model", "../runs/model", "/abs/model", "~/model", "runs/a/model", "a--b", "x."])
def test_a_path_is_never_taken_for_a_hub_name(path):
    assert hub_name(path) is None


_PART = st.from_regex(r"[A-Za-z0-9]{1,8}([-_.][A-Za-z0-9]{1,8}){0,2}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(_PART, st.one_of(st.none(), _PART))
def test_an_org_slash_name_that_is_no_local_path_is_a_hub_name(first, second):
    text = first if second is None else f"{first}/{second}"
    assert hub_name(text) == (None if Path(text).exists() else text)


def test_a_cache_copied_to_another_machine_trains_offline_with_or_without_its_links(ckrun, tmp_path, monkeypatch):
    """docs/weights.md's "A Hub model on a machine without network": `hf download` where there is network, then copy the model's folder into the offline
    machine's cache, with rsync -a (links kept) or a copy that follows them (plain files)."""
    import shutil

    downloaded = tmp_path / "downloaded"
    put_in_cache(downloaded, "tiny-org/tiny-llama", save_tiny_llama(tmp_path / "saved", seed=3), commit_of("one"))
    losses = []
    for name, follow in [("rsync", False), ("cp-L", True)]:
        (tmp_path / name).mkdir()
        cache = offline_cache(monkeypatch, tmp_path / name)
        shutil.copytree(downloaded / "models--tiny-org--tiny-llama", cache / "models--tiny-org--tiny-llama",
                        symlinks=not follow)
        assert ckrun("validate", LLAMA, *FROM_HUB, "model.pretrained=tiny-org/tiny-llama")[0] == 0
        code, _, err = _train(ckrun, tmp_path / f"run-{name}", "model.pretrained=tiny-org/tiny-llama")
        assert code == 0, err
        losses.append([r["loss"] for r in read_metrics(tmp_path / f"run-{name}")])
    assert losses[0] == losses[1]
