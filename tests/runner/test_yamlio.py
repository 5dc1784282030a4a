import pytest

from runner.problems import InputError
from runner.yamlio import apply_overrides, parse_document


def problems_of(text: str) -> list[str]:
    with pytest.raises(InputError) as caught:
        parse_document(text, "r.yaml")
    return [str(p) for p in caught.value.problems]


def test_keeps_line_and_column_of_every_key():
    doc = parse_document("a:\n  b: 1\n  c: [x, y]\n", "r.yaml")
    assert doc.data == {"a": {"b": 1, "c": ["x", "y"]}}
    assert (doc.places[("a", "b")].line, doc.places[("a", "b")].col) == (2, 3)
    assert doc.places[("a", "c", 1)].line == 3


def test_scientific_notation_without_a_dot_is_a_float():
    assert parse_document("lr: 1e-4\nx: 3E5\n", "r.yaml").data == {"lr": 1e-4, "x": 3e5}


def test_duplicate_keys_are_all_reported_with_the_first_line():
    found = problems_of("a: 1\nb: 2\na: 3\nb: 4\n")
    assert found == ["r.yaml:3:1: a: duplicate key (first set at line 1)", "r.yaml:4:1: b: duplicate key (first set at line 2)"]


def test_python_tags_are_refused_not_constructed():
    found = problems_of("model: !!python/object/apply:os.system ['echo hi']\n")
    assert len(found) == 1 and "tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed" in found[0]


def test_syntax_error_points_at_its_line():
    (line,) = problems_of("a: 1\nb: [1, 2\nc: 3\n")
    assert line.startswith("r.yaml:") and "invalid YAML" in line


def test_overrides_parse_values_as_yaml_and_record_where_they_came_from():
    doc = parse_document("train:\n  steps: 5\n", "r.yaml")
    new = apply_overrides(doc, ["train.steps=10", "memory.checkpointing={policy: every, every: 2}"])
    assert new.data["train"]["steps"] == 10 and doc.data["train"]["steps"] == 5
    assert new.data["memory"]["checkpointing"] == {"policy": "every", "every": 2}
    assert str(new.place_of(("train", "steps"))) == "override 'train.steps=10'"


def test_malformed_override_is_a_problem():
    doc = parse_document("a: 1\n", "r.yaml")
    with pytest.raises(InputError) as caught:
        apply_overrides(doc, ["novalue"])
    assert "dotted.key=value" in str(caught.value)
