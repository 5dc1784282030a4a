"""The recipe's adapter section (`model.lora`): LoRA through peft, the library, not a copy of it.

LoRA changes what trains, so it is the recipe's, not the memory plan's: the model's own weights
are frozen and small low-rank matrices beside chosen linear layers train instead (peft's
`LoraConfig`, whose names the fields follow: rank is peft's `r`, alpha its `lora_alpha`). The frozen
base then has no gradients and no optimizer state, which the estimate and the tuner see; checkpoints
carry the adapter alone, and the export writes it as peft saves it (runner/builders/adapters.py).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..plan.choices import Strict
from ..problems import KeyedError


class LoraSpec(Strict):
    """LoRA: freeze the model, train rank-`rank` updates W + (alpha/rank)·B·A of the target layers."""

    @model_validator(mode="before")
    @classmethod
    def _peft_installed(cls, given):
        if importlib.util.find_spec("peft") is None:
            raise KeyedError(("model", "lora"), "LoRA comes from the peft package, which is not installed: "
                             "pip install 'ckrun[lora]' (or pip install peft)")
        return given

    rank: int = Field(default=8, gt=0)
    """The rank of each update (peft's `r`): 8-64 is usual; the adapter's size grows linearly with it."""
    alpha: float = Field(default=16.0, gt=0)
    """peft's `lora_alpha`: the update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input (peft's `lora_dropout`)."""
    target_modules: list[str] | Literal["all-linear"] | None = None
    """The layers that get an adapter: module names or name suffixes (`[q_proj, v_proj]`), or
    `all-linear` (every linear layer but the output head). Unset: peft's choice for the
    architecture (the attention's query and value projections for Llama, BERT, GPT-2, T5, ...);
    a model peft has no choice for (torchvision, your own) must name them."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained whole beside the adapter and saved with it (a new classification head:
    `[classifier]`). A sequence classifier's head is added by peft itself."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases train: none, all of the model's, or those of the adapted layers."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank), which keeps larger ranks learning."""
    base_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The dtype the frozen base is held in. `bf16`/`fp16` halve its bytes, as peft users load
    a base with torch_dtype; they need the same `precision` (autocast runs the adapters, which
    stay fp32, in it). A bf16 checkpoint held in bf16 computes what fp32 storage computes under
    bf16 autocast, but for the layers autocast keeps in fp32 (norms), which then read bf16 weights."""
    quantize_base: Literal["nf4", "fp4"] | None = None
    """QLoRA: hold the frozen base's linear layers in bitsandbytes' 4-bit format (nf4: the QLoRA
    paper's), a quarter of bf16's bytes; the other frozen weights are held in base_dtype. CUDA only,
    needs `pip install bitsandbytes`; the base's weights are rounded to 4 bits, so the model computes
    differently from the unquantized one (that is QLoRA's trade)."""

    export_merged: bool = False
    """Besides the adapter (OUTPUT_DIR/adapter, as peft saves it), export the model with the adapter merged
    into its weights to OUTPUT_DIR/model: save_pretrained output transformers loads without peft, which
    model.pretrained can start another run from."""

    @field_validator("quantize_base")
    @classmethod
    def _bitsandbytes_installed(cls, kind: str | None) -> str | None:
        if kind is not None and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"QLoRA's {kind} base needs the bitsandbytes package, which is not installed: pip install "
                             "bitsandbytes (it runs on CUDA), or remove quantize_base to train LoRA on an unquantized base")
        return kind

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets):
        if isinstance(targets, list) and not targets:
            raise ValueError("is empty, so no layer would train; name layers (e.g. [q_proj, v_proj]), write "
                             "all-linear, or leave it out for peft's choice")
        return targets
