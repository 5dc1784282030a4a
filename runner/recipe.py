"""The recipe schema: model, data, training, precision, memory plan and output.

A recipe is plain data; `runner.load` turns a YAML file into one and reports every problem
with its file, line and key. The schema needs nothing but the recipe: what only the named classes,
files and code can tell (a transformers config, a factory's arguments, a dataset's columns) is
checked right after it by runner/builders/checks.py, so `ckrun validate` still catches it before
training, and validating imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from .choices import Strict
from .plan import MemoryPlan, StepFacts, plan_problems
from .problems import KeyedError
from .strategies import (  # noqa: F401 - the strategies are part of the recipe's schema
    DataParallel, Distributed, FullySharded, HybridSharded, SingleProcess, TensorParallel,
)
from .recipe_data import (  # noqa: F401 - the data sources are part of the recipe's schema
    PathText,
    Data, DatasetData, ImageFolderData, RecordsData, SyntheticData, Task, TextFilesData,
)
from .recipe_train import (  # noqa: F401 - the optimizers and schedules too
    AdamW, ConstantSchedule, CosineSchedule, Optimizer, Schedule, SGD, TorchOptimizer,
)
from .recipe_sinks import SinkEntries


Precision = Literal["fp32", "bf16", "fp16"]


class ModelSpec(Strict):
    source: Literal["transformers", "torchvision", "python"]
    """Where the model comes from: a transformers class, a torchvision builder, or your own code."""
    name: str
    """`BertForMaskedLM` (transformers), `resnet50` (torchvision), or `package.module:factory`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the transformers config class, the torchvision builder or the factory."""
    pretrained: PathText | None = None
    """A local directory with weights to start from: a run's OUTPUT_DIR/model or
    OUTPUT_DIR/checkpoints/step-N, save_pretrained output, or a state dict (nothing is downloaded)."""


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


class EarlyStopping(Strict):
    """Stop when `metric` has not improved by more than `min_delta` for `patience` evaluations in a
    row; the run then ends as a finished one does (saved and exported, exit 0)."""

    metric: str = "loss"
    """`loss`, `perplexity`, `accuracy` or a name eval.metrics returns."""
    patience: int = Field(default=3, gt=0)
    """Evaluations without improvement before the run stops."""
    min_delta: float = Field(default=0.0, ge=0)
    """The least change that counts as an improvement."""
    mode: Literal["min", "max"] | None = None
    """Whether smaller or larger is better; unset: max for accuracy, min for everything else."""


class EvalSpec(Strict):
    """Held-out evaluation: loss, and perplexity (language models) or accuracy (classification)."""

    every: int = Field(default=0, ge=0)
    """Steps between evaluations; the run's last step is always evaluated, and so is the step a
    Ctrl-C (SIGINT/SIGTERM) stops after (0: only those)."""
    batches: int | None = Field(default=None, gt=0)
    """Batches of train.batch_size per evaluation, the same ones each time so evaluations compare.
    Unset: the whole held-out set, every sample once (synthetic data, which never ends: 4 batches)."""
    data: Data | None = None
    """Held-out data, written like the `data:` section. Unset: synthetic training data is evaluated
    on batches of its seed's stream that no training step draws; file data needs held-out files here."""
    metrics: list[str] = Field(default_factory=list)
    """Your own metrics, `package.module:function` each: called once per evaluation with two 1-D
    tensors, the top class of every sample (or labelled token) and the right answers; returns a
    number (recorded under the function's name) or a dict of named numbers."""
    early_stopping: EarlyStopping | None = None
    """End the run when an evaluation metric stops improving; needs eval.every."""

    @model_validator(mode="after")
    def _early_stopping_needs_evaluations(self) -> EvalSpec:
        if self.early_stopping is None:
            return self
        if not self.every:
            raise KeyedError(("eval", "every"), "eval.early_stopping needs evaluations during the run; set "
                                  "eval.every to the steps between them")
        if self.early_stopping.metric not in ("loss", "perplexity", "accuracy") and not self.metrics:
            raise KeyedError(("eval", "early_stopping", "metric"), f"the evaluation reports loss and perplexity "
                                  f"or accuracy, not {self.early_stopping.metric!r}; name one, or add eval.metrics")
        return self


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
    def _eval_has_held_out_data(self) -> Recipe:
        if self.eval is not None and self.eval.data is None and self.data.source != "synthetic":
            raise KeyedError(("eval", "data"), f"data.source {self.data.source} has no held-out stream; name "
                                  "held-out files in eval.data (written like the data: section)")
        return self

    @model_validator(mode="after")
    def _text_files_have_no_targets(self) -> Recipe:
        """Plain text holds inputs only: seq2seq and classification would train on made-up targets."""
        for path, data in [(("data",), self.data), (("eval", "data"), self.eval.data if self.eval else None)]:
            task = data and (data.task or self.data.task or infer_task(self.model))
            if data is not None and data.source == "text" and task in ("seq2seq", "sequence_classification"):
                raise KeyedError((*path, "source"), f"text files hold no {'target texts' if task == 'seq2seq' else 'labels'} "
                                      f"for {task}; use source: records with a JSONL or CSV file of input and target fields")
            if data is not None and data.source == "records" and task not in (None, "seq2seq", "sequence_classification"):
                raise KeyedError((*path, "source"), f"records train seq2seq or sequence_classification, but "
                                      f"{self.model.name} learns {task}; use source: text, or set data.task")
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
            if self.model.source == "transformers" and getattr(data, "vocab_size", None) and data.source != "synthetic":
                problems.append(KeyedError((*path, "vocab_size"), "a transformers model takes its vocabulary "
                                                "from model.config.vocab_size; remove this key"))
        raise_all(problems)
        return self

    @model_validator(mode="after")
    def _epochs_need_finite_data(self) -> Recipe:
        if self.train.epochs is not None and self.data.source == "synthetic":
            raise KeyedError(("train", "epochs"), "synthetic data never runs out, so it has no epochs; "
                                  "give train.steps, or train on files (data.source text, records, dataset or image_folder)")
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
        """What of this recipe besides its memory section the plan's rules read (runner.plan.plan_problems)."""
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
