"""W&B (offline) and MLflow (a local SQLite store) for real: every step and evaluation of metrics.jsonl
reaches them, and a --resume continues the same W&B run id and the same MLflow run, each step held
once in MLflow (the killed attempt's value) and the resumed W&B folder starting after the checkpoint;
a run started afresh is a new MLflow run, how a run ended is its status, and neither package sends
anything (W&B's error reports and MLflow's usage telemetry are turned off)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path
from unittest import mock

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None
RUN = [BERT_TINY, *TINY_BERT, "train.steps=4", "output.checkpoint_every=2", "eval={every: 2, batches: 1}"]
OPT_OUTS = ("WANDB_ERROR_REPORTING", "MLFLOW_DISABLE_TELEMETRY")


def wandb_records(path: Path):
    """The protobuf records of an offline run's .wandb file: W&B's LevelDB-style log of 32 KiB blocks,
    each record a 7-byte header (CRC-32, length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes."""
    data, position, parts = path.read_bytes(), 7, b""  # after the file header ":W&B", magic, version
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (kind == 0 and length == 0):  # the block's tail is padding
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield parts


def wandb_history(out: Path) -> list[tuple[str, list[dict]]]:
    """(run id, history rows) of each offline folder, in the order they were started."""
    from wandb.proto import wandb_internal_pb2

    runs = []
    for folder in sorted((out / "wandb").glob("offline-run-*")):
        rows = []
        for data in wandb_records(next(folder.glob("*.wandb"))):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        runs.append((folder.name.rsplit("-", 1)[1], rows))
    return runs


def mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("ckrun").experiment_id])
    return client, runs


def steps(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["_step"], pytest.approx(row[key])) for row in rows if key in row]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run of 4 steps that logs to W&B and MLflow, then resumed from step 2 as if killed after step 4
    before its last save: steps 3 and 4 run again."""
    from ckrun.runner.cli import main

    sinks = [name for name, present in (("wandb", HAS_WANDB), ("mlflow", HAS_MLFLOW)) if present]
    if not sinks:
        pytest.skip("neither wandb nor mlflow is installed (pip install 'ckrun[wandb]' 'ckrun[mlflow]')")
    out = tmp_path_factory.mktemp("trackers") / "run"
    args = [*RUN, f"output.sinks=[{', '.join(sinks)}]", f"output.dir={out}"]
    with mock.patch.dict(os.environ):  # the sinks set the opt-outs; the other tests get os.environ back as it was
        for name in OPT_OUTS:
            os.environ.pop(name, None)
        assert main(args) == 0
        opted_out = {name: os.environ.get(name) for name in OPT_OUTS}
        first = read_metrics(out)
        shutil.rmtree(out / "checkpoints" / "step-00000004")
        assert main([*args, "--resume"]) == 0
    return out, first, read_metrics(out), opted_out


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'ckrun[wandb]')")
def test_wandb_offline_holds_every_record_and_a_resume_continues_its_run(resumed):
    out, first, final, opted_out = resumed
    assert opted_out["WANDB_ERROR_REPORTING"] == "false"  # offline, and no error reports either
    (first_id, before), (resumed_id, after) = wandb_history(out)
    assert first_id == resumed_id == (out / "wandb" / "ckrun-run-id").read_text().strip()
    assert steps(before, "train/loss") == [(r["step"], r["loss"]) for r in first if "loss" in r]
    assert steps(before, "eval/perplexity") == [(r["step"], r["eval"]["perplexity"]) for r in first if "eval" in r]
    assert [step for step, _ in steps(after, "train/loss")] == [3, 4]  # from the step after the checkpoint
    assert steps(after, "train/loss") == [(r["step"], r["loss"]) for r in final if "loss" in r and r["step"] > 2]


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'ckrun[mlflow]')")
def test_mlflow_holds_every_record_once_across_a_resume(resumed):
    out, first, final, opted_out = resumed
    assert opted_out["MLFLOW_DISABLE_TELEMETRY"] == "true"  # a local store, and no usage telemetry either
    client, runs = mlflow_run(out)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    history = lambda key: sorted((m.step, pytest.approx(m.value)) for m in client.get_metric_history(run_id, key))  # noqa: E731
    assert history("train/loss") == [(r["step"], r["loss"]) for r in final if "loss" in r]  # each step once
    assert history("eval/perplexity") == [(r["step"], r["eval"]["perplexity"]) for r in final if "eval" in r]
    assert [r["loss"] for r in first if "loss" in r] == pytest.approx([r["loss"] for r in final if "loss" in r])
    params = runs[0].data.params
    assert params["train.steps"] == "4" and params["model.name"] == "BertForMaskedLM"


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'ckrun[mlflow]')")
@mock.patch.dict(os.environ)  # the sink sets MLFLOW_DISABLE_TELEMETRY
def test_a_run_started_afresh_is_a_new_mlflow_run_and_a_resumed_one_continues_the_newest(tmp_path):
    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.recipe.sinks import MlflowSink
    from ckrun.runner.train.output.trackers import MlflowLog
    from ckrun.runner.train.output.directory import RunInfo

    recipe, ids = load_recipe(BERT_TINY), []
    for first_step, ended in ((0, "stopped"), (0, "failed"), (2, "finished")):  # afresh, afresh, resumed
        sink = MlflowLog(MlflowSink(name="mlflow"))
        sink.open(RunInfo(tmp_path, recipe, "<recipe>", first_step))
        sink.write({"step": first_step + 1, "loss": 1.0})
        sink.close(ended)
        ids.append(sink.run_id)
    assert ids[0] != ids[1] == ids[2]
    client, runs = mlflow_run(tmp_path)
    assert {run.info.run_id: run.info.status for run in runs} == {ids[0]: "KILLED", ids[1]: "FINISHED"}
    assert sorted(m.step for m in client.get_metric_history(ids[1], "train/loss")) == [1, 3]


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'ckrun[mlflow]')")
@mock.patch.dict(os.environ)
def test_a_new_mlflow_store_is_a_copy_of_the_user_caches_empty_one(tmp_path):
    """Making a store migrates its tables one by one (15 s): the first run makes one in the user cache,
    every later new run copies it; a cache that cannot be written leaves the store made in place."""
    from mlflow.tracking import MlflowClient

    from ckrun.runner.train.output.trackers import _new_store

    made = []
    counting = lambda **kwargs: made.append(kwargs) or MlflowClient(**kwargs)  # noqa: E731
    _new_store(tmp_path / "a.db", counting)
    _new_store(tmp_path / "b.db", counting)
    assert len(made) == 1  # the template, once
    for name in ("a.db", "b.db"):
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / name}")
        assert client.get_experiment(client.create_experiment(name)).name == name

    (tmp_path / "file").write_text("")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path / "file")  # a cache folder that cannot be made
    _new_store(tmp_path / "c.db", counting)
    assert not (tmp_path / "c.db").exists() and len(made) == 1  # the sink then makes it in place
