"""The step-time model against published training measurements nobody here made.

Each setup is a published, measured training run (the source's URL, the exact words or table row it
was read from, its setup), written as a ckrun recipe as close to that setup as recipes allow
(bench/published/*.yaml, with the overrides listed here) and predicted the way anyone would:

    ckrun estimate RECIPE --gpu NAME --json [--nproc N] [overrides]

(a subprocess per setup). The prediction's throughput per GPU is compared with the published one;
pairs of setups that differ only in activation checkpointing give recompute overheads, compared with
the overheads the sources measured. A setup ckrun cannot express faithfully says why (`mismatch`)
and is left out of the headline error, not out of the table. Nothing here is fitted: the time model's
figures are its datasheet facts and the calibration table (runner/predict/calibration.json).

    python bench/published.py                    # every setup: about an hour on 2 busy cores
    python bench/published.py --only bert-p2-fp16 llama2-13b-none --no-docs
    python bench/published.py --quick --out /tmp/p   # two toy setups through the same code (tests)
    python bench/published.py --from runs/bench_published/results.json   # the docs again, no predicting

Writes docs/benchmarks_time.md (unless --no-docs or --quick) and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages, as tests and the other benches
    sys.path.insert(0, str(ROOT))

from bench.doc_sections import write_section  # noqa: E402
from bench.stats import spearman  # noqa: E402

RECIPES = ROOT / "bench" / "published"
DLE_BERT = "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/LanguageModeling/BERT"
DLE_RN50 = "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5"
TITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
KORTHIKANTI = "https://arxiv.org/abs/2205.05198"
SELECTIVE = "{policy: selective}"
EVERY_2 = "{policy: every, every: 2}"
TITAN_OP_SAC = ("torchtitan's 'selective op' keeps the outputs of every other matrix product (and attention's); "
                "ckrun's selective keeps every product's and recomputes the attention kernel and pointwise ops")
NETWORK = "8 hosts: ckrun prices every collective at the NVLink rate; the source does not give the network"


@dataclass(frozen=True)
class Setup:
    key: str
    source: str
    quote: str
    """The row or sentence the published figure was read from, as the source has it."""
    published: float
    unit: str  # "samples/s" (per GPU) or "tokens/s" (per GPU)
    recipe: str
    gpu: str
    overrides: tuple[str, ...] = ()
    nproc: int | None = None
    mismatch: str = ""
    """Why ckrun cannot express the setup faithfully; empty: it can."""
    note: str = ""
    """A difference judged too small to matter (stated, not excluded)."""

    def command(self, python: str = "ckrun") -> list[str]:
        head = [python, "-m", "runner"] if python != "ckrun" else ["ckrun"]
        nproc = ["--nproc", str(self.nproc)] if self.nproc else []
        return [*head, "estimate", f"bench/published/{self.recipe}.yaml", "--gpu", self.gpu, "--json", *nproc,
                *self.overrides]


@dataclass(frozen=True)
class Overhead:
    """A recompute overhead: the step time of `plan` over that of `base`, less one."""
    name: str
    base: str
    plan: str
    published: float
    source: str
    quote: str
    mismatch: str = ""
    per_layer: bool = False
    """The source times a layer's forward and backward: the added time over the base step's forward and
    backward, not over its whole step (the optimizer's step and the like are no layer's)."""


DLE_RUN_SUB = "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/BERT/run.sub"
BINNED = (f"NVIDIA's loader bins sequences by length and pads each batch to its bin ({DLE_RUN_SUB}: "
          "`BIN_SIZE=${BIN_SIZE:-\"64\"}`, 'The bin size for binned LDDL data loading'), so phase 2's batches "
          "of up to 512 tokens are mostly shorter: its published rate per token is 1.45x phase 1's at four times "
          "the length, which no full-length batch does; ckrun's synthetic batches are full length")


DLE_SQUAD = "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/BERT/run_squad.py"
SQUAD_TIMING = (f"NVIDIA's fine-tuning script times its whole training loop, first steps included, and waits for the "
                f"GPU every step ({DLE_SQUAD}: `final_loss = loss.item()` in the loop, `time_to_train = time.time() - "
                "train_start`, `training_sequences_per_second: len(train_features) * args.num_train_epochs / "
                "time_to_train`), so the host's dispatch of each step adds to the GPU's; ckrun predicts a steady step "
                "(the source's own SQuAD rate per token is 1.76x slower than its pre-training's at sequence 128)")


def _bert(key, seq, batch, micro, precision, value, quote, tf32=False):
    overrides = [f"data.seq_len={seq}", f"train.batch_size={batch}", f"memory.micro_batch={micro}",
                 f"precision={precision}", *(["tf32=true"] if tf32 else [])]
    note = ("LAMB in NVIDIA's runs, AdamW here: one optimizer step per 32-256 micro-batches either way; apex O2 "
            "(fp16 weights), fused LayerNorm and bias-GeLU there, fp16 autocast of the transformers model here")
    if seq == 128:
        return Setup(key, DLE_BERT, quote, value, "samples/s", "bert_large_dle", "a100", tuple(overrides),
                     note=note + "; binned loading (bins of 64) pads most phase-1 batches to 128, as here")
    return Setup(key, DLE_BERT, quote, value, "samples/s", "bert_large_dle", "a100", tuple(overrides),
                 mismatch=BINNED, note=note)


SETUPS: tuple[Setup, ...] = (
    _bert("bert-p1-fp16", 128, 8192, 256, "fp16", 580,
          "| 1    | 128 and 256 | 8192 and 8192 | 64 and 32 | 128 | 317 | 580 | 1.83 | 1.00 | 1.00 |"),
    _bert("bert-p1-tf32", 128, 8192, 128, "fp32", 317,
          "| 1    | 128 and 256 | 8192 and 8192 | 64 and 32 | 128 | 317 | 580 | 1.83 | 1.00 | 1.00 |", tf32=True),
    _bert("bert-p2-fp16", 512, 4096, 32, "fp16", 210,
          "| 1    | 16 and 32   | 4096 and 4096 | 256 and 128 | 512 | 110 | 210 | 1.90 | 1.00 | 1.00 |"),
    _bert("bert-p2-tf32", 512, 4096, 16, "fp32", 110,
          "| 1    | 16 and 32   | 4096 and 4096 | 256 and 128 | 512 | 110 | 210 | 1.90 | 1.00 | 1.00 |", tf32=True),
    Setup("bert-squad-fp16", DLE_BERT, "| 1    | 32 and 32 | 61.5 | 110.5 | 1.79 | 1.00 | 1.00 |", 110.5,
          "samples/s", "bert_large_squad", "a100", ("precision=fp16",), mismatch=SQUAD_TIMING,
          note="a classification head in place of SQuAD's span head (both one 1024-wide projection)"),
    Setup("bert-squad-tf32", DLE_BERT, "| 1    | 32 and 32 | 61.5 | 110.5 | 1.79 | 1.00 | 1.00 |", 61.5,
          "samples/s", "bert_large_squad", "a100", ("precision=fp32", "tf32=true"), mismatch=SQUAD_TIMING,
          note="a classification head in place of SQuAD's span head (both one 1024-wide projection)"),
    Setup("resnet50-amp", DLE_RN50, "|    1     | 938 img/s  |            2470 img/s            | 2.63 x | ...",
          2470, "samples/s", "resnet50_dle", "a100", ("precision=fp16",),
          mismatch="NVIDIA's AMP run keeps activations channels-last (NHWC); ckrun's torchvision model is NCHW, "
                   "whose convolutions pay cuDNN's transposes (about 30 % of ResNet-50's step on an A100, MosaicML)"),
    Setup("resnet50-tf32", DLE_RN50, "|    1     | 938 img/s  |            2470 img/s            | 2.63 x | ...",
          938, "samples/s", "resnet50_dle", "a100", ("precision=fp32", "tf32=true")),
    Setup("llama3-8b-every2", TITAN, "| 8B | 1 | selective layer | 2904 | 56.8% |", 2904, "tokens/s",
          "llama3_8b", "a100", (f"memory.checkpointing={EVERY_2}",), 64, note=NETWORK),
    Setup("llama3-8b-selective", TITAN, "| 8B | 1 | selective op | 2973 | 58.2% |", 2973, "tokens/s",
          "llama3_8b", "a100", (f"memory.checkpointing={SELECTIVE}",), 64, mismatch=TITAN_OP_SAC),
    Setup("llama3-70b-full", TITAN, "| 70B | 1 | full | 331 | 51.7% |", 331, "tokens/s", "llama3_70b", "a100",
          (), 64, note=NETWORK),
    Setup("llama2-13b-none", TITAN, "| 13B | 2 | no | 2162 | 61.1%\t|", 2162, "tokens/s", "llama2_13b", "a100",
          ("memory.checkpointing={policy: none}",), 64, note=NETWORK),
    Setup("llama2-13b-every2", TITAN, "| 13B | 2 | selective layer | 1914 | 54.1% |", 1914, "tokens/s",
          "llama2_13b", "a100", (f"memory.checkpointing={EVERY_2}",), 64, note=NETWORK),
    Setup("llama2-13b-selective", TITAN, "| 13B | 2 | selective op | 1904 | 53.8% |", 1904, "tokens/s",
          "llama2_13b", "a100", (f"memory.checkpointing={SELECTIVE}",), 64, mismatch=TITAN_OP_SAC),
    Setup("llama2-70b-full", TITAN, "| 70B | 2 | full | 353 | 50.5% |", 353, "tokens/s", "llama2_70b", "a100",
          (), 64, note=NETWORK),
    Setup("llama2-70b-selective", TITAN, "| 70B | 1[^1] | selective op | 355 | 50.8% |", 355, "tokens/s",
          "llama2_70b", "a100", ("train.batch_size=64", f"memory.checkpointing={SELECTIVE}"), 64,
          mismatch=TITAN_OP_SAC),
    Setup("llama3-8b-h100x8", TITAN, "| FSDP | 5,762 | 82.4 |  (Table 1: Llama 3.1 8B, 8 GPUs, local batch 2, "
          "selective activation checkpointing)", 5762, "tokens/s", "llama3_8b", "bench/published/h100_96gb_500w.json",
          ("train.batch_size=16", f"memory.checkpointing={SELECTIVE}"), 8,
          mismatch=TITAN_OP_SAC + "; an H100 at 500 W whose peak the source gives only as 'between SXM and NVL'"),
    Setup("llama3-8b-h100x128", TITAN, "| FSDP | 5,605 | 67.0 |  (Table 3: Llama 3.1 8B, 128 GPUs, local batch 2, "
          "selective activation checkpointing)", 5605, "tokens/s", "llama3_8b", "bench/published/h100_96gb_500w.json",
          ("train.batch_size=256", f"memory.checkpointing={SELECTIVE}"), 128,
          mismatch=TITAN_OP_SAC + "; an H100 at 500 W whose peak the source gives only as 'between SXM and NVL'; "
                   "16 hosts over 400 Gb/s a GPU, priced at the NVLink rate"),
)
# the 22B GPT's three plans: overheads only (the paper times one tensor-parallel layer, not throughput)
RATIO_SETUPS: tuple[Setup, ...] = tuple(
    Setup(f"gpt22b-{name}", KORTHIKANTI, "Table 4", 0.0, "samples/s", "gpt_22b", "a100",
          (f"memory.checkpointing={{policy: {name}}}",)) for name in ("none", "full", "selective"))
TABLE4 = ("| Baseline no recompute | 7.7 | 11.9 | 19.6 | - | ... | Baseline with recompute | 7.7 | 19.5 | 27.2 | 39% "
          "| Selective Recompute | 7.7 | 13.2 | 20.9 | 7% |")
OVERHEADS: tuple[Overhead, ...] = (
    Overhead("full, 22B GPT layer", "gpt22b-none", "gpt22b-full", 0.39, KORTHIKANTI, TABLE4,
             "the paper's 39 % includes tensor parallelism's all-reduces, which its backward overlaps with the "
             "weight gradients ('as opposed to the expected 33%'); ckrun's one-GPU step has none", per_layer=True),
    Overhead("selective, 22B GPT layer", "gpt22b-none", "gpt22b-selective", 0.07, KORTHIKANTI, TABLE4,
             "Megatron's selective recomputes the unfused attention core (QK^T, softmax, dropout, attention over "
             "V); ckrun's recomputes the flash attention kernel and the pointwise ops", per_layer=True),
    Overhead("every 2nd layer, Llama 2 13B", "llama2-13b-none", "llama2-13b-every2", 2162 / 1914 - 1, TITAN,
             "| 13B | 2 | no | 2162 | 61.1% | ... | 13B | 2 | selective layer | 1914 | 54.1% |"),
    Overhead("selective, Llama 2 13B", "llama2-13b-none", "llama2-13b-selective", 2162 / 1904 - 1, TITAN,
             "| 13B | 2 | no | 2162 | 61.1% | ... | 13B | 2 | selective op | 1904 | 53.8% |", TITAN_OP_SAC),
)
QUICK = (  # toy sizes, the same path: kept from rotting by tests/bench
    Setup("quick-bert", DLE_BERT, "toy", 1000.0, "samples/s", "bert_large_dle", "a100",
          ("model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.num_attention_heads=2",
           "model.config.intermediate_size=128", "train.batch_size=8", "memory.micro_batch=4")),
    Setup("quick-llama", TITAN, "toy", 20000.0, "tokens/s", "llama3_8b", "a100",
          ("model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.num_attention_heads=4",
           "model.config.num_key_value_heads=2", "model.config.intermediate_size=128", "model.config.vocab_size=256",
           "data.seq_len=64", "train.batch_size=4"), 2),
)


@dataclass
class Result:
    setup: Setup
    predicted: float | None
    seconds: float | None = None
    """The predicted step time."""
    compute_s: float | None = None
    """Its forward and backward."""
    peak_gib: float | None = None
    estimate_s: float = 0.0
    error: str = ""
    breakdown: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.setup.published if self.predicted and self.setup.published else None


def predict(setup: Setup) -> Result:
    """`ckrun estimate` of the setup, as a subprocess: the command anyone re-runs."""
    started = time.perf_counter()
    done = subprocess.run(setup.command(sys.executable), cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    took = time.perf_counter() - started
    if done.returncode != 0:
        return Result(setup, None, estimate_s=took, error=(done.stderr.strip().splitlines() or ["?"])[-1])
    record = json.loads(done.stdout)
    step = record["time"]
    ranks = setup.nproc or 1
    rate = step["tokens_per_s"] if setup.unit == "tokens/s" else step["samples_per_s"]
    return Result(setup, rate / ranks, step["seconds"], step["forward_s"] + step["backward_s"],
                  record["peak_bytes"] / 2**30, took, breakdown={k: round(v / 2**30, 2) for k, v in record["breakdown"].items()})


def predict_all(setups) -> dict[str, Result]:
    results = {}
    for setup in setups:
        result = results[setup.key] = predict(setup)
        shown = f"{result.predicted:,.1f} {setup.unit}/GPU" if result.predicted else f"failed: {result.error}"
        print(f"{setup.key}: {shown} (published {setup.published:,}; {result.estimate_s:.0f} s)", flush=True)
    return results


def recorded(path: Path, setups) -> dict[str, Result]:
    """A run's predictions read back, attached to the setups as they are now (sources, notes)."""
    rows = json.loads(path.read_text(encoding="utf-8"))["results"]
    fields = ("predicted", "seconds", "compute_s", "peak_gib", "estimate_s", "error", "breakdown")
    return {setup.key: Result(setup, *(rows[setup.key].get(name) for name in fields))
            for setup in setups if setup.key in rows}


def summary(results: dict[str, Result], overheads: tuple[Overhead, ...]) -> dict:
    """The headline figures: median and worst absolute error (faithful setups), rank correlation, overheads."""
    rows = [r for r in results.values() if r.ratio is not None and r.setup.published]
    faithful = [r for r in rows if not r.setup.mismatch]
    errors = sorted(abs(r.ratio - 1) for r in faithful)
    out = {"setups": len(rows), "faithful": len(faithful),
           "median_abs_error": statistics.median(errors) if errors else None,
           "worst_abs_error": max(errors) if errors else None,
           "worst_any": max((abs(r.ratio - 1) for r in rows), default=None),
           "spearman_all": spearman([r.predicted for r in rows], [r.setup.published for r in rows])
           if len(rows) > 2 else None,
           "spearman_faithful": spearman([r.predicted for r in faithful], [r.setup.published for r in faithful])
           if len(faithful) > 2 else None, "overheads": []}
    for overhead in overheads:
        base, plan = results.get(overhead.base), results.get(overhead.plan)
        predicted = None
        if base and plan and base.seconds and plan.seconds:
            over = base.compute_s if overhead.per_layer else base.seconds
            predicted = (plan.seconds - base.seconds) / over if over else None
        out["overheads"].append({"name": overhead.name, "published": overhead.published, "predicted": predicted,
                                 "points": None if predicted is None else 100 * (predicted - overhead.published),
                                 "mismatch": overhead.mismatch})
    return out


def _pct(value: float | None, signed: bool = True) -> str:
    return "-" if value is None else (f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %")


def table(results: dict[str, Result], figures: dict, facts_lines: list[str], versions: str, took_s: float) -> str:
    lines = ["# The step-time model against published measurements", "",
             f"Generated by `bench/published.py` on {time.strftime('%Y-%m-%d')} ({versions}; {took_s / 60:.0f} min "
             "of predictions on 2 shared CPU cores, no GPU). Every prediction is `ckrun estimate RECIPE --gpu NAME "
             "--json [--nproc N] [overrides]` of a recipe in `bench/published/`; the table gives each command's "
             "parts. Throughput is per GPU. Nothing is fitted to these rows: the figures are the GPU table's "
             "datasheet facts and the calibration table's literature efficiencies "
             "(`runner/predict/calibration.json`).", "",
             "## Headline", "",
             f"- Median absolute throughput error over the {figures['faithful']} setups ckrun expresses faithfully: "
             f"**{_pct(figures['median_abs_error'], False)}** (goal: at most 15 %); worst of them "
             f"{_pct(figures['worst_abs_error'], False)}; worst of all {figures['setups']}: "
             f"{_pct(figures['worst_any'], False)}.",
             f"- Spearman rank correlation of predicted and published throughput: "
             f"{_num(figures['spearman_all'])} over all {figures['setups']}, {_num(figures['spearman_faithful'])} "
             f"over the faithful ones (goal: at least 0.9).", "",
             "## Setups", "",
             "| setup | GPU | ranks | published | predicted | error | faithful | source (row as published) |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for result in results.values():
        setup = result.setup
        if not setup.published:
            continue
        faithful = "yes" if not setup.mismatch else f"no: {setup.mismatch}"
        if setup.note:
            faithful += f" (note: {setup.note})"
        predicted = f"{result.predicted:,.1f}" if result.predicted else f"failed: {result.error}"
        error = _pct(result.ratio - 1) if result.ratio else "-"
        lines.append(f"| {setup.key} | {_gpu_name(setup.gpu)} | {setup.nproc or 1} | {setup.published:,} "
                     f"{setup.unit} | {predicted} | {error} | {faithful} | [{_host(setup.source)}]({setup.source}): "
                     f"`{setup.quote}` |")
    lines += ["", "## Recompute overheads", "",
              "| plan | published | predicted | difference | mismatch |", "|---|---:|---:|---:|---|"]
    for row in figures["overheads"]:
        points = "-" if row["points"] is None else f"{row['points']:+.1f} points"
        lines.append(f"| {row['name']} | {_pct(row['published'])} | {_pct(row['predicted'])} | {points} | "
                     f"{row['mismatch'] or '-'} |")
    lines += ["", "Sources of the overheads: " + "; ".join(sorted({f"[{_host(o.source)}]({o.source}): `{o.quote}`"
                                                                    for o in OVERHEADS})), "",
              "## Commands", "", "```"]
    lines += [shlex.join(r.setup.command()) for r in results.values()]
    lines += ["```", "", "## Devices", "", *facts_lines]
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _host(url: str) -> str:
    return {DLE_BERT: "NVIDIA DLE BERT", DLE_RN50: "NVIDIA DLE ResNet-50", TITAN: "torchtitan performance.md",
            KORTHIKANTI: "Korthikanti et al. 2022"}.get(url, url)


def _gpu_name(gpu: str) -> str:
    return Path(gpu).stem if gpu.endswith(".json") else gpu


def device_lines(setups) -> list[str]:
    from runner.predict.hardware import resolve_device

    lines = []
    for gpu in sorted({s.gpu for s in setups}):
        facts = resolve_device(str(ROOT / gpu) if gpu.endswith(".json") else gpu)
        lines.append(f"- `{gpu}`: {facts.name}, dense bf16 {facts.matmul_tflops.get('bf16')} / tf32 "
                     f"{facts.matmul_tflops.get('tf32')} / fp32 {facts.matmul_tflops.get('fp32')} TFLOP/s, "
                     f"{facts.memory_gbs:,.0f} GB/s, peer {facts.peer_gbs:.0f} GB/s, {facts.sms} SMs. {facts.source}.")
    return lines


def versions() -> str:
    import torch
    import transformers

    return (f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="setup keys to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="two toy setups, no docs (tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_published")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--from", dest="recorded", type=Path, metavar="RESULTS_JSON",
                        help="the predictions a run recorded (its results.json): tables and docs again, with the "
                             "setups' current sources and mismatch notes, without predicting")
    args = parser.parse_args(argv)
    setups = QUICK if args.quick else (*SETUPS, *RATIO_SETUPS)
    if args.only:
        setups = tuple(s for s in setups if s.key in args.only)
    results = recorded(args.recorded, setups) if args.recorded else predict_all(setups)
    figures = summary(results, () if args.quick else OVERHEADS)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "figures": figures, "results": {k: {**asdict(r), "setup": asdict(r.setup)} for k, r in results.items()}},
        indent=1), encoding="utf-8")
    text = table(results, figures, device_lines(setups), versions(), sum(r.estimate_s for r in results.values()))
    print(text)
    if not (args.no_docs or args.quick or args.only):
        write_section(ROOT / "docs" / "benchmarks_time.md", "published", text)
    return 0 if all(r.predicted for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
