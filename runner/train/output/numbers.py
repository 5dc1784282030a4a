"""The one path for numbers into a run's records: every metrics line, every sink and the trainer's
checkpoint state pass through `plain_record`.

Libraries hand the trainer numbers in their own types: torchao's low-bit optimizers keep the learning
rate as a 0-d tensor (so LambdaLR's `get_last_lr()` and its state dict hold tensors), numpy gives
`np.float32`, an FSDP2 or tensor-parallel run can give a 0-d DTensor. JSON, TensorBoard and MLflow take
plain Python numbers only, so each becomes one here, once, whoever made it. A value that is not a
number (a tensor of many elements, an object) is refused with the record's key and the value's type,
which names the library that handed it over, instead of a TypeError from json at the first write.
"""

from __future__ import annotations

import numbers

from ...problems import CkrunError

PLAIN = (str, bool, int, float, type(None))


class RecordValueError(CkrunError, TypeError):
    """A record's value is not a number, a string or a list/dict of them: a library handed the trainer
    something ckrun cannot write. A bug, ours or a library's: exit 1 with the key that held it."""

    exit_status = 1

    def __init__(self, key: str, value):
        super().__init__(f"the run's record {key!r} holds a {type(value).__module__}.{type(value).__name__} "
                         f"({_shape(value)}), not a number; it cannot be written to metrics.jsonl or a checkpoint")


def plain_record(record: dict, prefix: str = "") -> dict:
    """`record` with every value a plain Python value (nested dicts and lists too); keys stay as they are."""
    return {key: plain_value(value, f"{prefix}{key}") for key, value in record.items()}


def plain_value(value, key: str):
    """`value` as a plain Python value: a one-element tensor (a DTensor is gathered first) or a numpy
    scalar becomes its Python number; dicts and lists are followed; anything else is RecordValueError."""
    if type(value) in PLAIN:  # exactly: np.float64 is a float subclass that json writes, tensorboard may not
        return value
    if isinstance(value, dict):
        return plain_record(value, f"{key}.")
    if isinstance(value, list | tuple):
        return [plain_value(item, f"{key}[{index}]") for index, item in enumerate(value)]
    full = getattr(value, "full_tensor", None)  # a DTensor: its value as one tensor, whatever its placement
    if callable(full):
        value = full()
    if _is_tensor(value) and value.numel() == 1:
        return value.detach().cpu().item()
    item = getattr(value, "item", None)  # numpy's scalar types (np.float32, np.int64, np.bool_)
    if callable(item) and getattr(value, "shape", None) in ((), None):
        return plain_value(item(), key)
    if isinstance(value, numbers.Integral):  # an IntEnum, a registered integer type
        return int(value)
    if isinstance(value, numbers.Real):  # np.float64 (a float subclass), Fraction
        return float(value)
    raise RecordValueError(key, value)


def _is_tensor(value) -> bool:
    import torch  # the records of a run always come with torch loaded; imported here to keep this module light

    return isinstance(value, torch.Tensor)


def _shape(value) -> str:
    shape = getattr(value, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else "no shape"
