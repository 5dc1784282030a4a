"""The published setups the step-time model is held to (bench/published.py predicts and reports them):
each source's URL, the exact row or words its figure was read from, the ckrun recipe and overrides that
express it, and why not where ckrun cannot express it faithfully (`mismatch`). Recompute overheads pair
two setups. QUICK: two toy setups through the same code, for tests."""

from __future__ import annotations

from dataclasses import dataclass

DLE_BERT = "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/LanguageModeling/BERT"
DLE_RN50 = "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5"
TITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
KORTHIKANTI = "https://arxiv.org/abs/2205.05198"
SELECTIVE = "{policy: selective, products_kept_every: 2}"  # torchtitan's 'selective op': every second mm recomputed
EVERY_2 = "{policy: every, every: 2}"
A100_80GB = 80.0  # GiB: torchtitan's A100 rows ran on 80 GB cards (81,920 MiB)
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
    memory_gib: float | None = None
    """The per-GPU memory the source reports (torchtitan's logged peak reserved, GiB); None: not given."""
    card_gib: float | None = None
    """The memory of the card the source's run trained on (GiB): a bound where no figure is given."""

    def command(self, python: str = "ckrun") -> list[str]:
        head = [python, "-m", "ckrun"] if python != "ckrun" else ["ckrun"]
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
          "llama3_8b", "a100", (f"memory.checkpointing={EVERY_2}",), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama3-8b-selective", TITAN, "| 8B | 1 | selective op | 2973 | 58.2% |", 2973, "tokens/s",
          "llama3_8b", "a100", (f"memory.checkpointing={SELECTIVE}",), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama3-70b-full", TITAN, "| 70B | 1 | full | 331 | 51.7% |", 331, "tokens/s", "llama3_70b", "a100",
          (), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama2-13b-none", TITAN, "| 13B | 2 | no | 2162 | 61.1%\t|", 2162, "tokens/s", "llama2_13b", "a100",
          ("memory.checkpointing={policy: none}",), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama2-13b-every2", TITAN, "| 13B | 2 | selective layer | 1914 | 54.1% |", 1914, "tokens/s",
          "llama2_13b", "a100", (f"memory.checkpointing={EVERY_2}",), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama2-13b-selective", TITAN, "| 13B | 2 | selective op | 1904 | 53.8% |", 1904, "tokens/s",
          "llama2_13b", "a100", (f"memory.checkpointing={SELECTIVE}",), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama2-70b-full", TITAN, "| 70B | 2 | full | 353 | 50.5% |", 353, "tokens/s", "llama2_70b", "a100",
          (), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama2-70b-selective", TITAN, "| 70B | 1[^1] | selective op | 355 | 50.8% |", 355, "tokens/s",
          "llama2_70b", "a100", ("train.batch_size=64", f"memory.checkpointing={SELECTIVE}"), 64, note=NETWORK, card_gib=A100_80GB),
    Setup("llama3-8b-h100x8", TITAN, "| FSDP | 5,762 | 82.4 |  (Table 1: Llama 3.1 8B, 8 GPUs, local batch 2, "
          "selective activation checkpointing)", 5762, "tokens/s", "llama3_8b", "bench/published/h100_96gb_500w.json",
          ("train.batch_size=16", f"memory.checkpointing={SELECTIVE}"), 8, memory_gib=82.4,
          mismatch="an H100 at 500 W whose peak the source gives only as 'between SXM and NVL'"),
    Setup("llama3-8b-h100x128", TITAN, "| FSDP | 5,605 | 67.0 |  (Table 3: Llama 3.1 8B, 128 GPUs, local batch 2, "
          "selective activation checkpointing)", 5605, "tokens/s", "llama3_8b", "bench/published/h100_96gb_500w.json",
          ("train.batch_size=256", f"memory.checkpointing={SELECTIVE}"), 128, memory_gib=67.0,
          mismatch="an H100 at 500 W whose peak the source gives only as 'between SXM and NVL'; "
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
             "| 13B | 2 | no | 2162 | 61.1% | ... | 13B | 2 | selective op | 1904 | 53.8% |"),
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
