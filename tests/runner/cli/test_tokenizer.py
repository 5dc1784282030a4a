"""`ckrun tokenizer`'s inputs and output of every kind: text, empty files, folders named outright or matched by
a wildcard, FIFOs, devices, missing paths and links to nothing; an output that is absent, an empty or full
folder, a file, a FIFO, a device, under a file, or a link to nothing or to itself. Each call ends in a
tokenizer of exactly the size asked for (status 0) or in one line naming the argument (status 2), never an
internal error, never a read of a FIFO or a device (which would never end), never a half-written folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings, strategies as st

from ckrun.runner.builders.tokenizer_facts import tokenizer_facts
from ckrun.runner.cli import main
from conftest import time_limit

SPECIAL_INPUTS = ("empty folder named", "fifo", "/dev/zero", "/dev/null", "missing", "link to nothing", "link to fifo")
INPUTS = ("text", "empty file", "folder by wildcard", *SPECIAL_INPUTS)
GOOD_OUTPUTS = ("absent", "absent, nested", "empty folder", "full folder, --force")
OUTPUTS = (*GOOD_OUTPUTS, "full folder", "file", "fifo", "/dev/null", "under a file", "link to nothing", "link to itself")
# text repeated, so that pairs recur and the merges reach the size asked for
text = st.builds(lambda words, times: " ".join(words) * times,
                 st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12), max_size=20),
                 st.integers(1, 40))


def _input(kind: str, folder: Path, index: int, content: str) -> str:
    path = folder / f"in{index}"
    if kind in ("text", "empty file"):
        path.write_text(content if kind == "text" else "", encoding="utf-8")
    elif kind in ("folder by wildcard", "empty folder named"):
        path.mkdir()
        if kind == "folder by wildcard":
            (path / "a.txt").write_text(content, encoding="utf-8")
            (path / "sub").mkdir()  # a folder the wildcard matches too: passed over
            return str(path / "*")
    elif kind in ("fifo", "link to fifo"):
        os.mkfifo(folder / f"fifo{index}")
        if kind == "link to fifo":
            os.symlink(folder / f"fifo{index}", path)
        return str(path if kind == "link to fifo" else folder / f"fifo{index}")
    elif kind == "link to nothing":
        os.symlink(folder / "gone", path)
    elif kind.startswith("/dev/"):
        return kind
    return str(path)


def _output(kind: str, folder: Path) -> tuple[str, list[str]]:
    path = folder / "tok"
    if kind.startswith("full folder") or kind == "empty folder":
        path.mkdir()
        if kind != "empty folder":
            (path / "mine.txt").write_text("the user's")
    elif kind == "file":
        path.write_text("the user's")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "under a file":
        path.write_text("the user's")
        path = path / "tok"
    elif kind.startswith("link to"):
        os.symlink(path if kind == "link to itself" else folder / "gone", path)
    elif kind == "/dev/null":
        return kind, []
    elif kind == "absent, nested":
        path = folder / "new" / "tok"
    return str(path), ["--force"] if kind.endswith("--force") else []


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=st.lists(st.tuples(st.sampled_from(INPUTS), text), min_size=1, max_size=3),
       output=st.sampled_from(OUTPUTS), vocab_size=st.one_of(st.integers(258, 270), st.integers(200, 330)),
       min_frequency=st.one_of(st.integers(1, 2), st.integers(-1, 3)))
def test_every_input_and_output_ends_in_the_tokenizer_asked_for_or_one_line(inputs, output, vocab_size, min_frequency,
                                                                           tmp_path_factory, capsys):
    folder = tmp_path_factory.mktemp("tok")
    paths = [_input(kind, folder, index, content) for index, (kind, content) in enumerate(inputs)]
    out, flags = _output(output, folder)
    before = sorted(p.name for p in folder.iterdir())
    with time_limit(120, "ckrun tokenizer (a FIFO or device read?)"):
        code = main(["tokenizer", *paths, "--out", out, "--vocab-size", str(vocab_size),
                     "--min-frequency", str(min_frequency), *flags])
    said = capsys.readouterr()
    assert code in (0, 2) and "internal error" not in said.err, said.err
    if output not in GOOD_OUTPUTS:
        assert code == 2 and said.err.startswith("ckrun tokenizer: --out: "), (output, said.err)
    elif any(kind in SPECIAL_INPUTS for kind, _ in inputs):
        assert code == 2 and "paths: " in said.err or "--vocab-size: " in said.err or "--min-frequency: " in said.err, said
    if code == 2:
        assert said.out == "" and len(said.err.splitlines()) == 1, said.err
        if output in ("absent", "absent, nested"):
            assert sorted(p.name for p in folder.iterdir()) == before  # nothing made
        return
    event("trained")
    assert output in GOOD_OUTPUTS and all(kind not in SPECIAL_INPUTS for kind, _ in inputs)
    assert tokenizer_facts(out).size == vocab_size and f"wrote {out}: {vocab_size} tokens" in said.out


def test_an_empty_corpus_is_refused_not_written_with_fewer_tokens(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("ab ab ab")
    for corpus, said in [("empty.txt", r"empty.txt holds no text \(0 bytes\)"),
                         ("short.txt", r"short.txt gives (\d+) tokens, not 300 .* or --vocab-size \1$")]:
        code = main(["tokenizer", str(tmp_path / corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "300"])
        err = capsys.readouterr().err
        assert code == 2 and re.search(said, err.strip()) and not (tmp_path / "tok").exists(), err
