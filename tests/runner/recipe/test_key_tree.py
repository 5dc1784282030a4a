"""A recipe key in the wrong place gets the place it belongs (issue 43): `optimizer.lr=1e-3` is `train.optimizer.lr`,
`steps` at the top `train.steps`, `train.lr` `train.optimizer.lr`. Generated over every key of the schema, written
with any part of its path left off."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import BERT_TINY
from ckrun.runner.recipe.key_tree import schema_paths

ROOT_KEYS = {path[0] for path in schema_paths()}
# every key written without the sections above it, whose first part is no top-level key (`data.seq_len` is one)
MISPLACED = sorted({path[cut:] for path in schema_paths() for cut in range(1, len(path)) if path[cut] not in ROOT_KEYS})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(written=st.sampled_from(MISPLACED))
def test_a_key_written_without_its_sections_is_pointed_to_where_it_belongs(written, ckrun):
    override = ".".join(written) + "=1"
    code, _, err = ckrun("validate", BERT_TINY, override)
    [line] = [line for line in err.splitlines() if line.startswith(f"override {override!r}: {written[0]}: unknown key")]
    assert code == 2 and " (did you mean " in line, line
    named = line.split(" (did you mean ", 1)[1].removesuffix("?)").split(" or ")
    owners = [tuple(name.split(".")) for name in named]
    assert all(owner in schema_paths() for owner in owners), named
    assert any(owner[-len(written):] == written or owner[-1] == written[0] for owner in owners), named
    whole = [path for path in schema_paths() if path[-len(written):] == written]
    if len(whole) == 1 and len({path[-1] for path in schema_paths() if path[-1] == written[0]}) == 1:
        assert named == [".".join(whole[0])], (named, whole)  # one place it can mean: that one


def test_the_issues_cases_and_a_misplaced_key_in_a_file(ckrun, tmp_path):
    for override, meant in [("optimizer.lr=1e-3", "train.optimizer.lr"), ("train.lr=1e-3", "train.optimizer.lr"),
                            ("steps=3", "train.steps"), ("micro_batch=2", "memory.micro_batch")]:
        code, _, err = ckrun("validate", BERT_TINY, override)
        assert code == 2 and err.strip().endswith(f"unknown key (did you mean {meant}?)"), err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(BERT_TINY).read() + "seed: 3\n")
    code, _, err = ckrun("validate", str(recipe))
    assert code == 2 and "seed: unknown key (did you mean train.seed?)" in err, err
    code, _, err = ckrun("validate", BERT_TINY, "train.stpes=3")  # a sibling it is a typo of comes first
    assert code == 2 and "train.stpes: unknown key (did you mean steps?)" in err, err
