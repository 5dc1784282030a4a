"""`ckrun report RUN_DIR`: a run's curves drawn to a PNG, also mid-run, and one line when there is nothing to draw."""

from __future__ import annotations

from PIL import Image

from conftest import BERT_TINY, TINY_BERT


def test_report_draws_a_runs_curves(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=4", "eval={every: 2, batches: 1}", f"output.dir={out}")[0] == 0
    with (out / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 5, "loss": 1.')  # a run killed mid-line: still reported
    code, stdout, err = ckrun("report", out)
    assert code == 0, err
    assert stdout.startswith("steps 1..4: loss ") and "eval at step 4: loss " in stdout and "perplexity" in stdout
    assert stdout.splitlines()[-1] == f"curves: {out / 'curves.png'}"
    with Image.open(out / "curves.png") as picture:
        assert picture.format == "PNG" and picture.size[0] > 500 and picture.size[1] > 300
        picture.verify()  # the whole file decodes


def test_report_of_a_directory_with_nothing_to_draw(tmp_path, ckrun):
    code, _, err = ckrun("report", tmp_path)
    assert code == 2 and err == f"{tmp_path}: holds no run (no metrics.jsonl) and no study (no study.journal); " \
                                "give a run's output.dir, or the directory `ckrun tune` wrote\n"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "eval": {"loss": 2.0}}\n')
    code, _, err = ckrun("report", tmp_path)
    assert code == 2 and err.splitlines() == [f"{tmp_path / 'metrics.jsonl'}: holds no training steps yet; report it once a step is done"]
