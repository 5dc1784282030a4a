"""MLflow, local (`output.sinks: [mlflow]`): each record's numbers as MLflow metrics at the record's
step, `train/loss`, `eval/perplexity`, ... as TensorBoard names them, the recipe's settings as the
run's params, in a SQLite tracking store OUTPUT_DIR/mlflow.db (artifacts: OUTPUT_DIR/mlartifacts).
Nothing is sent anywhere (MLflow's usage telemetry is turned off unless MLFLOW_DISABLE_TELEMETRY is
set); `mlflow ui --backend-store-uri sqlite:///OUTPUT_DIR/mlflow.db` shows it.
(MLflow 3 refuses a `file:` store unless MLFLOW_ALLOW_FILE_STORE is set; SQLite is its local store.)

Resume: a resumed run continues its MLflow run (the newest in the store, which holds this
output.dir's runs only). MLflow keeps every value logged, so the resumed attempt skips a metric
at the steps the killed attempt already logged it for: each step keeps one value, the first
attempt's (the same loss: resume is exact). The params stay those the run started with; the
settings --resume-changed accepted are a tag. A run started afresh gets a new MLflow run. How the
run ended is its status: FINISHED, KILLED (a signal stopped it) or FAILED.
"""

from __future__ import annotations

import json
import logging
import os
import time

from ..recipe_sinks import MlflowSink
from .output import Ended, RunInfo, scalars

log = logging.getLogger(__name__)

STORE = "mlflow.db"
ARTIFACTS = "mlartifacts"
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowLog:
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
        store = (run.out_dir / STORE).resolve()
        _check_store(store)
        self.client = MlflowClient(tracking_uri=f"sqlite:///{store}")
        experiment = self._experiment((run.out_dir / ARTIFACTS).resolve().as_uri())
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
        self.client.set_terminated(self.run_id, STATUS[ended])

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


def _check_store(store) -> None:
    """SQLite's answer at once: MLflow retries a store it cannot open for two minutes, warning each time."""
    import sqlite3

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


def _flat(values: dict, prefix: str = ""):
    """(dotted key, value as text) for every leaf setting: `train.optimizer.lr`, '0.001'."""
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _flat(value, f"{prefix}{key}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield f"{prefix}{key}", text[:6000]  # MLflow's limit on a param's value
