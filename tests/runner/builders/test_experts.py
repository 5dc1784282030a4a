"""Mixture-of-experts models pass the checks their training passes: validate in fp32 and bf16, with
transformers' public implementation keywords, and torch's grouped kernel answered on fake fp32
tensors as the real kernel answers."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from ckrun.runner.builders.experts import GroupedMmOnFake
from tests.runner.memory.moe_models import FAMILIES, moe_config


def _recipe(tmp_path, family: str, **config) -> str:
    path = tmp_path / f"{family}.yaml"
    path.write_text(f"model: {{source: transformers, name: {FAMILIES[family][0]}, "
                    f"config: {json.dumps(moe_config(family) | config)}}}\n"
                    "data: {source: synthetic, seq_len: 16}\ntrain: {batch_size: 2, steps: 1, device: cpu}\n")
    return str(path)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_models_validate(tmp_path, ckrun, family, precision):
    code, out, err = ckrun("validate", _recipe(tmp_path, family), f"precision={precision}")
    assert code == 0 and out.strip().endswith(": OK"), err


@pytest.mark.parametrize("setting", [{"experts_implementation": "eager"}, {"experts_implementation": "grouped_mm"},
                                     {"attn_implementation": "eager"}, {"attn_implementation": "sdpa"}])
def test_transformers_public_implementation_keywords_are_settings(tmp_path, ckrun, setting):
    code, _, err = ckrun("validate", _recipe(tmp_path, "mixtral", **setting))
    assert code == 0, err


@pytest.mark.parametrize("key", ["experts_implementation", "attn_implementation"])
def test_a_kernel_transformers_does_not_know_is_one_line_at_its_key(tmp_path, ckrun, key):
    recipe = _recipe(tmp_path, "olmoe", **{key: "fastest"})
    code, _, err = ckrun("validate", recipe)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"{recipe}:1:") and f"model.config.{key}: " in err and '"fastest"` is not supported' in err


# --- torch's grouped kernel on fake fp32 tensors: what the real kernel does ------------------------


@st.composite
def grouped_operands(draw):
    """Operands of the four layouts `_grouped_mm` takes, with widths that may break its 16-byte strides."""
    groups, width = draw(st.integers(1, 3)), st.sampled_from([4, 8, 12, 6, 10])
    m, k, n = draw(width), draw(width), draw(width)
    # the last bound is the rows used: at least one (torch versions differ on operands with no elements)
    bounds = sorted(draw(st.lists(st.integers(0, 8), min_size=groups - 1, max_size=groups - 1)) + [draw(st.integers(1, 8))])
    offs = torch.tensor(bounds, dtype=torch.int32)
    layout = draw(st.sampled_from(["2d3d", "2d2d", "3d2d", "3d3d"]))
    total = max(bounds)
    a = {"2d3d": (total, k), "2d2d": (m, total), "3d2d": (groups, m, k), "3d3d": (groups, m, k)}[layout]
    b = {"2d3d": (groups, k, n), "2d2d": (total, n), "3d2d": (k, total), "3d3d": (groups, k, n)}[layout]
    transpose = draw(st.booleans())  # transformers hands the experts' weights over transposed
    mat_b = torch.randn(*b[:-2], b[-1], b[-2]).transpose(-2, -1) if transpose else torch.randn(b)
    return torch.randn(a), mat_b, (None if layout == "3d3d" else offs)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(operands=grouped_operands())
def test_grouped_mm_on_fake_fp32_tensors_answers_as_the_real_kernel(operands):
    mat_a, mat_b, offs = operands
    try:
        real = torch._grouped_mm(mat_a, mat_b, offs=offs)
    except RuntimeError as err:
        real = err
    with FakeTensorMode() as mode, GroupedMmOnFake():
        fake_args = [mode.from_tensor(t) if t is not None else None for t in (mat_a, mat_b, offs)]
        try:
            fake = torch._grouped_mm(*fake_args[:2], offs=fake_args[2])
        except RuntimeError as err:
            fake = err
    if isinstance(real, RuntimeError):
        assert isinstance(fake, RuntimeError), (real, fake.shape)
    else:
        assert not isinstance(fake, RuntimeError), (real.shape, fake)
        assert (fake.shape, fake.dtype) == (real.shape, real.dtype)


# --- widths torch's grouped kernel cannot take: eager experts, as the README promises ----------------


@settings(max_examples=10, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), width=st.integers(5, 40), hidden=st.integers(17, 40),
       asked=st.sampled_from([None, "grouped_mm", "eager"]))
def test_any_expert_width_validates_and_trains_by_the_kernel_the_log_names(family, width, hidden, asked, tmp_path_factory):
    """Any width: validate agrees with the run, which trains; grouped_mm where its 16-byte rows fit, else
    eager experts, named in the log. grouped_mm asked for by name where it cannot run: one line at its key."""
    import logging

    from ckrun.runner.cli import main

    config = moe_config(family, width=width) | ({"experts_implementation": asked} if asked else {})
    if family == "mixtral":  # a hidden width of any size: the heads' width is its own
        config |= {"hidden_size": hidden, "head_dim": 8}
    hidden = config["hidden_size"]
    fits = width % 4 == 0 and hidden % 4 == 0  # fp32 rows of the experts' weights in 16-byte multiples
    folder = tmp_path_factory.mktemp("moe")
    recipe = folder / "moe.yaml"
    recipe.write_text(f"model: {{source: transformers, name: {FAMILIES[family][0]}, config: {json.dumps(config)}}}\n"
                      "data: {source: synthetic, seq_len: 8}\ntrain: {batch_size: 2, steps: 1, device: cpu}\n"
                      f"output: {{dir: {folder / 'run'}, checkpoint_every: 0}}\n")
    logs, logger = _Lines(), logging.getLogger("ckrun")
    logger.addHandler(logs)
    logger.setLevel(logging.INFO)  # put back after the test (conftest)
    try:
        checked, ran = main(["validate", str(recipe)]), main([str(recipe)])
    finally:
        logger.removeHandler(logs)
    if asked == "grouped_mm" and not fits:
        assert checked == ran == 2
        return
    assert checked == ran == 0
    kernel = asked or ("grouped_mm" if fits else "eager")
    assert any(line.startswith(f"experts: {kernel} (") for line in logs.lines), logs.lines


class _Lines(__import__("logging").Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
