"""The recipe schema: model, data, training, precision, memory plan and output.

A recipe is plain data; `runner.load` turns a YAML file into one and reports every problem
with its file, line and key. References to things outside the file (classes, builders, import
paths, directories) are checked here too, so `ckrun validate` catches them before training.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails

from .build.resolve import infer_task, resolve_import_path, transformers_class
from .plan import MemoryPlan, Strict, plan_problem
from .problems import suggest
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

    @field_validator("name")
    @classmethod
    def _name_exists(cls, name: str, info: ValidationInfo) -> str:
        source = info.data.get("source")
        if source == "transformers":
            transformers_class(name)
        elif source == "torchvision":
            import torchvision

            known = torchvision.models.list_models()
            if name not in known:
                raise ValueError(f"no torchvision model named {name!r}{suggest(name, known)}")
        elif source == "python":
            _check_factory(name, resolve_import_path(name), {})
        return name

    @field_validator("config")
    @classmethod
    def _config_keys_exist(cls, config: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if info.data.get("source") == "transformers" and "name" in info.data:
            from .build.model_config import check_transformers_config

            model_class = transformers_class(info.data["name"])
            check_config_keys(model_class.config_class, config)
            check_transformers_config(model_class, config)
        elif info.data.get("source") == "python" and "name" in info.data:
            _check_factory(info.data["name"], resolve_import_path(info.data["name"]), config)
        return config

    @field_validator("pretrained")
    @classmethod
    def _directory_fits(cls, pretrained: str | None, info: ValidationInfo) -> str | None:
        if pretrained is not None:
            from .build.pretrained import check_pretrained_dir

            check_pretrained_dir(Path(pretrained).expanduser(), info.data.get("source"), info.data.get("name"))
        return pretrained


def _check_factory(name: str, factory, config: dict) -> None:
    """That a python factory can be called with model.config, from its signature (nothing is run)."""
    from .build.resolve import BuildError, check_factory, check_kwargs

    try:
        check_factory(factory, name)
        check_kwargs(factory, config)
    except BuildError as err:
        raise KeyedValueError(tuple(err.key.split(".")), str(err)) from None


def check_config_keys(config_class, given: dict) -> None:
    # transformers configs keep unknown kwargs as attributes, so a typo would be silently ignored
    known = set(config_class().to_dict())
    for base in config_class.__mro__:  # base-class settings such as num_labels reach __init__ via **kwargs
        if "__init__" in vars(base):
            known |= set(inspect.signature(base.__init__).parameters)
    known |= set(getattr(config_class, "attribute_map", {}))
    known |= {name for name, attr in inspect.getmembers(config_class) if isinstance(attr, property) and attr.fset}
    unknown = [key for key in given if key not in known]
    if unknown:
        raise KeyedValueError(("model", "config", unknown[0]),
                              f"{config_class.__name__} has no setting {unknown[0]!r}{suggest(unknown[0], known)}")


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
            raise KeyedValueError(("train", "epochs"), "give train.steps or train.epochs, not both (on the command "
                                  "line, train.steps=null train.epochs=N swaps one for the other)")
        if self.steps is None and self.epochs is None:
            raise KeyedValueError(("train",), "give train.steps (optimizer steps) or train.epochs (passes over the data)")
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

    @field_validator("metrics")
    @classmethod
    def _metrics_resolve(cls, paths: list[str]) -> list[str]:
        for index, path in enumerate(paths):
            try:
                function = resolve_import_path(path)
            except ValueError as err:
                raise KeyedValueError(("eval", "metrics", index), str(err)) from None
            name = path.partition(":")[2]
            if not callable(function) or name in ("loss", "perplexity", "accuracy", "samples", "time_s"):
                why = "is not a function" if not callable(function) else "has the name of one of the evaluation's own"
                raise KeyedValueError(("eval", "metrics", index), f"{path} {why}; name a function "
                                      "metric(predictions, labels) -> number or dict")
        return paths

    @model_validator(mode="after")
    def _early_stopping_needs_evaluations(self) -> EvalSpec:
        if self.early_stopping is None:
            return self
        if not self.every:
            raise KeyedValueError(("eval", "every"), "eval.early_stopping needs evaluations during the run; set "
                                  "eval.every to the steps between them")
        if self.early_stopping.metric not in ("loss", "perplexity", "accuracy") and not self.metrics:
            raise KeyedValueError(("eval", "early_stopping", "metric"), f"the evaluation reports loss and perplexity "
                                  f"or accuracy, not {self.early_stopping.metric!r}; name one, or add eval.metrics")
        return self


class SingleProcess(Strict):
    strategy: Literal["none"] = "none"
    """One process trains on one device."""


class DataParallel(Strict):
    strategy: Literal["ddp"]
    """DDP: every rank holds the whole model and optimizer; gradients are averaged after backward."""


class FullySharded(Strict):
    strategy: Literal["fsdp"]
    """FSDP2 (`fully_shard` per block, then the whole model): parameters, gradients and optimizer
    state are split over the ranks; memory.sharding tunes it, `precision` sets its mixed precision."""


Distributed = Annotated[SingleProcess | DataParallel | FullySharded, Field(discriminator="strategy")]


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
    """How ranks share the work under torchrun (`ckrun RECIPE --nproc N`): none, ddp or fsdp.
    train.batch_size stays the global batch; each rank takes batch_size / world size of it."""

    @model_validator(mode="after")
    def _sharding_needs_fsdp(self) -> Recipe:
        strategy = self.distributed.strategy
        if self.memory.sharding is not None and strategy != "fsdp":
            raise KeyedValueError(("memory", "sharding"), f"sharding knobs apply to FSDP, but distributed.strategy is "
                                  f"{strategy}; set distributed.strategy: fsdp or remove memory.sharding")
        if strategy == "fsdp" and self.memory.checkpointing.policy == "sqrt":
            # a segment's recompute replays its blocks' forwards, past the hooks FSDP2 gathers parameters in
            raise KeyedValueError(("memory", "checkpointing"), "sqrt segments do not work with distributed.strategy "
                                  "fsdp (their recompute bypasses FSDP's parameter gathering); use every, layers or "
                                  "full, or strategy ddp")
        if strategy == "fsdp" and self.precision == "fp16":
            # the loss scaler would find inf/nan in each rank's shard alone: ranks could disagree on skipping
            raise KeyedValueError(("precision",), "fp16 with distributed.strategy fsdp is not supported (its loss "
                                  "scaler sees one shard per rank); use precision: bf16, or strategy: ddp")
        return self

    @model_validator(mode="after")
    def _eval_has_held_out_data(self) -> Recipe:
        if self.eval is not None and self.eval.data is None and self.data.source != "synthetic":
            raise KeyedValueError(("eval", "data"), f"data.source {self.data.source} has no held-out stream; name "
                                  "held-out files in eval.data (written like the data: section)")
        return self

    @model_validator(mode="after")
    def _text_files_have_no_targets(self) -> Recipe:
        """Plain text holds inputs only: seq2seq and classification would train on made-up targets."""
        for path, data in [(("data",), self.data), (("eval", "data"), self.eval.data if self.eval else None)]:
            task = data and (data.task or self.data.task or infer_task(self.model))
            if data is not None and data.source == "text" and task in ("seq2seq", "sequence_classification"):
                raise KeyedValueError((*path, "source"), f"text files hold no {'target texts' if task == 'seq2seq' else 'labels'} "
                                      f"for {task}; use source: records with a JSONL or CSV file of input and target fields")
            if data is not None and data.source == "records" and task not in (None, "seq2seq", "sequence_classification"):
                raise KeyedValueError((*path, "source"), f"records train seq2seq or sequence_classification, but "
                                      f"{self.model.name} learns {task}; use source: text, or set data.task")
        return self

    @model_validator(mode="after")
    def _own_model_says_what_it_learns(self) -> Recipe:
        """A python model implies no task, and data.vocab_size is its setting alone: both checked here,
        each problem its own line, rather than one per run once the model is built."""
        problems = []
        if self.model.source == "python" and self.data.task is None:  # held-out data takes the training data's
            problems.append(KeyedValueError(("data", "task"), f"{self.model.name} is your own model, so ckrun cannot "
                                            "tell what it learns; set data.task (masked_lm, causal_lm, seq2seq, "
                                            "sequence_classification or image_classification)"))
        held_out = self.eval.data if self.eval is not None else None
        for path, data in [(("data",), self.data), (("eval", "data"), held_out)]:
            if self.model.source == "transformers" and getattr(data, "vocab_size", None) and data.source != "synthetic":
                problems.append(KeyedValueError((*path, "vocab_size"), "a transformers model takes its vocabulary "
                                                "from model.config.vocab_size; remove this key"))
        raise_all(problems)
        return self

    @model_validator(mode="after")
    def _sequence_fits_positions(self) -> Recipe:
        """A sequence past the position table would index out of range at the first step."""
        if self.model.source != "transformers":
            return self
        from .build.model_config import max_positions

        limit = max_positions(transformers_class(self.model.name), self.model.config)
        for path, data in [(("data",), self.data), (("eval", "data"), self.eval.data if self.eval else None)]:
            seq_len = getattr(data, "seq_len", None)
            if limit is not None and seq_len is not None and seq_len > limit:
                raise KeyedValueError((*path, "seq_len"), f"{seq_len} tokens exceed {self.model.name}'s {limit} "
                                      f"positions (max_position_embeddings); give seq_len <= {limit}")
        return self

    @model_validator(mode="after")
    def _epochs_need_finite_data(self) -> Recipe:
        if self.train.epochs is not None and self.data.source == "synthetic":
            raise KeyedValueError(("train", "epochs"), "synthetic data never runs out, so it has no epochs; "
                                  "give train.steps, or train on files (data.source text, records, dataset or image_folder)")
        return self

    @model_validator(mode="after")
    def _micro_batch_divides(self) -> Recipe:
        micro = self.memory.micro_batch
        if micro is not None and self.train.batch_size % micro:
            raise KeyedValueError(
                ("memory", "micro_batch"),
                f"memory.micro_batch {micro} does not divide train.batch_size {self.train.batch_size}; "
                f"use a divisor such as {largest_divisor_at_most(self.train.batch_size, micro)}"
            )
        return self

    @model_validator(mode="after")
    def _plan_consistent(self) -> Recipe:
        problem = plan_problem(self.memory)
        if problem is not None:
            raise KeyedValueError(("memory", *problem[0]), problem[1])
        return self

    @property
    def micro_batch(self) -> int:
        return self.memory.micro_batch or self.train.batch_size


class KeyedValueError(ValueError):
    """A cross-field problem that belongs to one key, so the loader can point at its line."""

    def __init__(self, path: tuple[str | int, ...], message: str):
        super().__init__(message)
        self.path = path


def raise_all(problems: list[KeyedValueError]) -> None:
    """Raise every problem of one check together (pydantic stops a model's checks at the first that raises)."""
    if problems:
        raise ValidationError.from_exception_data("Recipe", [
            InitErrorDetails(type="value_error", loc=problem.path, input=None, ctx={"error": problem})
            for problem in problems])


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)
