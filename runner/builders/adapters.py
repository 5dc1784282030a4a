"""`model.lora`: peft's LoRA on the built model, after its pretrained weights and before the memory plan.

`get_peft_model` freezes the model and puts low-rank adapters beside the target layers, in place;
the model ckrun trains from then on is the `PeftModel` it returns, as with HF Trainer and peft.
The memory plan finds the repeated blocks inside it as in the bare model (under
`base_model.model.`), the optimizer takes only the parameters that train (builders/optim.py), and
the estimate runs the same build on fake tensors, so the frozen base's absent gradients and optimizer
state are predicted as measured.

The frozen base is held in `base_dtype` (bf16 halves it, as peft users load a base with
torch_dtype), and whatever trains (the adapters, modules_to_save, trained biases) stays fp32, the
master weights autocast computes from. Checkpoints carry what trains and the buffers
(`trainable_state`), not the base, which model.pretrained rebuilds; the export writes the adapter
as `PeftModel.save_pretrained` does, and the merged model when model.lora.export_merged asks.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from ..recipe.recipe import ModelSpec, infer_task
from .pretrained import FRESH, TRAINABLE_ONLY  # noqa: F401 - the trainer marks its checkpoints with TRAINABLE_ONLY
from .resolve import BuildError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ckrun's task -> peft's TaskType: the PeftModel class PeftModel.from_pretrained builds for the adapter
_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS"}


def base_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype model.pretrained's weights are read in: the frozen base's under LoRA, else fp32 (the
    master weights autocast computes from), whatever dtype the checkpoint was saved in."""
    return DTYPES[spec.lora.base_dtype] if spec.lora is not None else torch.float32


def pretrained_settings(spec: ModelSpec, device: str | torch.device) -> dict:
    """from_pretrained's keywords for the weights' dtype (and QLoRA's 4-bit loading), before model.config's."""
    settings = {"dtype": base_dtype(spec)}
    if spec.lora is not None and spec.lora.quantize_base is not None:
        settings.update(_quantized_loading(spec.lora, torch.device(device)))
    return {**settings, **spec.config}


def _quantized_loading(lora, device: torch.device) -> dict:
    """bitsandbytes' 4-bit base, quantized as transformers loads it (the QLoRA paper's double quantization)."""
    if device.type != "cuda":
        raise BuildError("model.lora.quantize_base", f"QLoRA: bitsandbytes' 4-bit base runs on CUDA, but this run "
                         f"is on {device.type}; train on a GPU, or remove quantize_base for LoRA on a "
                         f"{lora.base_dtype} base")
    from transformers import BitsAndBytesConfig

    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=lora.quantize_base,
                                   bnb_4bit_compute_dtype=DTYPES[lora.base_dtype], bnb_4bit_use_double_quant=True)
    return {"quantization_config": quantized, "device_map": {"": device}}


def lora_note(model: nn.Module, lora) -> str:
    """What `ckrun estimate` says of a LoRA recipe beside its breakdown."""
    trained, total = count_trainable(model)
    frozen = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
                 if not p.requires_grad)
    from ..units import format_bytes

    return (f"model.lora: {trained:,} of {total:,} parameters train (rank {lora.rank} on {_targets(model)}); the "
            f"frozen base ({format_bytes(frozen)} of {lora.base_dtype} weights) has no gradients or optimizer state")


def apply_lora(model: nn.Module, spec: ModelSpec, say: bool = True) -> nn.Module:
    """`model` frozen, with peft's LoRA adapters: the PeftModel the rest of the run trains. `say=False` (a build
    on the meta device: validate's check of the target lists, the estimate) logs nothing."""
    from peft import LoraConfig, get_peft_model

    lora = spec.lora
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias=lora.bias,
                        target_modules=lora.target_modules, modules_to_save=lora.modules_to_save or None,
                        use_rslora=lora.use_rslora, task_type=_TASK_TYPES.get(infer_task(spec) or ""))
    try:
        with _quiet_peft():
            peft_model = get_peft_model(model, config)
    except (ValueError, KeyError, TypeError) as err:  # no such target module; an architecture peft has no default for
        key = _key_of(str(err))
        fix = (f"name the layers in model.lora.target_modules ({_linear_names(model)} or all-linear)"
               if key.endswith("target_modules") else "name leaf modules to train whole (e.g. classifier, lm_head)")
        said = _first_line(err).split(". ")[0].rstrip(". ")  # peft's first sentence; the rest guesses at causes
        raise BuildError(key, f"peft cannot put LoRA on {spec.name}: {said}; {fix}") from None
    _check_modules_to_save(peft_model, lora.modules_to_save, spec.name)
    _name_the_base(peft_model, model)
    _hold(peft_model, DTYPES[lora.base_dtype])
    if not say:
        return peft_model
    _warn_frozen_fresh(peft_model, model.__dict__.get(FRESH, []))
    trained, total = count_trainable(peft_model)
    log.info("LoRA rank %d on %s: %s of %s parameters train (%.2f%%); the frozen base (%s) has no gradients "
             "or optimizer state", lora.rank, _targets(peft_model), f"{trained:,}", f"{total:,}",
             100 * trained / max(total, 1), lora.base_dtype)
    return peft_model


def _linear_names(model: nn.Module, shown: int = 6) -> str:
    """The names the model's linear layers end in, as target_modules takes them: `e.g. [query, value]`."""
    names = sorted({name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)})
    if not names:
        return "e.g. [q_proj, v_proj]"
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return f"its linear layers: [{', '.join(names[:shown])}{more}]"


def _check_modules_to_save(model: nn.Module, wanted: list[str], name: str) -> None:
    """Each model.lora.modules_to_save entry names a module peft made trainable (peft itself passes over one
    that matches nothing, which would then stay frozen or absent without a word)."""
    from peft.utils import ModulesToSaveWrapper

    wrapped = [module_name for module_name, module in model.named_modules() if isinstance(module, ModulesToSaveWrapper)]
    for index, entry in enumerate(wanted):
        if not any(module_name == entry or module_name.endswith(f".{entry}") for module_name in wrapped):
            from ..problems import suggest

            names = {module_name.rpartition(".")[2] for module_name, _ in model.base_model.model.named_modules()}
            raise BuildError(("model", "lora", "modules_to_save", index), f"{entry!r} is no module of {name}"
                             f"{suggest(entry, names - {''})}; name a module to train whole beside the adapter "
                             "(e.g. classifier, lm_head)")


def _name_the_base(peft_model: nn.Module, model: nn.Module) -> None:
    """adapter_config.json names the base as the Hub knows it (its id and the commit trained on), not the cache
    snapshot's absolute path from_pretrained leaves in name_or_path, which no other machine has: peft's
    AutoPeftModel and PeftModel users then load the same base from their own cache."""
    from .hub import hub_origin

    name_or_path = getattr(model, "name_or_path", "") or ""
    origin = hub_origin(Path(name_or_path)) if name_or_path else None
    if origin is None:
        return
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path, config.revision = origin


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters), tied ones counted once."""
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if p.requires_grad), sum(p.numel() for p in unique)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA run's checkpoint keeps of the model: the parameters that train and every buffer
    (BatchNorm statistics move in a frozen base too); the frozen weights come from model.pretrained."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {name: tensor for name, tensor in model.state_dict().items() if name not in frozen}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The counterpart of trainable_state: a ValueError unless `state` holds exactly what trains."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    missing = [name for name in missing if name not in frozen]
    if missing or unexpected:
        raise ValueError(f"the checkpoint's adapter does not fit model.lora: {len(missing)} missing and "
                         f"{len(unexpected)} unexpected tensors (e.g. {(missing or unexpected)[0]})")


def _warn_frozen_fresh(model: nn.Module, fresh: list[str]) -> None:
    """Weights model.pretrained lacked start random; frozen, they would stay random (a new head)."""
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    frozen = [key for key in fresh if not any(f".{key.rpartition('.')[0]}." in f".{name}" for name in trained)]
    if frozen:
        modules = sorted({key.rpartition(".")[0] for key in frozen})
        log.warning("model.lora: %d weights the pretrained model lacks start random and stay frozen, so they never "
                    "train (e.g. %s); add %s to model.lora.modules_to_save", len(frozen), frozen[0],
                    "[" + ", ".join(modules[:3]) + "]")


def merged(model: nn.Module) -> nn.Module:
    """The base model with the adapters merged into its weights (peft's merge_and_unload): the layers
    of `model` are replaced, so this is its last use."""
    with _quiet_peft():
        return model.merge_and_unload()


def _hold(model: nn.Module, frozen_dtype: torch.dtype) -> None:
    """The frozen weights in `frozen_dtype`, what trains in fp32."""
    for parameter in {id(p): p for p in model.parameters()}.values():
        wanted = torch.float32 if parameter.requires_grad else frozen_dtype
        if parameter.is_floating_point() and parameter.dtype != wanted:
            parameter.data = parameter.data.to(wanted)


def _targets(model: nn.Module) -> str:
    config = next(iter(model.peft_config.values()))
    targets = config.target_modules
    return targets if isinstance(targets, str) else ", ".join(sorted(targets))


def _key_of(message: str) -> str:
    """The key peft's message is about: its target modules first (a message about them may name
    modules_to_save as a cause), then modules_to_save."""
    if "target modules" in message.lower() or "target_modules" in message:
        return "model.lora.target_modules"
    return "model.lora.modules_to_save" if "modules_to_save" in message else "model.lora.target_modules"


def _first_line(err: BaseException) -> str:
    from ..problems import first_line

    return first_line(err, 240)


@contextlib.contextmanager
def _quiet_peft():
    """peft asks transformers models deprecated questions (is_gradient_checkpointing) and warns of
    settings ckrun chose on purpose; the log line says what was done."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
