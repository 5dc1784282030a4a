"""Tiny Llamas for the Hub and LoRA tests, and a Hugging Face Hub cache built by the tests in the layout
huggingface_hub writes: content in `blobs/`, each snapshot's files linked to their blob, a branch or tag
in `refs/` naming its commit. Nothing is downloaded: the model a test saves is put where `hf download`
would have put it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

# a tiny Llama: 2 layers of width 32; its config.json, not the recipe, says so when trained from the Hub
TINY_LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TINY_CONFIG = "model.config={" + ", ".join(f"{k}: {str(v).lower()}" for k, v in TINY_LLAMA.items()) + "}"


def tiny_llama_recipe(model: str = "", rest: str = "") -> str:
    """A recipe of that Llama as YAML text: `model` adds lines to its model section, `rest` sections after it."""
    config = ", ".join(f"{k}: {str(v).lower()}" for k, v in TINY_LLAMA.items())
    return (f"model:\n  source: transformers\n  name: LlamaForCausalLM\n  config: {{{config}}}\n"
            + "".join(f"  {line}\n" for line in model.splitlines() if line)
            + "data: {source: synthetic, seq_len: 16}\n"
            + "train: {batch_size: 4, steps: 3, device: cpu, optimizer: {name: adamw, lr: 0.01}}\n" + rest)


# llama_1b.yaml trained at that size on CPU in milliseconds; model.config={} takes the architecture from the Hub
FROM_HUB = ["model.config={}", "data.seq_len=16", "train.batch_size=4", "memory.micro_batch=2", "train.steps=2",
            "precision=fp32", "train.device=cpu", "train.optimizer.lr=0.01", "output.checkpoint_every=0"]


def save_tiny_llama(directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **changes) -> Path:
    """save_pretrained output of a tiny LlamaForCausalLM with weights drawn from `seed`, saved in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    torch.manual_seed(seed)
    transformers_logging.disable_progress_bar()  # its bar on stderr would be read as the command's lines
    try:
        LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **changes})).to(dtype).save_pretrained(str(directory))
    finally:
        transformers_logging.enable_progress_bar()
    return directory


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # 40 hex digits, as a git commit


def put_in_cache(cache: Path, repo: str, files: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """`files`' contents as `repo`'s snapshot at `commit`, which each of `refs` names; the snapshot directory."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        blob = folder / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)  # no newline: as huggingface_hub writes it
    return snapshot


def offline_cache(monkeypatch, tmp_path: Path) -> Path:
    """An empty Hub cache this process uses offline, as HF_HUB_CACHE and HF_HUB_OFFLINE=1 make it (both are
    read when huggingface_hub is imported: in-process the values it read are set; children get the variables)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache
