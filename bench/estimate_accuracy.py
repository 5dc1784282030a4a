"""Predicted (`ckrun estimate --device cpu`) vs measured (`ckrun RECIPE`, tracker) CPU peaks.

    python bench/estimate_accuracy.py > table.md

Four small models, four plans, two micro-batch sizes, all through the real CLI. Prints a
markdown table with the relative error of each prediction.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import platform
import tempfile
from pathlib import Path

import torch

from ckrun.runner.cli import main

RECIPE = "recipes/bert_tiny.yaml"
MODELS = {
    "bert_tiny (4 layers x 128)": ["model.config.num_hidden_layers=4", "train.batch_size=8"],
    "GPT-2 style (4 x 64)": ["model.name=GPT2LMHeadModel", "model.config={n_layer: 4, n_embd: 64, n_head: 2, "
                             "vocab_size: 512, n_positions: 64}", "data.seq_len=64", "train.batch_size=8"],
    "ResNet-18 (96 px, SGD)": ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 10}",
                               "data.image_size=96", "train.batch_size=8", "train.optimizer={name: sgd}"],
    "ViT (4 x 64, 32 px)": ["model.name=ViTForImageClassification", "model.config={image_size: 32, patch_size: 4, "
                            "num_hidden_layers: 4, num_attention_heads: 2, hidden_size: 64, intermediate_size: 128, "
                            "num_labels: 10}", "train.batch_size=8"],
}
PLANS = {"none": "{policy: none}", "full": "{policy: full}", "every 2": "{policy: every, every: 2}",
         "selective": "{policy: selective}"}


def ckrun(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(args))
    if code:
        raise SystemExit(f"ckrun {' '.join(args)} failed with {code}")
    return out.getvalue()


def compare(args: list[str], workdir: Path) -> tuple[int, int]:
    predicted = json.loads(ckrun("estimate", RECIPE, *args, "--device", "cpu", "--json"))["peak_bytes"]
    out = workdir / str(len(list(workdir.iterdir())))
    ckrun(RECIPE, *args, "train.steps=2", f"output.dir={out}")
    measured = max(json.loads(line)["peak_mem_bytes"] for line in (out / "metrics.jsonl").read_text().splitlines())
    return predicted, measured


def main_table() -> None:
    torch.set_num_threads(1)
    print(f"CPU ({platform.machine()}), torch {torch.__version__}, {datetime.date.today()}; fp32, 2 steps each\n")
    print("| model | plan | micro-batch | predicted (MB) | measured (MB) | error |")
    print("|---|---|---|---|---|---|")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, model_args in MODELS.items():
            for plan_name, plan in PLANS.items():
                for micro in (8, 4):
                    args = [*model_args, "train.device=cpu", f"memory.micro_batch={micro}", f"memory.checkpointing={plan}"]
                    predicted, measured = compare(args, Path(tmp))
                    errors.append(abs(predicted - measured) / measured)
                    print(f"| {model} | {plan_name} | {micro} | {predicted / 1e6:.2f} | {measured / 1e6:.2f} | "
                          f"{100 * (predicted - measured) / measured:+.2f}% |", flush=True)
    print(f"\nworst error {100 * max(errors):.2f}%, median {100 * sorted(errors)[len(errors) // 2]:.2f}%")


if __name__ == "__main__":
    main_table()
