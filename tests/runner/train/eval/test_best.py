"""eval.best (issue 36 point 7): the top-k evaluations' weights kept as exports (Lightning's
ModelCheckpoint), the export at the end the best one's (the Trainer's load_best_model_at_end), kept
right across --resume; and early stopping's reason never names a "best" worse than the last value."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.trainer import Trainer

# loss falls on this data, so with mode max the first evaluations are the best ones
BEST = ["train.steps=6", "train.scheduler={name: constant}", "output.checkpoint_every=2"]


def _evals(out):
    return [(r["step"], r["eval"]["loss"]) for r in read_metrics(out) if "eval" in r]


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("mode, keep", [("max", 2), ("min", 1), ("min", 3)])
def test_the_best_k_are_kept_and_the_export_is_the_best(tmp_path, ckrun, mode, keep):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *BEST, f"output.dir={tmp_path}",
                         f"eval={{every: 1, batches: 1, best: {{metric: loss, mode: {mode}, keep: {keep}}}}}")
    assert code == 0, err
    evals = _evals(tmp_path)
    ranked = sorted(evals, key=lambda e: (-e[1] if mode == "max" else e[1], e[0]))[:keep]
    kept = json.loads((tmp_path / "best" / "best.json").read_text())["kept"]
    assert [(e["step"], e["value"]) for e in kept] == ranked
    assert sorted(p.name for p in (tmp_path / "best").glob("step-*")) == sorted(f"step-{s:08d}" for s, _ in ranked)
    best = tmp_path / "best" / f"step-{ranked[0][0]:08d}"
    assert _same(_weights(tmp_path / "model"), _weights(best))
    assert (tmp_path / "model" / "recipe.yaml").read_text().startswith(f"# exported by ckrun after step {ranked[0][0]}:")
    if ranked[0][0] != 6:  # the last step's weights are another thing, kept in the final checkpoint
        assert (tmp_path / "checkpoints" / "step-00000006").is_dir()


def test_restore_off_exports_the_last_step(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *BEST, f"output.dir={tmp_path}",
                         "eval={every: 1, batches: 1, best: {metric: loss, mode: max, restore: false}}")
    assert code == 0, err
    assert (tmp_path / "model" / "recipe.yaml").read_text().startswith("# exported by ckrun after step 6:")
    assert not _same(_weights(tmp_path / "model"), _weights(tmp_path / "best" / "step-00000001"))


def test_after_a_resume_the_kept_weights_and_the_export_are_the_straight_runs(tmp_path, ckrun, monkeypatch):
    spec = "eval={every: 1, batches: 1, best: {metric: loss, mode: max, keep: 2}}"
    assert ckrun(BERT_TINY, *TINY_BERT, *BEST, f"output.dir={tmp_path / 'a'}", spec)[0] == 0
    real_step = Trainer.train_step

    def killed_in_step_4(trainer):
        if trainer.step == 3:
            raise KeyboardInterrupt  # the checkpoint of step 2; step 3's evaluation is made again
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", killed_in_step_4)
    assert ckrun(BERT_TINY, *TINY_BERT, *BEST, f"output.dir={tmp_path / 'b'}", spec)[0] == 130
    monkeypatch.undo()
    assert ckrun(BERT_TINY, *TINY_BERT, *BEST, f"output.dir={tmp_path / 'b'}", spec, "--resume")[0] == 0
    ranking = [json.loads((tmp_path / d / "best" / "best.json").read_text())["kept"] for d in "ab"]
    assert ranking[0] == ranking[1]
    assert _same(_weights(tmp_path / "a" / "model"), _weights(tmp_path / "b" / "model"))


def test_best_needs_evaluations_and_a_metric_they_report(ckrun):
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "eval={best: {keep: 2}}")
    assert code == 2 and "eval.every: eval.best needs evaluations during the run" in err, err
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "eval={every: 2, best: {metric: f1}}")
    assert code == 2 and "eval.best.metric: the evaluation reports loss and perplexity or accuracy, not 'f1'" in err


def test_the_early_stopping_reason_names_the_best_value_seen_under_min_delta():
    """A small improvement (under min_delta) still is the best; the reason never calls a worse value "best"."""
    from types import SimpleNamespace

    from ckrun.runner.train.eval.early_stop import EarlyStop

    stop = EarlyStop(SimpleNamespace(metric="loss", mode=None, patience=2, min_delta=0.5))
    losses = {5: 6.4, 10: 6.204, 15: 6.1, 20: 6.061}
    reasons = [stop.observe({"step": step, "eval": {"loss": loss}}) for step, loss in losses.items()]
    assert reasons[:2] == [None, None]
    assert reasons[2] is None or "best 6.1 at step 15" in reasons[2]
    final = next(r for r in reasons if r)
    assert "best 6.061 at step 20" in final or "best 6.1 at step 15" in final
    assert "6.204" not in final
