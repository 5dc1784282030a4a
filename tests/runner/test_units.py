"""format_bytes writes what `--max-mem` and `memory.max_mem` read back, to its one decimal."""

from hypothesis import given
from hypothesis import strategies as st
from pydantic import ByteSize, TypeAdapter

from ckrun.runner.units import format_bytes


@given(st.integers(0, 10**16))
def test_a_formatted_size_reads_back_within_its_rounding(count):
    text = format_bytes(count)
    number, unit = text.split()
    assert len(number.split(".")[0]) <= 4 or unit == "TB", text  # the largest unit that fits, so 1.5 TB, not 1500.0 GB
    read = int(TypeAdapter(ByteSize).validate_python(text.replace(" ", "")))
    step = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]
    assert abs(read - count) <= 0.05 * step + 1, (count, text, read)
