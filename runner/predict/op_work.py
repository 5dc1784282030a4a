"""What one aten op does, for the roofline: its class of kernel, its FLOPs, its bytes, its product's shape.

- The class (`efficiency.OP_CLASSES`) picks the share of the device's peaks the op reaches: products,
  convolutions, fused attention (by kernel family), normalisation kernels, the optimizer's step,
  everything else.
- FLOPs: torch's own formulas (`torch.utils.flop_counter.flop_registry`), with two corrections.
  Causal attention: the registry counts the whole s x s score matrix whatever `is_causal` says, but
  the fused kernels skip the blocks above the diagonal, so a causal call counts the share of the
  matrix it computes (s(s+1)/2 of s^2 for square attention). CPU's flash kernel (the one a CPU step
  runs) is not in the registry; it does the work of CUDA's, so it is counted by the same formula.
- A distributed tensor (tensor parallelism's split layers, FSDP's sharded parameters in the
  optimizer's step and clipping) is counted by its local shard: a rank computes and moves only its
  piece, while the op is dispatched with the global shapes.
- Bytes: what the op reads and writes once, except batch normalisation in training, whose statistics
  span the whole batch: CUDA reads its input once to reduce and again to normalise, and in backward
  reads the gradient and the input once to reduce and again to write the input's gradient
  (aten/src/ATen/native/cuda/Normalization.cuh: batch_norm_collect_statistics then
  batch_norm_elementwise; batch_norm_backward_reduce then batch_norm_backward_elemt).
- A convolution in channels-first memory (NCHW, PyTorch's default) on tensor cores also pays cuDNN's
  transposes into and out of the channels-last layout its kernels run in: each of its 4-D tensors
  read and written once more (`layout_bytes`, priced only where the convolution runs on tensor cores).
  "Every time a convolution operation is called by a layer like torch.nn.Conv2D, the cuDNN library
  performs a transpose to convert the tensor into NHWC format" (MosaicML Composer, Channels Last,
  https://docs.mosaicml.com/projects/composer/en/stable/method_cards/channels_last.html).
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry

_COMPUTE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm", "_scaled_mm"})
_CONVOLUTIONS = frozenset({"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                           "_slow_conv2d_forward", "_slow_conv2d_backward", "convolution_overrideable"})
_ATTENTION = {  # op -> kernel family
    "_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_flash_attention_backward": "flash",
    "_flash_attention_forward": "flash", "_flash_attention_backward": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_efficient_attention_backward": "efficient",
    "_efficient_attention_forward": "efficient", "_efficient_attention_backward": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn", "_scaled_dot_product_cudnn_attention_backward": "cudnn",
}
_OPTIMIZER_PREFIXES = ("_fused_adam", "_fused_sgd", "_fused_adagrad", "_foreach_")
_NORMS = frozenset({"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
                    "native_group_norm", "native_group_norm_backward"})  # one kernel each way (not BatchNorm's two)
# ops that read some of their inputs twice (module docstring): op -> how many leading tensor inputs
_TWO_PASS = {"native_batch_norm": 1, "_native_batch_norm_legit": 1, "cudnn_batch_norm": 1,
             "native_batch_norm_backward": 2, "cudnn_batch_norm_backward": 2}


@functools.cache
def _num_bytes():
    try:  # torch's own: a broadcast (stride 0) dimension is read once
        from torch.utils._runtime_estimation import get_num_bytes
        return get_num_bytes
    except ImportError:
        return lambda t: t.numel() * t.element_size()


def op_class(name: str, phase: str) -> tuple[str, str]:
    """(class, attention family) of the aten op `name` run in `phase`."""
    if name in _PRODUCTS:
        return "matmul", ""
    if name in _CONVOLUTIONS:
        return "conv", ""
    if name in _ATTENTION:
        return "attention", _ATTENTION[name]
    if phase == "update" and name.startswith(_OPTIMIZER_PREFIXES):
        return "optimizer", ""
    if name in _NORMS:
        return "norm", ""
    return "memory", ""


def is_causal(func, args, kwargs) -> bool:
    """Whether an attention op computes under a causal mask (its FLOPs are then the half it computes)."""
    return func._overloadpacket.__name__ in _ATTENTION and causal_share(func, local(args), local(kwargs)) < 1


def local(tree):
    """Every distributed tensor in `tree` as its rank's shard (module docstring)."""
    return pytree.tree_map(lambda t: t._local_tensor if isinstance(t, torch.Tensor) and hasattr(t, "_local_tensor")
                           else t, tree)


def layout_bytes(func, args, out) -> int:
    """What a channels-first convolution's transposes move (module docstring); 0 for anything else."""
    if func._overloadpacket.__name__ not in _CONVOLUTIONS:
        return 0
    tensors = [t for t in pytree.tree_leaves((local(args), local(out))) if isinstance(t, torch.Tensor) and t.dim() == 4]
    if not tensors or tensors[0].is_contiguous(memory_format=torch.channels_last):
        return 0
    return 2 * sum(map(_num_bytes(), tensors))


def measure(func, args, kwargs, out) -> tuple[float, str, int, tuple[int, int, int] | None]:
    """(FLOPs, compute dtype, bytes read and written, a product's (batch, rows, columns) or None) of one op."""
    args, kwargs, out = local(args), local(kwargs), local(out)
    flat_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    flat_out = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    nbytes = sum(map(_num_bytes(), flat_in)) + sum(map(_num_bytes(), flat_out)) + _mutated_bytes(func, args, flat_out)
    nbytes += sum(map(_num_bytes(), flat_in[:_second_pass(func, args, kwargs)]))
    dtype = next((_COMPUTE_DTYPES[t.dtype] for t in flat_out or flat_in if t.dtype in _COMPUTE_DTYPES), "fp32")
    return _flops(func, args, kwargs, out), dtype, nbytes, _product_outputs(func, flat_out)


def _second_pass(func, args, kwargs) -> int:
    """How many leading tensor inputs the op reads twice (module docstring): batch norm in training only."""
    inputs = _TWO_PASS.get(func._overloadpacket.__name__, 0)
    if inputs and not func._overloadpacket.__name__.endswith("_backward"):
        names = [argument.name for argument in func._schema.arguments]
        if "training" in names and not _argument(names, args, kwargs, "training"):
            return 0
    return inputs


def _flops(func, args, kwargs, out) -> float:
    name = func._overloadpacket.__name__
    counter = flop_registry.get(func._overloadpacket)
    if counter is not None:
        flops = float(counter(*args, **kwargs, out_val=out))
    elif name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        flops = _cpu_flash_flops(name, args)
    else:
        return 0.0
    return flops * causal_share(func, args, kwargs) if name in _ATTENTION else flops


def _cpu_flash_flops(name: str, args) -> float:
    from torch.utils import flop_counter

    if name.endswith("_backward"):
        grad, query, key, value = args[:4]
        return float(flop_counter.sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape))
    query, key, value = args[:3]
    return float(flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape))


def causal_share(func, args, kwargs) -> float:
    """The share of the s_q x s_k score matrix a causal attention call computes (1 when not causal):
    row i of the queries sees the first i + 1 keys (torch's is_causal aligns to the top left)."""
    names = [argument.name for argument in func._schema.arguments]
    value = _argument(names, args, kwargs, "is_causal")
    if value is None:  # the memory-efficient kernel's own op: 1 top-left, 2 bottom-right causal
        mask_type = _argument(names, args, kwargs, "custom_mask_type")
        value = mask_type in (1, 2)
    if not value:
        return 1.0
    query, key = args[names.index("query")], args[names.index("key")]
    rows, columns = query.shape[-2], key.shape[-2]
    if not rows or not columns:
        return 1.0
    seen = rows * (rows + 1) // 2 if rows <= columns else columns * (columns + 1) // 2 + (rows - columns) * columns
    return seen / (rows * columns)


def _argument(names: list[str], args, kwargs, name: str):
    if name not in names:
        return None
    position = names.index(name)
    return args[position] if position < len(args) else kwargs.get(name)


def _product_outputs(func, outputs: list[torch.Tensor]) -> tuple[int, int, int] | None:
    """(batch, rows, columns) of a product's output, for wave quantisation."""
    if func._overloadpacket.__name__ not in _PRODUCTS or len(outputs) != 1 or outputs[0].dim() < 2:
        return None
    shape = outputs[0].shape
    batch = 1
    for size in shape[:-2]:
        batch *= size
    return batch, shape[-2], shape[-1]


def _mutated_bytes(func, args, outputs: list[torch.Tensor]) -> int:
    """Writes an op makes into its arguments without returning them (fused optimizers, foreach ops)."""
    returned = {id(t) for t in outputs}
    written = 0
    for argument, value in zip(func._schema.arguments, args, strict=False):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in returned:
                written += _num_bytes()(tensor)
    return written
