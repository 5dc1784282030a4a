"""The recipe schema: model, data, training, precision, memory plan and output.

A recipe is plain data; `ckrun.runner.recipe.load` turns a YAML file into one and reports every problem
with its file, line and key. The schema needs nothing but the recipe: what only the named classes,
files and code can tell (a transformers config, a factory's arguments, a dataset's columns) is
checked right after it by runner/builders/checks.py, so `ckrun validate` still catches it before
training, and validating imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from ..plan.choices import Strict
from ..plan.memory_plan import MemoryPlan, StepFacts, plan_problems
from ..problems import KeyedError
from ..plan.strategies import (  # noqa: F401 - the strategies are part of the recipe's schema
    DataParallel, Distributed, FullySharded, HybridSharded, SingleProcess, TensorParallel,
)
from .data import SECTIONS as DATA_SECTIONS
from .data import sources_for
from .data import (  # noqa: F401 - the data sources are part of the recipe's schema
    PathText,
    Data, DatasetData, ImageFolderData, RecordsData, SyntheticData, Task, TextFilesData,
)
from .train import (  # noqa: F401 - the optimizers and schedules too
    AdamW, ConstantSchedule, CosineSchedule, Optimizer, Schedule, SGD, TorchOptimizer,
)
from .sinks import SinkEntries
from .adapters import LoraSpec
from .eval import EvalSpec


Precision = Literal["fp32", "bf16", "fp16"]


class ModelSpec(Strict):
    source: Literal["transformers", "torchvision", "python"]
    """Where the model comes from: a transformers class, a torchvision builder, or your own code."""
    name: str
    """`BertForMaskedLM` (transformers), `resnet50` (torchvision), or `package.module:factory`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the transformers config class, the torchvision builder or the factory."""
    pretrained: PathText | None = None
    """Weights to start from: a Hugging Face Hub name (`meta-llama/Llama-3.2-1B`), found in the Hub's
    cache as transformers finds it and fetched into it when missing and the Hub is reachable (HF_HOME,
    HF_HUB_CACHE and HF_HUB_OFFLINE are honoured); or a local directory: a run's OUTPUT_DIR/model or
    OUTPUT_DIR/checkpoints/step-N, save_pretrained output, or a state dict."""
    revision: str | None = None
    """The Hub revision of model.pretrained: a branch, tag or commit hash (unset: `main`). A commit
    hash pins the weights: the run then never depends on what `main` became."""
    lora: LoraSpec | None = None
    """Fine-tune with LoRA through peft: the model's weights stay frozen (no gradients, no optimizer
    state) and low-rank adapters beside its linear layers train; `{}` takes peft's defaults (rank 8 on
    the attention projections). Unset: every weight trains."""

    @model_validator(mode="after")
    def _revision_of_a_hub_model(self) -> ModelSpec:
        if self.revision is not None and self.pretrained is None:
            raise KeyedError(("model", "revision"), "model.revision is the Hub revision of model.pretrained; "
                             "set model.pretrained to a Hub name (org/name), or remove model.revision")
        return self

    @model_validator(mode="after")
    def _quantized_as_weights_load(self) -> ModelSpec:
        if self.lora is not None and self.lora.quantize_base and (self.source != "transformers" or not self.pretrained):
            raise KeyedError(("model", "lora", "quantize_base"), "QLoRA: transformers quantizes a base to 4 bits as "
                             "its weights load: give a transformers model with model.pretrained (a Hub name or directory)")
        return self


LANGUAGE_TASKS = ("masked_lm", "causal_lm", "seq2seq")  # evaluated by loss and perplexity; the rest by loss and accuracy


def infer_task(spec: ModelSpec) -> str | None:
    """The training task a model class implies, or None when the recipe must say (data.task)."""
    if spec.source == "torchvision":
        return "image_classification"
    if spec.source != "transformers":
        return None
    suffixes = {
        "ForMaskedLM": "masked_lm", "ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm",
        "ForConditionalGeneration": "seq2seq", "ForSequenceClassification": "sequence_classification",
        "ForImageClassification": "image_classification",
    }
    return next((task for suffix, task in suffixes.items() if spec.name.endswith(suffix)), None)


# --- training -------------------------------------------------------------------------------


class TrainSpec(Strict):
    batch_size: int = Field(gt=0)
    """The global batch per optimizer step; memory.micro_batch never changes it."""
    steps: int | None = Field(default=None, gt=0)
    """Optimizer steps to run; or give train.epochs instead (exactly one of the two)."""
    epochs: float | None = Field(default=None, gt=0)
    """Passes over finite data (text, records, image_folder) instead of train.steps: the run takes
    ceil(epochs * rows / batch_size) steps, computed and logged once the data is built; may be
    fractional (0.5: half the data). Synthetic data never runs out, so it has no epochs."""
    optimizer: Optimizer = Field(default_factory=lambda: AdamW(name="adamw"))
    """`adamw` (fused on CUDA), `sgd`, any torch.optim class by name with its arguments (`{name: RAdam,
    lr: 3e-4}`), or bitsandbytes' `adamw_8bit` / `paged_adamw_8bit` / `paged_adamw` when installed."""
    scheduler: Schedule = Field(default_factory=ConstantSchedule)
    """Learning-rate schedule: `constant` or `cosine` (each with optional warm-up), or transformers'
    `linear`, `polynomial`, `cosine_with_restarts` or `warmup_stable_decay`."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; null turns clipping off."""
    seed: int = Field(default=0, ge=0, lt=1 << 32)
    """Seeds weights, data and dropout: the same seed gives the same run (0 to 2**32 - 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` takes the GPU when there is one."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainSpec:
        if self.steps is not None and self.epochs is not None:
            raise KeyedError(("train", "epochs"), "give train.steps or train.epochs, not both (on the command "
                                  "line, train.steps=null train.epochs=N swaps one for the other)")
        if self.steps is None and self.epochs is None:
            raise KeyedError(("train",), "give train.steps (optimizer steps) or train.epochs (passes over the data)")
        return self


class OutputSpec(Strict):
    dir: PathText = "runs/default"
    """Where metrics.jsonl, the resolved recipe, checkpoints and the trained model (`model/`) go."""
    log_every: int = Field(default=10, gt=0)
    """Steps between log lines (every step is still written to metrics.jsonl); step 1 and the last
    step are always logged."""
    log_seconds: float = Field(default=30.0, ge=0)
    """Also log a line when this many seconds passed since the last one, so a slow run is never
    silent for long (0: only every log_every steps)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Steps between training-state checkpoints; the end of a run is always saved (0: only the end)."""
    keep_checkpoints: int = Field(default=2, gt=0)
    """How many complete checkpoints to keep; older ones are deleted."""
    tensorboard: bool = False
    """Also write every step and evaluation as TensorBoard events to OUTPUT_DIR/tensorboard
    (needs `pip install 'ckrun[tensorboard]'`); the same as listing tensorboard in output.sinks."""
    sinks: SinkEntries = Field(default_factory=list)
    """Where each step's and evaluation's record goes besides metrics.jsonl: `tensorboard`, `wandb`
    (offline) and `mlflow` (a local store), by name (`[tensorboard, wandb]`) or as a section with
    settings (`{name: wandb, project: bert}`). One that fails mid-run is one warning line; the run goes on."""

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, wanted: bool) -> bool:
        import importlib.util

        if wanted and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("the tensorboard package is not installed; pip install 'ckrun[tensorboard]', "
                             "or set output.tensorboard: false")
        return wanted


class Recipe(Strict):
    description: str = ""
    """One line on what this recipe trains, shown by `ckrun ls`."""
    family: str = ""
    """Grouping for `ckrun ls` (language, vision, classic)."""
    model: ModelSpec
    data: Data = Field(default_factory=SyntheticData)
    train: TrainSpec
    precision: Precision = "fp32"
    """`fp32`, `bf16` (autocast) or `fp16` (autocast with a GradScaler)."""
    tf32: bool | None = None
    """TF32 tensor cores for fp32 math on Ampere and newer GPUs, as HF Trainer's `tf32`. `true`: fp32
    matrix products and cuDNN convolutions run in TF32 (a 10-bit mantissa, about 8x an A100's plain fp32
    rate); `false`: both in full fp32. Unset: torch's defaults, left alone: products in full fp32 (matmul
    precision "highest" since torch 1.12) and convolutions in TF32 (cuDNN's allow_tf32 is true by
    default). Matters with precision fp32 and for the ops autocast keeps in fp32; no effect on a CPU."""
    memory: MemoryPlan = Field(default_factory=MemoryPlan)
    """The memory plan: micro-batching, checkpointing, offload, compile, cap."""
    output: OutputSpec = Field(default_factory=OutputSpec)
    eval: EvalSpec | None = None
    """Evaluate on held-out data during training; unset: no evaluation."""
    distributed: Distributed = Field(default_factory=SingleProcess)
    """How ranks share the work under torchrun (`ckrun RECIPE --nproc N`): none, ddp, fsdp, hsdp or tp.
    train.batch_size stays the global batch; each rank takes batch_size / world size of it."""

    @model_validator(mode="after")
    def _strategy_combines(self) -> Recipe:
        strategy, problems = self.distributed, []
        if self.memory.sharding is not None and not strategy.shards:
            problems.append(KeyedError(("memory", "sharding"), f"sharding knobs apply to FSDP, but distributed.strategy "
                                       f"is {strategy.strategy}; set distributed.strategy: fsdp (or hsdp, tp) or remove "
                                       "memory.sharding"))
        problems += [KeyedError(path, message) for path, message in strategy.combination_problems(self.memory,
                                                                                                    self.precision)]
        raise_all(problems)
        return self

    @model_validator(mode="after")
    def _lora_combines(self) -> Recipe:
        lora = self.model.lora
        if lora is None:
            return self
        problems = []
        if lora.base_dtype != "fp32" and lora.base_dtype != self.precision:
            problems.append(KeyedError(("model", "lora", "base_dtype"), f"a {lora.base_dtype} base runs under "
                                       f"{lora.base_dtype} autocast, but precision is {self.precision}; set precision: "
                                       f"{lora.base_dtype}, or base_dtype: fp32"))
        if isinstance(self.distributed, TensorParallel):
            problems.append(KeyedError(("model", "lora"), "LoRA wraps the linear layers tensor parallelism splits; "
                                       "use distributed.strategy ddp or fsdp with model.lora"))
        if lora.export_merged and self.distributed.shards:
            problems.append(KeyedError(("model", "lora", "export_merged"), "merging needs the whole model in one "
                                       f"process, which distributed.strategy {self.distributed.strategy} splits; "
                                       "export the adapter and merge it with peft's merge_and_unload afterwards"))
        if lora.quantize_base and self.train.device == "cpu":
            problems.append(KeyedError(("model", "lora", "quantize_base"), "QLoRA: bitsandbytes' 4-bit base runs on "
                                       "CUDA, but train.device is cpu; train on a GPU, or remove quantize_base"))
        raise_all(problems)
        return self

    @model_validator(mode="after")
    def _eval_has_held_out_data(self) -> Recipe:
        if self.eval is not None and self.eval.data is None and not self.data.held_out:
            raise KeyedError(("eval", "data"), f"data.source {self.data.source} has no held-out stream; name "
                                  "held-out files in eval.data (written like the data: section)")
        return self

    @model_validator(mode="after")
    def _data_trains_the_task(self) -> Recipe:
        """Each data section trains the tasks it says (plain text has no targets: seq2seq and
        classification would train on made-up ones); the model's task is checked against it here,
        not at the first step."""
        for path, data in [(("data",), self.data), (("eval", "data"), self.eval.data if self.eval else None)]:
            if data is None:
                continue
            # the task the recipe wrote, else the model's, else the section's own default (image_folder's)
            named = next((d.task for d in (data, self.data) if "task" in d.model_fields_set and d.task), None)
            task = named or infer_task(self.model) or data.task
            if task is None or task in data.tasks():
                continue
            whose = f"data.task is {task}" if named else f"{self.model.name} learns {task}"
            others = " or ".join(sources_for(task)) or "synthetic"
            raise KeyedError((*path, "source"), f"source {data.tag()} ({data.holds}) trains {' or '.join(data.tasks())}, "
                                  f"but {whose}; use source {others}{'' if named else ', or set data.task'}")
        return self

    @model_validator(mode="after")
    def _own_model_says_what_it_learns(self) -> Recipe:
        """A python model implies no task, and data.vocab_size is its setting alone: both checked here,
        each problem its own line, rather than one per run once the model is built."""
        problems = []
        if self.model.source == "python" and self.data.task is None:  # held-out data takes the training data's
            problems.append(KeyedError(("data", "task"), f"{self.model.name} is your own model, so ckrun cannot "
                                            "tell what it learns; set data.task (masked_lm, causal_lm, seq2seq, "
                                            "sequence_classification or image_classification)"))
        held_out = self.eval.data if self.eval is not None else None
        for path, data in [(("data",), self.data), (("eval", "data"), held_out)]:
            if self.model.source == "transformers" and data is not None and data.tokenised and data.vocab_size:
                problems.append(KeyedError((*path, "vocab_size"), "a transformers model takes its vocabulary "
                                                "from model.config.vocab_size; remove this key"))
        raise_all(problems)
        return self

    @model_validator(mode="after")
    def _early_stopping_metric_is_reported(self) -> Recipe:
        """A language model's evaluation reports perplexity, a classifier's accuracy, never both (and
        eval.metrics may not take either name): the other one would be found missing only at the
        first evaluation, after training had begun."""
        stopping = self.eval.early_stopping if self.eval is not None else None
        held_out = self.eval.data if self.eval is not None else None
        task = getattr(held_out, "task", None) or self.data.task or infer_task(self.model)
        if stopping is None or task is None:
            return self
        language = task in LANGUAGE_TASKS
        missing = "accuracy" if language else "perplexity"
        if stopping.metric == missing:
            reported = "perplexity" if language else "accuracy"
            raise KeyedError(("eval", "early_stopping", "metric"), f"a {task} model's evaluation reports loss and "
                             f"{reported}, not {missing}; name one of them, or a metric eval.metrics returns")
        return self

    @model_validator(mode="after")
    def _epochs_need_finite_data(self) -> Recipe:
        if self.train.epochs is not None and not self.data.finite:
            files = [cls.tag() for cls in DATA_SECTIONS if cls.finite]
            raise KeyedError(("train", "epochs"), f"{self.data.tag()} data never runs out, so it has no epochs; "
                                  f"give train.steps, or train on files (data.source {', '.join(files[:-1])} or {files[-1]})")
        return self

    @model_validator(mode="after")
    def _micro_batch_divides(self) -> Recipe:
        micro = self.memory.micro_batch
        if micro is not None and self.train.batch_size % micro:
            raise KeyedError(
                ("memory", "micro_batch"),
                f"memory.micro_batch {micro} does not divide train.batch_size {self.train.batch_size}; "
                f"use a divisor such as {largest_divisor_at_most(self.train.batch_size, micro)}"
            )
        return self

    @model_validator(mode="after")
    def _plan_consistent(self) -> Recipe:
        # the loader prefixes the key itself; plan_problems' messages carry it for callers without a key
        raise_all([KeyedError(("memory", *path), message.removeprefix(".".join(("memory", *path)) + ": "))
                   for path, message in plan_problems(self.memory, self.step_facts())])
        return self

    def step_facts(self) -> StepFacts:
        """What of this recipe besides its memory section the plan's rules read (ckrun.runner.plan.memory_plan.plan_problems)."""
        return StepFacts(batch_size=self.train.batch_size, grad_clip=self.train.grad_clip is not None,
                         precision=self.precision, adamw=type(self.train.optimizer) is AdamW,
                         distributed=not isinstance(self.distributed, SingleProcess))

    @property
    def micro_batch(self) -> int:
        return self.memory.micro_batch or self.train.batch_size


def raise_all(problems: list[KeyedError]) -> None:
    """Raise every problem of one check of the whole recipe together (pydantic stops a model's checks at the
    first that raises); at the recipe's own location, as a single one is, each KeyedError knowing its key."""
    if problems:
        raise ValidationError.from_exception_data("Recipe", [
            InitErrorDetails(type="value_error", loc=(), input=None, ctx={"error": problem})
            for problem in problems])


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
