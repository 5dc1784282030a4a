"""The trackers a run's records can go to besides metrics.jsonl (`output.sinks`), one class each, as
torchtune and torchtitan keep their loggers: TensorBoard, Weights & Biases (offline) and MLflow (a
local SQLite store). Each writes a record's numbers under the names TensorBoard gives them
(`train/loss`, `train/lr`, `eval/perplexity`, ...: directory.py's `scalars`) at the record's step, and
keeps a resumed run one run. Nothing leaves the machine: W&B runs offline with its error reports
off, MLflow with its usage telemetry off (unless WANDB_ERROR_REPORTING or MLFLOW_DISABLE_TELEMETRY
say otherwise).

TensorBoard: event files in OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR`). A resumed
run purges the events from its checkpoint's step on, so the curves show each step once.

W&B: OUTPUT_DIR/wandb/offline-run-* holds the run (`wandb sync OUTPUT_DIR/wandb/offline-run-*`
uploads it), the recipe as its config. A run keeps one W&B run id (OUTPUT_DIR/wandb/ckrun-run-id)
across --resume: each attempt writes an offline folder of that id, and `wandb sync` uploads the
folders of one run in the order they were started, as one run. The resumed attempt logs from the
step after its checkpoint; W&B takes steps in increasing order only, so the steps a killed attempt
logged after its last checkpoint keep that attempt's values (the same losses: resume is exact). A
run started afresh (nothing to resume) gets a new id.

MLflow: a SQLite tracking store OUTPUT_DIR/mlflow.db (artifacts: OUTPUT_DIR/mlartifacts; `mlflow ui
--backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db` shows it), the recipe's settings as the run's
params. (MLflow 3 refuses a `file:` store unless MLFLOW_ALLOW_FILE_STORE is set; SQLite is its local
store.) Importing MLflow takes about 6 s and creating a store 15 s (alembic migrates its tables one
by one), so the sink opens in the background (`opens_slowly`: runner/train/output/sinks.py) and training
starts at once; and a new run's store is a copy of an empty one kept in the user cache
($XDG_CACHE_HOME/ckrun, one per version of MLflow and its database packages), made by the first run. A resumed run continues its MLflow run (the newest in the store, which holds this output.dir's
runs only). MLflow keeps every value logged, so the resumed attempt skips a metric at the steps the
killed attempt already logged it for: each step keeps one value, the first attempt's. The params
stay those the run started with; the settings --resume-changed accepted are a tag. How the run ended
is its status: FINISHED, KILLED (a signal stopped it) or FAILED.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import ClassVar

from ...recipe.sinks import MlflowSink, TensorBoardSink, WandbSink
from ...disk.user_cache import cache_folder, key_of
from .directory import Ended, RunInfo, scalars

log = logging.getLogger(__name__)


# --- TensorBoard -------------------------------------------------------------------------------


class TensorBoardLog:
    takes: ClassVar[type] = TensorBoardSink  # the recipe section it is configured by
    directory: ClassVar[str] = "tensorboard"

    def __init__(self, section: TensorBoardSink | None = None):
        self.writer = None

    def open(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = run.out_dir / self.directory
        # purge_step: events a killed attempt wrote after its last checkpoint are dropped, not drawn twice
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=run.first_step or None)
        log.info("tensorboard: events in %s (view them with `tensorboard --logdir %s`)", directory, directory.parent)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self, ended: Ended) -> None:
        self.writer.close()


# --- Weights & Biases -------------------------------------------------------------------------


class WandbLog:
    takes: ClassVar[type] = WandbSink
    directory: ClassVar[str] = "wandb"
    id_file: ClassVar[str] = "ckrun-run-id"  # the file that keeps the run's W&B id across --resume

    def __init__(self, section: WandbSink):
        self.section, self.run = section, None

    def open(self, run: RunInfo) -> None:
        # offline is not enough for nothing to leave the machine: wandb-core reports its own errors unless told not to
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        directory = run.out_dir / self.directory
        directory.mkdir(exist_ok=True)
        run_id = _run_id(directory / self.id_file, resumed=run.first_step > 0)
        # console off: W&B would wrap stdout and stderr, which ckrun's lines and progress bar write to
        settings = wandb.Settings(silent=True, console="off")
        self.run = wandb.init(mode="offline", dir=str(run.out_dir), id=run_id, resume="allow" if run.first_step else None,
                              project=self.section.project, name=self.section.run_name or run.out_dir.name,
                              tags=self.section.tags or None, config=run.recipe.model_dump(mode="json"), settings=settings)
        log.info("wandb: offline run %s in %s (upload it with `wandb sync %s`)", run_id, directory,
                 Path(self.run.dir).parent)

    def write(self, record: dict) -> None:
        if "resumed_with_changes" in record:  # --resume-changed: the settings the run continued with
            self.run.config.update({f"resumed_with_changes_at_{record['step']}": record["resumed_with_changes"]},
                                   allow_val_change=True)
        values = scalars(record)
        if values:
            self.run.log(values, step=record["step"])

    def close(self, ended: Ended) -> None:
        self.run.finish(exit_code=0 if ended == "finished" else 1)


def _run_id(path: Path, resumed: bool) -> str:
    """The run's W&B id: the one its earlier attempt used when resuming, else a new one (written down in `path`)."""
    if resumed and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(4)  # W&B ids are lower-case letters and digits
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


# --- MLflow ---------------------------------------------------------------------------------------


class MlflowLog:
    takes: ClassVar[type] = MlflowSink
    opens_slowly: ClassVar[bool] = True  # its import and its store: runner/train/output/sinks.py opens it in the background
    store_file: ClassVar[str] = "mlflow.db"
    artifacts: ClassVar[str] = "mlartifacts"
    status: ClassVar[dict[str, str]] = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, section: MlflowSink):
        self.section, self.client, self.run_id = section, None, None
        self.logged: dict[str, int] = {}  # metric -> the last step the run already holds (a resumed run)

    def open(self, run: RunInfo) -> None:
        # a local store is not enough for nothing to leave the machine: from `import mlflow` on, MLflow sends
        # usage telemetry (which calls were made) unless told not to
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines (creating the store's tables) are not ckrun's
            logging.getLogger(name).setLevel(logging.WARNING)
        store = (run.out_dir / self.store_file).resolve()
        if not store.exists():
            _new_store(store, MlflowClient)
        _check_store(store)
        self.client = MlflowClient(tracking_uri=f"sqlite:///{store}")
        experiment = self._experiment((run.out_dir / self.artifacts).resolve().as_uri())
        previous = self._newest(experiment) if run.first_step else None
        if previous is not None:
            self.run_id = previous.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.logged = {key: self._last_step(key) for key in previous.data.metrics}
        else:
            self.run_id = self.client.create_run(experiment, run_name=self.section.run_name or run.out_dir.name).info.run_id
            self._log_params(run.recipe.model_dump(mode="json"))
        log.info("mlflow: run %s in %s (`mlflow ui --backend-store-uri sqlite:///%s`)", self.run_id, store, store)

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        step = record["step"]
        if "resumed_with_changes" in record:  # --resume-changed: the settings the run continued with
            self.client.set_tag(self.run_id, f"ckrun.resumed_with_changes_at_{step}", json.dumps(record["resumed_with_changes"]))
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars(record).items()
                   if step > self.logged.get(key, 0)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, ended: Ended) -> None:
        self.client.set_terminated(self.run_id, self.status[ended])

    def _experiment(self, artifacts: str) -> str:
        found = self.client.get_experiment_by_name(self.section.experiment)
        if found is not None:
            return found.experiment_id
        return self.client.create_experiment(self.section.experiment, artifact_location=artifacts)

    def _newest(self, experiment: str):
        runs = self.client.search_runs([experiment], order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0] if runs else None

    def _last_step(self, key: str) -> int:
        return max((metric.step for metric in self.client.get_metric_history(self.run_id, key)), default=0)

    def _log_params(self, recipe: dict) -> None:
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in _flat(recipe)]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])


def _new_store(path: Path, client) -> None:
    """An empty tracking store at `path`: a copy of the user cache's for this MLflow, made there first
    when there is none (`client`: MlflowClient, which creates and migrates a store it is pointed at).
    A cache that cannot be written costs the time of making the store in place, nothing else."""
    template = cache_folder() / f"mlflow-store-{key_of(['an empty MLflow store'], STORE_PACKAGES)[:16]}.db"
    try:
        if not template.is_file():
            template.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=template.parent) as folder:
                fresh = Path(folder) / "mlflow.db"
                client(tracking_uri=f"sqlite:///{fresh}").search_experiments(max_results=1)
                _copy_store(fresh, template)
        _copy_store(template, path)
    except (OSError, sqlite3.Error) as err:
        log.debug("mlflow: no store from the user cache (%s); making one in place", err)


def _check_store(store: Path) -> None:
    """SQLite's answer at once: MLflow retries a store it cannot open for two minutes, warning each time."""
    if store.exists() and not store.is_file():
        raise OSError(f"{store} is a directory, not MLflow's SQLite store; move it, or choose another output.dir")
    try:
        connection = sqlite3.connect(store, timeout=10)
        try:
            connection.execute("PRAGMA schema_version")
        finally:
            connection.close()
    except sqlite3.Error as err:
        raise OSError(f"cannot open MLflow's store {store}: {err}") from None


def _copy_store(source: Path, target: Path) -> None:
    """A consistent copy of the SQLite file `source` (through SQLite's backup), put in place whole."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    reading, writing = sqlite3.connect(source), sqlite3.connect(partial)
    try:
        reading.backup(writing)
    finally:
        writing.close()
        reading.close()
    os.replace(partial, target)


STORE_PACKAGES = ("mlflow", "mlflow-skinny", "sqlalchemy", "alembic")  # what an empty store's schema depends on


def _flat(values: dict, prefix: str = ""):
    """(dotted key, value as text) for every leaf setting: `train.optimizer.lr`, '0.001'."""
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield f"{prefix}{key}", text[:6000]  # MLflow's limit on a param's value


TRACKERS = (TensorBoardLog, WandbLog, MlflowLog)
