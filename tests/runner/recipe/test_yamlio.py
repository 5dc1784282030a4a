import pytest

from ckrun.runner.problems import InputError
from ckrun.runner.recipe.yamlio import apply_overrides, parse_document


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


# --- hostile files: each is refused with one located line, quickly -----------------------------


def alias_bomb(levels: int) -> str:
    """Each level is a list of 9 aliases of the previous one: 9**levels values from a few hundred bytes."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_it_expands():
    import time

    started = time.process_time()  # CPU seconds: what expanding would burn, and what no busy machine stretches
    (line,) = problems_of(alias_bomb(12))  # 9**12 = 282 billion values if built
    assert "values with aliases expanded" in line and line.startswith("r.yaml:")
    assert time.process_time() - started < 5


def test_aliases_within_the_limits_still_work():
    doc = parse_document("base: &b {lr: 0.1}\nmodel: {opt: *b}\n", "r.yaml")
    assert doc.data["model"]["opt"] == {"lr": 0.1}


def test_alias_to_its_own_container_is_refused():
    (line,) = problems_of("a: &a [1, *a]\n")
    assert line == "r.yaml:1:11: alias *a refers to a value that contains it"


def test_merge_keys_are_refused_in_one_line():
    (line,) = problems_of("base: &b {x: 1}\nmodel:\n  <<: *b\n  y: 2\n")
    assert line.startswith("r.yaml:3:3: model: merge keys (<<) are not supported")


def test_deep_nesting_is_refused_not_a_recursion_error():
    (line,) = problems_of("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert line.startswith("r.yaml:1:") and "nest deeper than" in line


def test_unclosed_quote_points_at_where_it_opened():
    (line,) = problems_of('a: 1\nb: "hello\nc: 2\nd: 3\n')
    assert line.startswith("r.yaml:2:4: invalid YAML: a quoted scalar starts here and is never closed")


@pytest.mark.parametrize("char", ["\x00", "\x01", "\x1b", "\x7f", "\ufffe"])
def test_control_characters_are_located(char):
    (line,) = problems_of(f"a: 1\nb: x{char}y\n")
    assert line.startswith("r.yaml:2:5:") and f"U+{ord(char):04X} is not allowed" in line and "\n" not in line


def test_non_utf8_bytes_and_oversized_files_are_refused(tmp_path):
    from ckrun.runner.recipe.yamlio import MAX_FILE_BYTES, load_document

    cases = {"latin1.yaml": b"a: 1\nb: caf\xe9\n", "big.yaml": b"a: 1\n" + b"#" * MAX_FILE_BYTES,
             "utf16.yaml": "a: 1\n".encode("utf-16")}
    expected = {"latin1.yaml": ":2:7: byte 0xe9 is not UTF-8", "big.yaml": ": the file is over 1 MiB",
                "utf16.yaml": ":1:1: the file is UTF-16"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(InputError) as caught:
            load_document(tmp_path / name)
        assert str(caught.value).startswith(f"{tmp_path / name}{expected[name]}"), str(caught.value)


@pytest.mark.parametrize("text, expected", [
    ("", "r.yaml:1:1: the file holds no recipe"), ("# only a comment\n", "r.yaml:1:1: the file holds no recipe"),
    ("- a\n- b\n", "r.yaml:1:1: a recipe must be a mapping"), ("just words\n", "r.yaml:1:1: a recipe must be a mapping"),
])
def test_a_top_level_that_is_not_a_mapping(text, expected):
    (line,) = problems_of(text)
    assert line.startswith(expected)


def test_keys_are_kept_as_typed():
    assert parse_document("on: 1\nnull: 2\n3: 4\n", "r.yaml").data == {"on": 1, "null": 2, "3": 4}


def test_control_characters_in_overrides_are_refused():
    doc = parse_document("a: 1\n", "r.yaml")
    with pytest.raises(InputError) as caught:
        apply_overrides(doc, ["a=1\x00", "b=x\ny: 2"])
    lines = [str(p) for p in caught.value.problems]
    assert lines == ["override 'a=1\\x00': a: control character U+0000 in an override; type the value on one line",
                     "override 'b=x\\ny: 2': b: control character U+000A in an override; type the value on one line"]
