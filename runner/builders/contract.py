"""What ckrun needs of a model, checked where a broken promise shows, and said as one recipe line.

A model must have something to train, take fp32 parameters (precision is autocast's job) and
return logits: a float tensor shaped like the labels plus one class axis, with a class for every
label. transformers and torchvision models keep these promises; a user's model (`model.source:
python`) may not, and the errors torch raises then (a tuple has no `.float()`, "Target 4 is out
of bounds", a CUDA device-side assert) say nothing about the recipe. HF Trainer's conventions
are kept: an output with `.logits` or a `"logits"` key, or a tuple whose first item is the logits.
"""

from __future__ import annotations

import contextlib
import logging
import sysconfig
import traceback
import weakref
from pathlib import Path

import torch
from torch import nn

from .resolve import BuildError
from .user_code import UserExit

log = logging.getLogger(__name__)

try:  # private, so detected: without it no estimate runs on fake tensors either
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:
    _FakeTensor = ()

_USER_MODELS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # model -> model.name
_CHECKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose first batch's labels were checked
_CKRUN = Path(__file__).parents[1]
_LIBRARIES = [str(Path(torch.__file__).parent.parent), sysconfig.get_paths()["stdlib"], str(_CKRUN),
              str(_CKRUN.parent / "autotune")]  # site-packages, then ckrun itself


def adopt_user_model(model: nn.Module, name: str) -> nn.Module:
    """Check a user factory's model once built, and remember it so its forward's errors name it."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise BuildError("model.name", f"{name} has no trainable parameters (none with requires_grad): nothing to "
                                       "train; leave some parameters trainable")
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                  if p.is_floating_point() and p.dtype != torch.float32})
    if low:  # autocast runs fp32 weights in bf16/fp16 and keeps fp32 master weights for the optimizer
        model.float()
        log.info("%s: parameters in %s cast to float32: recipe.precision sets the compute precision "
                 "(autocast), the weights stay fp32", name, ", ".join(low))
    _USER_MODELS[model] = name
    return model


def adapted_user_model(adapted: nn.Module, model: nn.Module) -> nn.Module:
    """`adapted` (a LoRA PeftModel around `model`) known by the name `model` was adopted under."""
    if model in _USER_MODELS:
        _USER_MODELS[adapted] = _USER_MODELS[model]
    return adapted


def logits_from(output, model: nn.Module) -> torch.Tensor:
    """The logits in what a forward returned, or a BuildError saying what came back instead."""
    if hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, dict) and "logits" in output:
        output = output["logits"]
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        kind = f"a dict without 'logits' (keys {sorted(map(str, output))[:5]})" if isinstance(output, dict) \
            else type(output).__name__
        raise _fault(model, f"returned {kind}, not logits; return the logits tensor, an object with .logits, "
                            "a dict with 'logits' or a tuple whose first item is them")
    if not output.is_floating_point():
        raise _fault(model, f"returned {str(output.dtype).removeprefix('torch.')} values of shape "
                            f"{list(output.shape)}, not logits; return the scores before any argmax")
    return output


def check_logits(logits: torch.Tensor, labels: torch.Tensor, model: nn.Module) -> None:
    """Logits [*labels.shape, classes] with a class for every label. The label maximum costs one
    device sync, so it is read on a model's first batch only; the shape is checked every batch."""
    if logits.dim() != labels.dim() + 1 or logits.shape[:-1] != labels.shape:
        want = "[batch, classes]" if labels.dim() == 1 else "[batch, sequence, vocabulary]"
        raise _fault(model, f"returned logits of shape {list(logits.shape)} for labels of shape "
                            f"{list(labels.shape)}; return {want}")
    check_classes(logits.shape[-1], labels, model)


def check_classes(classes: int, labels: torch.Tensor, model: nn.Module) -> None:
    """A class for every label of the model's first batch (one device sync, read once a model)."""
    model = _unwrapped(model)
    if model in _CHECKED or isinstance(labels, _FakeTensor):  # an estimate's fake labels have no values to read
        return
    _CHECKED.add(model)
    top = int(labels.max()) if labels.numel() else -1
    if top >= classes:
        raise _fault(model, f"returns {classes} classes but its first batch holds label {top}; give the "
                            f"model at least {top + 1} outputs (model.config) or fewer classes in data")


@contextlib.contextmanager
def user_forward(model: nn.Module, inputs: dict):
    """A user's model raising in its forward: one line naming it, the inputs it was given and where
    in its own code it raised (an OOM is left to the step, which knows the cap)."""
    name = _USER_MODELS.get(_unwrapped(model))
    try:
        yield
    except (Exception, SystemExit, UserExit) as err:  # an exit in the forward too: a silent end otherwise
        from .oom import is_out_of_memory

        faked = any(isinstance(value, _FakeTensor) for value in inputs.values())  # the estimator reads those
        if name is None or faked or isinstance(err, BuildError) or is_out_of_memory(err):
            raise
        shapes = ", ".join(f"{key} {list(value.shape)}" for key, value in inputs.items() if hasattr(value, "shape"))
        if isinstance(err, (SystemExit, UserExit)):
            call = f"os._exit({err.code})" if isinstance(err, UserExit) else f"sys.exit({err.code!r})"
            raise BuildError("model.name", f"{name}'s forward called {call}{where_raised(err)} on inputs {shapes}; "
                                           "a model must return its outputs (raise an error to stop)") from None
        raise BuildError("model.name", f"{name}'s forward raised {type(err).__name__}: {' '.join(str(err).split())}"
                                       f"{where_raised(err)} on inputs {shapes}; {_fit_advice(err, inputs)}") from None


def _fit_advice(err: Exception, inputs: dict) -> str:
    ids = inputs.get("input_ids")
    if isinstance(err, IndexError) and isinstance(ids, torch.Tensor) and ids.numel():  # an embedding too small
        top = int(ids.max())
        return (f"this batch's token ids reach {top}, past its embedding: give the embedding the data's vocabulary "
                "(258 ids for UTF-8 bytes, else the tokenizer's size), or set data.vocab_size to the rows it has "
                "(byte ids are folded below it)")
    return "make the model take the recipe's data (data.image_size, data.seq_len, ...)"


def _fault(model: nn.Module, what: str) -> BuildError:
    name = _USER_MODELS.get(_unwrapped(model)) or type(_unwrapped(model)).__name__
    return BuildError("model.name", f"{name}'s forward {what}")


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile's and DDP's wrappers."""
    for attribute in ("_orig_mod", "module"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            return _unwrapped(inner)
    return model


def where_raised(err: Exception) -> str:
    """" (at models.py:12)": the deepest frame outside torch, the standard library and ckrun."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not any(f.filename.startswith(root) for root in _LIBRARIES)]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
