"""Make library code take, on the estimate's fake tensors, the path it takes on real ones.

transformers treats a fake tensor as a traced one and then keeps every conservative path. One of
them changes memory. A causal LM's mask code asks whether the position ids hold several packed
sequences (`find_packed_sequence_indices`); on a traced tensor it cannot read them, so it answers
"maybe", builds a [batch, 1, seq, seq] mask and hands it to SDPA, which then leaves its flash kernel
(and `enable_gqa`) for the math path: Llama, Qwen2 and Qwen3 estimates were high by the mask, the
repeated key/value heads and the attention weights.

ckrun never passes position ids: transformers derives them from the attention mask, so they hold
one sequence per row, and the real run's answer is "no packing". Where a real padding mask is given
the mask is built either way, with the same shape. So on fake position ids the answer is None, as
on real ones.
"""

from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def real_mask_paths():
    """While open, transformers' packed-sequence check answers on fake tensors as it does on real ones."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:  # another transformers: nothing known to correct
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed_when_fake(check)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = check


def _not_packed_when_fake(check):
    from torch._subclasses.fake_tensor import FakeTensor

    @functools.wraps(check)
    def run(position_ids, *args, **kwargs):
        return None if isinstance(position_ids, FakeTensor) else check(position_ids, *args, **kwargs)
    return run
