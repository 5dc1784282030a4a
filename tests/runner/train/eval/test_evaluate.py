"""Evaluation on held-out data: its own records in metrics.jsonl, and training exactly as without it."""

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.cli import main
from ckrun.runner.train.trainer import Trainer

MODELS = {  # dropout, BatchNorm, random draws in eval mode: each a way for evaluation to leak into training
    "cnn": ["model={source: python, name: 'user_models:small_cnn', config: {num_classes: 4}}",
            "data={source: synthetic, task: image_classification, image_size: 8, num_classes: 4}"],
    "lm": ["model={source: python, name: 'user_models:tied_lm', config: {vocab_size: 64, width: 16}}",
           "data={source: synthetic, task: causal_lm, seq_len: 16}"],
    "noisy-lm": ["model={source: python, name: 'user_models:tied_lm', config: {vocab_size: 64, noise: 0.01}}",
                 "data={source: synthetic, task: causal_lm, seq_len: 16}"],
}


def _split(out: Path) -> tuple[list[dict], list[dict]]:
    records = read_metrics(out)
    return [r for r in records if "eval" not in r], [r for r in records if "eval" in r]


def _weights(out: Path) -> dict:
    return load_file(str(out / "model" / "model.safetensors"))


_baselines: dict = {}


def _baseline(root: Path, settings_: tuple) -> tuple[list[float], dict]:
    """Losses and final weights of the run without evaluation, once per setting."""
    if settings_ not in _baselines:
        out = root / f"plain-{len(_baselines)}"
        assert main([BERT_TINY, *settings_, f"output.dir={out}"]) == 0
        _baselines[settings_] = ([r["loss"] for r in _split(out)[0]], _weights(out))
    return _baselines[settings_]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(sorted(MODELS)), every=st.integers(0, 4), batches=st.integers(1, 3),
       micro=st.sampled_from(["null", "2"]), precision=st.sampled_from(["fp32", "bf16"]))
def test_evaluation_never_changes_training(tmp_path_factory, model, every, batches, micro, precision):
    """Losses and final weights (BatchNorm statistics included) bit-identical with and without it."""
    common = (*MODELS[model], "train.batch_size=4", "train.steps=4", "train.device=cpu", f"memory.micro_batch={micro}",
              f"precision={precision}")
    plain_losses, plain_weights = _baseline(tmp_path_factory.getbasetemp(), common)
    out = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())) / "run"
    assert main([BERT_TINY, *common, f"eval={{every: {every}, batches: {batches}}}", f"output.dir={out}"]) == 0
    steps, evals = _split(out)
    assert [r["loss"] for r in steps] == plain_losses
    weights = _weights(out)
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)
    assert [r["step"] for r in evals] == sorted({s for s in range(1, 5) if every and s % every == 0} | {4})
    metric = "accuracy" if model == "cnn" else "perplexity"
    assert all(set(r["eval"]) == {"loss", metric, "samples", "time_s"} and r["eval"]["samples"] == 4 * batches
               for r in evals)


def test_evaluation_under_checkpointing_with_dropout_leaves_bert_training_alone(tmp_path, ckrun):
    common = [BERT_TINY, *TINY_BERT, "train.steps=4", "memory.checkpointing={policy: full}"]  # dropout on
    assert ckrun(*common, f"output.dir={tmp_path / 'plain'}")[0] == 0
    code, _, err = ckrun(*common, "eval={every: 1, batches: 2}", f"output.dir={tmp_path / 'eval'}")
    assert code == 0, err
    assert [r["loss"] for r in _split(tmp_path / "eval")[0]] == [r["loss"] for r in _split(tmp_path / "plain")[0]]
    evals = [r["eval"] for r in _split(tmp_path / "eval")[1]]
    assert len(evals) == 4 and all(e["perplexity"] == pytest.approx(math.exp(e["loss"])) for e in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]  # held-out data of the same distribution: it learns


def test_the_last_step_is_evaluated_once(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", "eval={every: 2, batches: 2}", f"output.dir={tmp_path}")
    assert code == 0, err
    records = _split(tmp_path)[1]
    assert [r["step"] for r in records] == [2]


def test_resume_with_evaluation_is_exact(tmp_path, ckrun, monkeypatch):
    common = [BERT_TINY, *TINY_BERT, "train.steps=9", "output.checkpoint_every=4", "eval={every: 3, batches: 2}"]
    assert ckrun(*common, f"output.dir={tmp_path / 'straight'}")[0] == 0
    real_step = Trainer.train_step

    def killed_during_step_7(trainer):
        if trainer.step == 6:
            raise KeyboardInterrupt  # after step 6 and its evaluation: both are past the checkpoint of step 4
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", killed_during_step_7)
    assert ckrun(*common, f"output.dir={tmp_path / 'broken'}")[0] == 130
    monkeypatch.undo()
    code, _, err = ckrun(*common, f"output.dir={tmp_path / 'broken'}", "--resume")
    assert code == 0, err

    def values(out):
        return [(r["step"], r["eval"]["loss"]) if "eval" in r else (r["step"], r["loss"]) for r in read_metrics(out)]
    assert values(tmp_path / "broken") == values(tmp_path / "straight")


def test_file_data_needs_held_out_files(tmp_path, ckrun):
    (tmp_path / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "valid.txt").write_text("a lazy dog sleeps while the quick fox runs away. " * 20)
    text = ["data={source: text, paths: [" + str(tmp_path / "train.txt") + "], seq_len: 32}"]
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, *text, "eval={every: 2}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "eval.data: data.source text has no held-out stream; name held-out files in eval.data" in err
    held_out = "eval={every: 2, data: {source: text, paths: [" + str(tmp_path / "valid.txt") + "], seq_len: 32}}"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *text, held_out, "train.steps=4", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert [r["step"] for r in _split(tmp_path / "run")[1]] == [2, 4]


def test_missing_held_out_files_are_one_line_naming_the_eval_key(tmp_path, ckrun):
    held_out = "eval={data: {source: text, paths: [" + str(tmp_path / "nothing*.txt") + "], seq_len: 32}}"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, held_out, "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and err.strip().splitlines()[-1].endswith(f"eval.data.paths: no files match {tmp_path}/nothing*.txt")
