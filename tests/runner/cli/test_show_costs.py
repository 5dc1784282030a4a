"""`ckrun show RECIPE --costs`: each block's bytes per choice and its recompute time, through the CLI."""

from __future__ import annotations

import json

from conftest import BERT_TINY, TINY_BERT


def test_costs_as_json_one_entry_per_block(ckrun):
    code, out, err = ckrun("show", BERT_TINY, *TINY_BERT, "model.config.num_hidden_layers=3", "--costs", "--json")
    assert code == 0, err
    table = json.loads(out)
    assert (table["micro_batch"], table["precision"], table["device"]) == (8, "fp32", "cpu")
    assert [b["index"] for b in table["blocks"]] == [0, 1, 2]
    for block in table["blocks"]:
        # recomputing keeps only what the block hands on; selective keeps more, keeping all keeps most
        assert 0 < block["recompute_bytes"] < block["selective_bytes"] < block["keep_bytes"]
        assert block["recompute_s"] >= 0 and block["selective_s"] >= 0
        assert block["offload_bytes"] is None  # a CPU run cannot offload
    assert table["full_peak"] < table["none_peak"]
    assert table["base_bytes"] + sum(b["keep_bytes"] for b in table["blocks"]) == table["none_peak"]


def test_costs_table_and_a_bad_block_path_in_one_line(ckrun):
    code, out, _ = ckrun("show", BERT_TINY, *TINY_BERT, "memory.micro_batch=4", "--costs")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("micro_batch 4, fp32, cpu:")
    assert lines[1].split()[:4] == ["block", "name", "keep", "recompute"]
    assert sum(1 for line in lines if "bert.encoder.layer." in line) == 2
    code, out, err = ckrun("show", BERT_TINY, *TINY_BERT, "memory.blocks=bert.nothing", "--costs")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "memory.blocks" in err
