"""The baseline a user would write without ckrun: a plain Hugging Face training loop with the model's
own `gradient_checkpointing_enable()`, at the recipe's batch and precision.

    python bench/gpu/hf_loop.py RESULT.json RECIPE [KEY=VALUE ...] [--warmup 2] [--timed 3]

What HF Trainer does for the same settings, without Trainer itself: the transformers class named by
the recipe, built from its config; `gradient_checkpointing_enable()` with HF's default arguments;
`torch.optim.AdamW` (fused on CUDA, as Trainer's default `adamw_torch_fused`) with the recipe's lr and
weight decay; autocast in the recipe's precision around the forward (fp16 with a GradScaler); the
model's own loss (its MLM head over every position, as HF computes it); clip to the recipe's grad
norm. The batch: random tokens, 15% of them labelled, as ckrun's synthetic data. Each step is timed
between device synchronisations, its peak read as ckrun reads one (allocator reserve + this process's
CUDA context). Run in its own process, as a probe is: the tuner's probes and this see the same card.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckrun.runner.recipe.load import load_recipe  # noqa: E402
from ckrun.runner.memory.measure import cuda_context_bytes, note_card_before_cuda  # noqa: E402
from ckrun.runner.problems import first_line  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def build(recipe, device: torch.device):
    import transformers

    cls = getattr(transformers, recipe.model.name)
    model = cls(cls.config_class(**recipe.model.config)).to(device)
    model.gradient_checkpointing_enable()  # HF's own, with its default arguments
    model.train()
    options = recipe.train.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=getattr(options, "lr", 1e-4),
                                  weight_decay=getattr(options, "weight_decay", 0.0), fused=device.type == "cuda")
    return model, optimizer


def batch(recipe, vocab: int, device: torch.device, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    shape = (recipe.train.batch_size, recipe.data.seq_len)
    ids = torch.randint(0, vocab, shape, generator=generator)
    labelled = torch.rand(shape, generator=generator) < 0.15
    labels = torch.where(labelled, ids, torch.full_like(ids, -100))
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "labels": labels}.items()}


def step(model, optimizer, inputs: dict, recipe, scaler) -> float:
    dtype = DTYPES[recipe.precision]
    device_type = inputs["input_ids"].device.type
    with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
        loss = model(**inputs).loss
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.grad_clip or float("inf"))
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(recipe, warmup: int, timed: int) -> dict:
    note_card_before_cuda()  # the context is read as ckrun reads one: this process only
    device = torch.device("cuda", 0) if recipe.train.device != "cpu" and torch.cuda.is_available() else \
        torch.device("cpu")
    torch.manual_seed(recipe.train.seed)
    model, optimizer = build(recipe, device)
    scaler = torch.amp.GradScaler(device.type) if recipe.precision == "fp16" else None
    records = [_timed_step(model, optimizer, batch(recipe, model.config.vocab_size, device, n), recipe, scaler, device)
               for n in range(warmup + timed)]
    times = [r["step_time_s"] for r in records[warmup:]]
    found = {"status": "ok", "step_time_s": statistics.median(times), "step_times_s": times,
             "samples_per_s": recipe.train.batch_size / statistics.median(times),
             "losses": [r["loss"] for r in records], "device": str(device)}
    if device.type == "cuda":
        found.update(peak_mem_bytes=max(r["peak_mem_bytes"] for r in records),
                     cuda_context_bytes=max(r["cuda_context_bytes"] for r in records))
        found["card_peak_bytes"] = found["peak_mem_bytes"] + found["cuda_context_bytes"]
    return found


def _timed_step(model, optimizer, inputs: dict, recipe, scaler, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    loss = step(model, optimizer, inputs, recipe, scaler)  # .item() synchronises too
    if cuda:
        torch.cuda.synchronize(device)
    record = {"step_time_s": time.perf_counter() - started, "loss": loss}
    if cuda:
        record.update(peak_mem_bytes=torch.cuda.max_memory_reserved(device), cuda_context_bytes=cuda_context_bytes(device))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=3)
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    try:
        found = run(recipe, args.warmup, args.timed)
    except torch.OutOfMemoryError as err:
        found = {"status": "oom", "reason": first_line(err)}
    args.result.write_text(json.dumps(found, indent=1), encoding="utf-8")
    print(json.dumps({k: v for k, v in found.items() if k != "losses"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
