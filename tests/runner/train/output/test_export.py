"""Weights out, always: every run ends with its final state saved and its model exported to
OUTPUT_DIR/model, which `model.pretrained` loads back to the very same outputs."""

import pytest
import torch

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.sources import build_data
from ckrun.runner.builders.model import build_model
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.step import call_model

TORCHVISION = ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 10}",
               "data.image_size=32", "train.batch_size=4", "train.device=cpu"]
PYTHON = ["model={source: python, name: 'user_models:tied_lm', config: {vocab_size: 64, width: 16}}",
          "data={source: synthetic, task: causal_lm, seq_len: 16}", "train.batch_size=4", "train.device=cpu"]
SOURCES = {"transformers": TINY_BERT, "torchvision": TORCHVISION, "python": PYTHON}
EXPORTED = {"transformers": {"config.json", "model.safetensors", "recipe.yaml", "inputs.json"},
            "torchvision": {"model.safetensors", "recipe.yaml", "inputs.json"},
            "python": {"model.safetensors", "recipe.yaml", "inputs.json"}}


def _outputs(model, recipe) -> torch.Tensor:
    model.eval()  # dropout off: outputs are a function of the weights alone
    with torch.no_grad():
        return call_model(model, build_data(recipe, model).global_batch(0))


@pytest.mark.parametrize("source", SOURCES)
def test_the_export_and_the_final_checkpoint_reload_to_identical_outputs(tmp_path, ckrun, source):
    args, out = SOURCES[source], tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *args, "train.steps=3", "output.checkpoint_every=2", f"output.dir={out}")
    assert code == 0, err
    assert {p.name for p in (out / "model").iterdir()} == EXPORTED[source]
    final = out / "checkpoints" / "step-00000003"  # saved although checkpoint_every does not divide 3
    trained = build_model(load_recipe(BERT_TINY, args).model)
    trained.load_state_dict(torch.load(final / "state.pt", weights_only=True)["model"])
    recipe = load_recipe(BERT_TINY, args)
    expected = _outputs(trained, recipe)
    assert not torch.equal(_outputs(build_model(recipe.model), recipe), expected)  # training moved the weights
    for directory in (out / "model", final):
        reloaded = build_model(load_recipe(BERT_TINY, [*args, f"model.pretrained={directory}"]).model)
        assert torch.equal(_outputs(reloaded, recipe), expected), directory
        for key, value in trained.state_dict().items():  # buffers too: BatchNorm's running statistics
            assert torch.equal(reloaded.state_dict()[key], value), key


def test_a_run_started_from_an_export_starts_exactly_where_the_first_ended(tmp_path, ckrun):
    """Through the CLI alone: the second run's first update is too small to move any fp32 weight
    (SGD at lr 1e-45), so its evaluation must equal the first run's final one, bit for bit."""
    common = [BERT_TINY, *TINY_BERT, "eval={batches: 2}"]
    assert ckrun(*common, "train.steps=3", f"output.dir={tmp_path / 'first'}")[0] == 0
    frozen = "train.optimizer={name: sgd, lr: 1e-45, momentum: 0.0}"
    code, _, err = ckrun(*common, "train.steps=1", frozen, f"model.pretrained={tmp_path / 'first' / 'model'}",
                         f"output.dir={tmp_path / 'second'}")
    assert code == 0, err
    first = [m["eval"] for m in read_metrics(tmp_path / "first") if "eval" in m][-1]
    second = [m["eval"] for m in read_metrics(tmp_path / "second") if "eval" in m][-1]
    assert second["loss"] == first["loss"] and second["perplexity"] == first["perplexity"]


def test_the_tokenizer_of_text_data_is_exported_beside_the_weights(tmp_path, ckrun):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = "the quick brown fox jumps over the lazy dog . " * 30
    (tmp_path / "corpus.txt").write_text(text)
    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[MASK]"]))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                            mask_token="[MASK]").save_pretrained(str(tmp_path / "tokenizer"))
    data = f"data={{source: text, paths: [{tmp_path / 'corpus.txt'}], tokenizer: {tmp_path / 'tokenizer'}, seq_len: 16}}"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, data, "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "run" / "model"), local_files_only=True)
    original = AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"), local_files_only=True)
    assert exported("the lazy fox")["input_ids"] == original("the lazy fox")["input_ids"]


@pytest.mark.parametrize("steps, every, kept", [(5, 0, [5]), (5, 2, [4, 5]), (4, 2, [2, 4]), (1, 3, [1])])
def test_the_last_step_is_always_checkpointed(tmp_path, ckrun, steps, every, kept):
    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"train.steps={steps}", f"output.checkpoint_every={every}",
                         f"output.dir={out}")
    assert code == 0, err
    assert sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir()) == kept


def test_a_finished_run_continues_with_more_steps_exactly(tmp_path, ckrun):
    # a constant rate: a cosine schedule's rates depend on train.steps, so they would differ
    common = [BERT_TINY, *TINY_BERT, "train.scheduler={name: constant}"]  # dropout stays on
    assert ckrun(*common, "train.steps=5", f"output.dir={tmp_path / 'straight'}")[0] == 0
    assert ckrun(*common, "train.steps=3", f"output.dir={tmp_path / 'grown'}")[0] == 0
    code, _, err = ckrun(*common, "train.steps=5", f"output.dir={tmp_path / 'grown'}", "--resume")
    assert code == 0, err
    assert [m["loss"] for m in read_metrics(tmp_path / "grown")] == [m["loss"] for m in read_metrics(tmp_path / "straight")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One finished run per source, shared by the bad-input cases below."""
    from ckrun.runner.cli import main

    root = tmp_path_factory.mktemp("exports")
    for source, args in SOURCES.items():
        assert main([BERT_TINY, *args, "train.steps=1", f"output.dir={root / source}"]) == 0
    return root


WRONG_DIRECTORIES = [  # (recipe overrides, directory under the exports, what the one line says)
    (TORCHVISION, "empty", "holds no model.safetensors or .pt/.pth/.bin state dict"),
    (TINY_BERT, "empty", "holds no config.json; give a directory written by save_pretrained"),
    (TORCHVISION, "transformers/model", "was exported from transformers model BertForMaskedLM, but this recipe builds "
                                        "torchvision model resnet18"),
    (PYTHON, "torchvision/model", "was exported from torchvision model resnet18, but this recipe builds python"),
    ([*TORCHVISION, "model.name=resnet34"], "torchvision/model", "was exported from torchvision model resnet18"),
    # another transformers class of the same architecture is fine (a classifier from a masked LM); another
    # architecture is not, told by config.json's model_type, with or without ckrun's recipe.yaml
    (["model.name=GPT2LMHeadModel", "model.config={n_layer: 1}"], "transformers/model",
     "holds a 'bert' model, but GPT2LMHeadModel needs 'gpt2' weights"),
    (["model.name=GPT2LMHeadModel", "model.config={n_layer: 1}"], "bert-without-recipe",
     "holds a 'bert' model, but GPT2LMHeadModel needs 'gpt2' weights"),
]


@pytest.mark.parametrize("overrides, directory, message", WRONG_DIRECTORIES)
def test_a_directory_that_cannot_fit_is_one_line_at_validation(exports, ckrun, overrides, directory, message):
    (exports / "empty").mkdir(exist_ok=True)
    bare = exports / "bert-without-recipe"
    if not bare.exists():
        bare.mkdir()
        for name in ("config.json", "model.safetensors"):
            (bare / name).write_bytes((exports / "transformers" / "model" / name).read_bytes())
    code, _, err = ckrun("validate", BERT_TINY, *overrides, f"model.pretrained={exports / directory}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.pretrained: " in err, err
    assert message in err


@pytest.mark.parametrize("source, change, message", [
    ("torchvision", "model.config={num_classes: 5}", "does not fit the model: size mismatch for fc.weight"),
    ("transformers", "model.config.hidden_size=64", "does not fit the model: 39 tensors differ in shape, e.g. "),
    ("python", "model.config.width=8", "does not fit the model: size mismatch for "),
])
def test_weights_of_another_shape_are_one_line_at_build(exports, ckrun, tmp_path, source, change, message):
    code, _, err = ckrun(BERT_TINY, *SOURCES[source], change, f"model.pretrained={exports / source / 'model'}",
                         "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "model.pretrained: " in err and message in err, err


def test_a_model_folder_of_the_users_is_refused_at_the_start_and_never_deleted(tmp_path, ckrun):
    # the export used to replace OUTPUT_DIR/model whatever it held, when the directory held no earlier run
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "notes.txt").write_text("the user's\n")
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={out}")
    assert code == 2 and err.strip().endswith(f"output.dir: {out / 'model'} is not a model ckrun exported, and the run "
                                              "exports its model there; move it, or choose another directory with "
                                              "output.dir=..."), err
    assert (out / "model" / "notes.txt").read_text() == "the user's\n"
    (out / "model" / "notes.txt").unlink()
    (out / "model").rmdir()
    (out / "model").symlink_to(tmp_path)  # a link out of the run: refused the same, not followed
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={out}")[0] == 2


def test_a_model_folder_that_appears_during_the_run_is_kept(tmp_path, caplog):
    from ckrun.runner.train.output.export import export_model

    recipe = load_recipe(BERT_TINY, TINY_BERT)
    model = build_model(recipe.model)
    earlier = export_model(model, recipe, tmp_path / "model", step=1)  # ckrun's own: replaced by the next export
    assert export_model(model, recipe, tmp_path / "model", step=2) == earlier
    assert (earlier / "recipe.yaml").read_text().startswith("# exported by ckrun after step 2")
    (tmp_path / "model").rename(tmp_path / "elsewhere")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.txt").write_text("the user's\n")
    assert export_model(model, recipe, tmp_path / "model", step=3) == tmp_path / "model-2"
    assert (tmp_path / "model" / "notes.txt").read_text() == "the user's\n"
    assert "is not a model ckrun exported (it appeared during the run): left as it is" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "model", "model-2"]  # no temporary left
