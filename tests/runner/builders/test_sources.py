"""One model from each source, and real local data, build and train through the CLI."""

import textwrap

import torch

from conftest import BERT_TINY, TINY_BERT, read_metrics

RESNET = ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 10}", "model.pretrained=null",
          "data.image_size=32", "train.batch_size=4", "train.device=cpu"]


def _train(ckrun, out, *args):
    code, _, err = ckrun(BERT_TINY, *args, "train.steps=2", f"output.dir={out}")
    assert code == 0, err
    metrics = read_metrics(out)
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)
    return metrics


def test_transformers_model_trains(tmp_path, ckrun):
    _train(ckrun, tmp_path / "bert", *TINY_BERT)


def test_torchvision_model_trains(tmp_path, ckrun):
    _train(ckrun, tmp_path / "resnet", *RESNET)


def test_python_import_path_model_trains(tmp_path, ckrun, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        def tiny_cnn(width=8, num_classes=10):
            return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(width, num_classes))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    _train(ckrun, tmp_path / "py", "model.source=python", "model.name=my_models:tiny_cnn",
           "model.config={width: 4, num_classes: 10}", "data.task=image_classification", "data.image_size=16",
           "train.batch_size=4", "train.device=cpu")


def test_factory_argument_typo_is_one_line(tmp_path, ckrun, monkeypatch):
    (tmp_path / "my_models2.py").write_text("import torch.nn as nn\ndef net(width=8):\n    return nn.Linear(width, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = ckrun(BERT_TINY, "model.source=python", "model.name=my_models2:net", "model.config={widht: 3}",
                         "data.task=image_classification", f"output.dir={tmp_path / 'x'}")
    assert code == 2 and "model.config.widht: net takes no argument 'widht' (did you mean width?)" in err


def test_local_text_files_train_a_masked_lm(tmp_path, ckrun):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    _train(ckrun, tmp_path / "text", *TINY_BERT, "data={source: text, paths: [" + str(corpus) + "/*.txt], seq_len: 32}")


def test_local_image_folder_trains_a_resnet(tmp_path, ckrun):
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(3):
            colour = (200, 30 * i, 0) if label == "cat" else (0, 30 * i, 200)
            Image.new("RGB", (40, 40), colour).save(tmp_path / "images" / label / f"{i}.png")
    metrics = _train(ckrun, tmp_path / "folder", *RESNET,
                     "data={source: image_folder, root: " + str(tmp_path / "images") + ", image_size: 32}")
    assert len(metrics) == 2


def test_local_safetensors_weights_are_loaded(tmp_path, ckrun, monkeypatch):
    import torchvision
    from safetensors.torch import save_file

    weights = tmp_path / "weights"
    weights.mkdir()
    model = torchvision.models.resnet18(num_classes=10)
    torch.nn.init.constant_(model.fc.bias, 0.25)
    save_file(model.state_dict(), str(weights / "model.safetensors"))
    from ckrun.runner.builders.model import build_model
    from ckrun.runner.recipe.load import load_recipe

    recipe = load_recipe(BERT_TINY, [*RESNET, f"model.pretrained={weights}"])
    built = build_model(recipe.model)
    assert torch.equal(built.fc.bias, torch.full((10,), 0.25))


def test_no_text_files_matching_is_one_line(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "data={source: text, paths: [" + str(tmp_path) + "/*.txt], seq_len: 32}",
                         f"output.dir={tmp_path / 'x'}")
    assert code == 2 and len(err.splitlines()) == 1 and "data.paths: no files match" in err


def test_one_mistyped_name_among_the_paths_is_refused_not_left_out(tmp_path, ckrun):
    (tmp_path / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    paths = f"[{tmp_path}/train.txt, {tmp_path}/trian.txt]"  # the second mistyped: training on the first alone is silent
    for verb in (["validate"], []):
        code, out, err = ckrun(*verb, BERT_TINY, *TINY_BERT, "data={source: text, paths: " + paths + ", seq_len: 32}",
                               "train.steps=1", f"output.dir={tmp_path / 'x'}")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"data.paths: no files match {tmp_path}/trian.txt (one of 2 paths" in err and not (tmp_path / "x").exists()
