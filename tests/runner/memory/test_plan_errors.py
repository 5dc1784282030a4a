"""Plan mistakes that only the built model can reveal: one line naming the key, exit 2."""

import pytest

from conftest import BERT_TINY, TINY_BERT

CASES = [
    (["memory.checkpointing={policy: layers, layers: [7]}"],
     "memory.checkpointing.layers: block 7 is out of range; the model has 2 blocks (0-1)"),
    (["memory.offload={policy: all}"], "memory.offload: activation offload moves activations"),
    (["memory.blocks=bert.encoder.layr", "memory.checkpointing={policy: full}"],
     "memory.blocks: BertForMaskedLM has no module 'bert.encoder.layr' (did you mean bert.encoder.layer?)"),
    (["model.source=python", "model.name=torch.nn:Linear", "model.config={in_features: 4, out_features: 2}",
      "data.task=image_classification", "memory.checkpointing={policy: full}"],
     "memory.blocks: found no repeated blocks in Linear"),
]


@pytest.mark.parametrize("overrides, expected", CASES, ids=["layer-range", "offload-cpu", "block-path", "no-blocks"])
def test_plan_error_is_one_line(tmp_path, ckrun, overrides, expected):
    code, out, err = ckrun(BERT_TINY, *TINY_BERT, *overrides, f"output.dir={tmp_path / 'r'}")
    lines = err.splitlines()
    # placed where the key was set: the override that set it, else its line in the file
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert lines[0].startswith((f"override '{overrides[0]}': ", f"{BERT_TINY}:")), lines[0]
