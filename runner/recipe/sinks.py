"""The recipe's `output.sinks`: where each step's and evaluation's record goes besides metrics.jsonl.

A sink is named (`sinks: [tensorboard, wandb]`, its settings the defaults) or written as a section
(`{name: wandb, project: bert}`). Each needs its optional package, checked here so that `ckrun
validate` says which extra to install; the sinks themselves are runner/train/output/sinks.py's.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, ClassVar, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, Field

from ..plan.choices import Strict, members


class SinkChoice(Strict):
    """A sink's section: told apart by its `name` (a Choice's `tags` would clash with W&B's field), naming
    the packages it needs."""

    packages: ClassVar[tuple[str, ...]]

    @classmethod
    def sink_name(cls) -> str:
        return get_args(cls.model_fields["name"].annotation)[0]


class TensorBoardSink(SinkChoice):
    name: Literal["tensorboard"]
    """TensorBoard event files in OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR`); a resumed
    run drops the events after its checkpoint, so each step is drawn once. `pip install 'ckrun[tensorboard]'`."""
    packages: ClassVar[tuple[str, ...]] = ("tensorboard",)


class WandbSink(SinkChoice):
    name: Literal["wandb"]
    """Weights & Biases, offline (nothing is sent): OUTPUT_DIR/wandb holds the run, `wandb sync
    OUTPUT_DIR/wandb/offline-run-*` uploads it. A resumed run keeps its W&B run id. `pip install 'ckrun[wandb]'`."""
    project: str = "ckrun"
    """The W&B project the run goes to when synced."""
    run_name: str | None = None
    """The run's name in W&B; unset: output.dir's folder name."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags for the run."""
    packages: ClassVar[tuple[str, ...]] = ("wandb",)


class MlflowSink(SinkChoice):
    name: Literal["mlflow"]
    """MLflow, local: a SQLite tracking store OUTPUT_DIR/mlflow.db (`mlflow ui --backend-store-uri
    sqlite:///OUTPUT_DIR/mlflow.db`); the recipe is logged as the run's params. A resumed run continues
    its MLflow run. `pip install 'ckrun[mlflow]'`."""
    experiment: str = "ckrun"
    """The MLflow experiment the run is filed under."""
    run_name: str | None = None
    """The run's name in MLflow; unset: output.dir's folder name."""
    # the SQLite store needs the other two, which mlflow-skinny (a client alone) lacks
    packages: ClassVar[tuple[str, ...]] = ("mlflow", "sqlalchemy", "alembic")


SinkSection = Annotated[TensorBoardSink | WandbSink | MlflowSink, Field(discriminator="name")]
SECTIONS: tuple[type[SinkChoice], ...] = members(SinkSection)
SinkName = Literal[tuple(section.sink_name() for section in SECTIONS)]  # type: ignore[valid-type]


def _named(entry):
    """`wandb` is `{name: wandb}`: a sink with its default settings."""
    return {"name": entry} if isinstance(entry, str) else entry


def _installed(section: SinkSection) -> SinkSection:
    """Checked at validate, not found missing mid-run as one warning line after the run started."""
    missing = next((name for name in section.packages if importlib.util.find_spec(name) is None), None)
    if missing is not None:
        raise ValueError(f"the {missing} package is not installed; pip install 'ckrun[{section.name}]', "
                         f"or remove {section.name} from output.sinks")
    return section


def _each_once(sections: list[SinkSection]) -> list[SinkSection]:
    names = [section.name for section in sections]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"{twice} is listed twice; list each sink once")
    return sections


# the recipe's entries (at run time each becomes a runner/train/output/directory.py Sink, opened by runner/train/output/sinks.py)
SinkEntry = Annotated[SinkSection, BeforeValidator(_named, json_schema_input_type=SinkName | SinkSection),
                      AfterValidator(_installed)]
SinkEntries = Annotated[list[SinkEntry], AfterValidator(_each_once)]
