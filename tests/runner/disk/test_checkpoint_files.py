"""--resume trusts only what the run wrote: no link is followed out of a checkpoint (state.pt -> /dev/zero
hung the digest forever), and a checkpoint whose marker predates digests is checked by the CRC-32
of every record of torch's zip archive (flipped weight bytes resumed silently)."""

from __future__ import annotations

import logging
import os
import zipfile

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics

RUN = [BERT_TINY, *TINY_BERT, "output.checkpoint_every=1"]


@pytest.fixture
def two_checkpoints(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=2", f"output.dir={out}")[0] == 0
    return out, out / "checkpoints" / "step-00000002"


def _resume(ckrun, out, caplog):
    with caplog.at_level(logging.INFO):
        code, _, err = ckrun(*RUN, "train.steps=3", f"output.dir={out}", "--resume")
    assert code == 0, err
    return caplog.text


def _old_marker(checkpoint):
    (checkpoint / "COMPLETE").write_text("2\n")  # as ckrun wrote markers before it recorded sha256


def _flip_a_weight_byte(state_file):
    with zipfile.ZipFile(state_file) as archive:
        weights = max(archive.infolist(), key=lambda info: info.file_size)
        start = weights.header_offset + 30 + len(weights.filename.encode()) + len(weights.extra)
    data = bytearray(state_file.read_bytes())
    data[start + weights.file_size // 2] ^= 0x40
    state_file.write_bytes(bytes(data))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["state.pt", "COMPLETE"])
def test_a_file_linked_out_of_a_checkpoint_is_not_followed(two_checkpoints, ckrun, name, caplog):
    out, newest = two_checkpoints
    (newest / name).unlink()
    os.symlink("/dev/zero", newest / name)
    log = _resume(ckrun, out, caplog)
    if name == "state.pt":
        assert "step-00000002: state.pt is a symbolic link" in log and "resuming from step-00000001 instead" in log
    else:  # a marker that is no file marks nothing complete
        assert "resuming from" in log and "step-00000001" in log
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]  # step 2 again, from step 1's state


def test_a_linked_step_directory_is_not_a_checkpoint(two_checkpoints, ckrun, tmp_path, caplog):
    out, newest = two_checkpoints
    newest.rename(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", newest)
    assert "step-00000002 is a symbolic link, not a checkpoint this run wrote" in _resume(ckrun, out, caplog)
    assert (tmp_path / "elsewhere" / "state.pt").is_file()  # the new step 2 replaced the link, not its target
    assert not newest.is_symlink()


def test_an_old_marker_is_checked_by_the_archives_crcs(two_checkpoints, ckrun, caplog):
    out, newest = two_checkpoints
    _old_marker(newest)
    _flip_a_weight_byte(newest / "state.pt")
    err = _resume(ckrun, out, caplog)
    assert "step-00000002: state.pt is damaged (its record" in err and "fails its CRC-32" in err


def test_an_old_marker_over_a_whole_file_still_resumes(two_checkpoints, ckrun, caplog):
    out, newest = two_checkpoints
    _old_marker(newest)
    assert "resuming from" in _resume(ckrun, out, caplog) and (out / "checkpoints" / "step-00000003").is_dir()
    assert not (out / "checkpoints" / "damaged-step-00000002").exists()
