"""The README's first commands, as a new user copies them (issue 36 point 1): the choice of torch's
build comes first (a CPU-only block naming PyTorch's CPU index, for those who can reach it), then the
tune block and the test block take torch from pip's own index, and CI runs the README's test command
word for word. Run with stub programs: nothing is installed."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ROOT

README = (ROOT / "README.md").read_text()
SETUP = README.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```\n(.*?)\n```", SETUP, re.S)
TUNE = next(block for block in BLOCKS if "ckrun tune" in block)
TESTS = next(block for block in BLOCKS if "pytest" in block)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# python3 -m venv .venv makes an activate script that puts stub pip, ckrun and python first on PATH;
# each stub writes its command line to calls.log
PYTHON3 = """#!/bin/sh
/bin/mkdir -p .venv/bin
for tool in pip ckrun python ruff; do
  printf '#!/bin/sh\\necho "%s $*" >> "$CALLS"\\n' "$tool" > .venv/bin/$tool
  /bin/chmod +x .venv/bin/$tool
done
echo 'PATH="$PWD/.venv/bin:$PATH"' > .venv/bin/activate
"""


def _run(block: str, tmp_path, gpu: bool) -> list[str]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "python3").write_text(PYTHON3)
    if gpu:
        (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    calls = tmp_path / "calls.log"
    done = subprocess.run(["/bin/bash", "-c", block], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": str(stubs), "CALLS": str(calls), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines()


def test_the_readme_chooses_torchs_build_then_tunes_then_tests():
    assert [block for block in BLOCKS if CPU_INDEX in block] == BLOCKS[:1]  # the choice comes first
    assert BLOCKS.index(TUNE) < BLOCKS.index(TESTS) and CPU_INDEX not in TUNE + TESTS


def test_the_cpu_block_installs_torch_and_torchvision_only_from_the_cpu_index(tmp_path):
    calls = _run(BLOCKS[0], tmp_path, gpu=False)
    assert calls == [f"pip install torch torchvision --index-url {CPU_INDEX}"]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu machine", "gpu machine"])
@pytest.mark.parametrize("which", ["tune", "tests"])
def test_the_install_takes_torch_from_pips_own_index(tmp_path, gpu, which):
    """No other index is named: where pip reaches only a mirror, PyTorch's CPU index is out of reach and
    pip's fallback was a CPU torch 2.13.0 that torchvision and transformers do not import beside."""
    calls = _run(TUNE if which == "tune" else TESTS, tmp_path, gpu)
    installs = [call for call in calls if call.startswith("pip install")]
    assert installs == (["pip install ."] if which == "tune" else ["pip install -e .[test]"])
    assert calls[-1].startswith("ckrun tune") if which == "tune" else calls[-1] == "ruff check ."


def test_ci_runs_the_readmes_test_command_word_for_word():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TESTS in lines
