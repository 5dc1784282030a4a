"""What the tuner must know of a model to offer tensor parallelism (`tp:T` under `tune --nproc N`).

`distributed: {strategy: tp}` without a `plan` splits the layers the transformers model's own plan
names (its config's `base_model_tp_plan`). So the space offers tp only for a model that ships one,
and only tensor sizes T that split what the plan splits: the attention heads (each rank computes
whole heads), the key/value heads, and each planned layer's split features (a colwise layer's
outputs, a rowwise layer's inputs). The model child measures these on the meta-device model
(`tensor_facts`); the space reads them back (`TensorFacts`) without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass

TP_PLAN_KEY = "base_model_tp_plan"


@dataclass(frozen=True)
class TensorFacts:
    """The model's tensor-parallel plan as far as the space needs it."""

    model: str  # the model's class name, for the log
    has_plan: bool  # the model's config ships a tensor-parallel plan
    layers: int = 0  # modules the plan splits (0: it names none of this model's modules)
    heads: int | None = None  # attention heads (config.num_attention_heads), when the config says
    kv_heads: int | None = None  # key/value heads (grouped-query attention), when the config says
    widths: tuple[int, ...] = ()  # the features the plan splits, each a multiple of T under tp:T

    @classmethod
    def from_json(cls, data: dict) -> TensorFacts:
        return cls(data["model"], data["has_plan"], data.get("layers", 0), data.get("heads"), data.get("kv_heads"),
                   tuple(data.get("widths", ())))

    def problem(self, tensor: int) -> str | None:
        """Why `tp:tensor` cannot split this model with its own plan; None when it can."""
        if not self.has_plan:
            return f"{self.model} ships no tensor-parallel plan (its config has no {TP_PLAN_KEY})"
        if not self.layers:
            return f"{self.model}'s tensor-parallel plan names none of its modules"
        for count, what in [(self.heads, "attention heads"), (self.kv_heads, "key/value heads")]:
            if count is not None and count % tensor:
                return f"its {count} {what} do not split over {tensor} ranks"
        uneven = sorted(width for width in self.widths if width % tensor)
        if uneven:
            return f"the plan's layers of width {', '.join(map(str, uneven))} do not split over {tensor} ranks"
        return None


def tensor_facts(model) -> dict:
    """`TensorFacts` of a built (meta-device) model, as JSON: read in the model child."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, TP_PLAN_KEY, None) or {})
    modules = model.named_modules()
    split = [widths for name, module in modules if (widths := _split_widths(name, module, plan))]
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return {"model": type(model).__name__, "has_plan": bool(plan), "layers": len(split),
            "heads": heads if isinstance(heads, int) else None,
            "kv_heads": kv_heads if isinstance(kv_heads, int) else None,
            "widths": sorted({width for widths in split for width in widths})}


def _style(name: str, plan: dict[str, str]) -> str | None:
    """The plan's style for the module called `name`: a pattern matches the end of the name, `*`
    standing for one part (`layers.*.mlp.up_proj` matches `model.layers.3.mlp.up_proj`)."""
    parts = name.split(".")
    for pattern, style in plan.items():
        wanted = pattern.split(".")
        if len(wanted) <= len(parts) and all(w in ("*", p) for w, p in zip(wanted, parts[-len(wanted):], strict=True)):
            return style
    return None


def _split_widths(name: str, module, plan: dict[str, str]) -> list[int]:
    """The features a colwise or rowwise split of this module divides (torch's ColwiseParallel and
    RowwiseParallel): a linear layer's outputs or inputs, an embedding's width or its rows."""
    from torch import nn

    style = _style(name, plan)
    if style not in ("colwise", "rowwise"):
        return []  # other styles (replicated outputs, sequence parallel) split no weight the space must check
    if isinstance(module, nn.Linear):
        return [module.out_features if style == "colwise" else module.in_features]
    if isinstance(module, nn.Embedding):
        return [module.embedding_dim if style == "colwise" else module.num_embeddings]
    return []
