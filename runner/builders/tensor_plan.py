"""Which linear layers tensor parallelism splits, and whether it can: checked once, before any rank starts.

A plan maps module name patterns to a style, as transformers writes its `base_model_tp_plan`
(`layers.*.self_attn.q_proj: colwise`): `*` stands for one name (a layer's index). Patterns are
relative to the base model, the module transformers keeps under `model.base_model_prefix` (`model.`
of LlamaForCausalLM), so the recipe's plan and the model's own read alike; your own model's are
relative to its root. `colwise` splits a layer's output features over the tensor group, `rowwise`
its input features (its output is then summed over the group): a colwise layer must feed the
rowwise one that closes it, with nothing between them that mixes features (attention's heads and an
MLP's activation work per feature, so they may sit between).

What cannot work is refused with its key, all at once: no plan at all, a style ckrun does not apply,
a pattern that matches no module, a target that is not an nn.Linear, features or attention heads
that do not split evenly over `tensor` ranks. Building on the meta device makes this cheap.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import get_args

from torch import nn

from ..problems import KeyedError
from ..plan.strategies import TensorParallel, TensorStyle

STYLES = get_args(TensorStyle)
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")  # transformers' config keys that count heads


def base_prefix(model: nn.Module) -> str:
    """`model.` when the patterns are relative to a transformers base model inside `model`, else ``."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def wanted_plan(model: nn.Module, strategy: TensorParallel) -> tuple[dict[str, str], str]:
    """(pattern -> style, where it comes from): the recipe's plan, else the model config's own."""
    if strategy.plan is not None:
        return dict(strategy.plan), "distributed.plan"
    config = getattr(model, "config", None)
    own = getattr(config, "base_model_tp_plan", None) or {}
    return dict(own), f"{type(model).__name__}'s base_model_tp_plan"


def matches(pattern: str, name: str) -> bool:
    """Whether module `name` matches `pattern`, a `*` standing for exactly one dotted name."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names, strict=True))


def resolve(model: nn.Module, strategy: TensorParallel) -> tuple[dict[str, str], list[KeyedError]]:
    """(every module to split, by its full name, to its style; each problem that stops the plan: one per
    pattern, the first layer it names that cannot be split standing for the rest)."""
    plan, origin = wanted_plan(model, strategy)
    if not plan:
        return {}, [KeyedError(("distributed", "plan"), f"{type(model).__name__} ships no tensor-parallel plan (its "
                               "config has no base_model_tp_plan); give distributed.plan: {module pattern: colwise "
                               "or rowwise}, e.g. {layers.*.mlp.up_proj: colwise, layers.*.mlp.down_proj: rowwise}")]
    unknown = _style_problems(plan, origin)
    if unknown:
        return {}, unknown
    modules, prefix = dict(model.named_modules()), base_prefix(model)
    chosen, problems = {}, _head_problems(model, strategy.tensor)
    for pattern, style in plan.items():
        where = ("distributed", "plan", pattern) if strategy.plan is not None else ("distributed", "tensor")
        names = [name for name in modules if name.startswith(prefix) and matches(pattern, name[len(prefix):])]
        if not names:
            problems.append(KeyedError(where, f"{pattern} ({origin}) matches no module of {type(model).__name__}; "
                                       f"name one relative to {prefix.rstrip('.') or 'the model'}, with `*` for one "
                                       "name such as an index"))
        found = [problem for name in names for problem in _target_problems(name, modules[name], style,
                                                                           strategy.tensor, where)]
        problems += found[:1]
        chosen.update(dict.fromkeys(names, style))
    return chosen, problems


def _style_problems(plan: dict[str, str], origin: str) -> list[KeyedError]:
    """transformers' own plans also use styles of its own TP engine (colwise_gather_output, packed_colwise,
    embedding_rowwise, ...); the schema keeps a recipe's plan to colwise and rowwise already."""
    unknown: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            unknown.setdefault(style, []).append(pattern)
    if not unknown:
        return []
    said = "; ".join(f"{style} ({', '.join(patterns)})" for style, patterns in unknown.items())
    return [KeyedError(("distributed", "tensor"), f"{origin} splits layers in styles ckrun does not apply (it "
                       f"applies {' and '.join(STYLES)}): {said}; give distributed.plan with colwise and rowwise")]


def _target_problems(name: str, module: nn.Module, style: str, tensor: int, where: tuple) -> list[KeyedError]:
    """A target must be an nn.Linear whose split side (colwise: outputs, rowwise: inputs) divides by `tensor`."""
    if type(module) is not nn.Linear:  # a subclass may compute otherwise than x @ W.T + b
        return [KeyedError(where, f"{name} is a {type(module).__name__}, not an nn.Linear; colwise and rowwise "
                           "split a linear layer's weight: name linear layers only")]
    features = module.out_features if style == "colwise" else module.in_features
    if features % tensor:
        side = "output" if style == "colwise" else "input"
        return [KeyedError(where, f"{name} has {features} {side} features, which do not split over {tensor} ranks "
                           "(distributed.tensor); use a tensor size that divides them")]
    return []


def _head_problems(model: nn.Module, tensor: int) -> list[KeyedError]:
    """Attention splits by whole heads: a colwise q/k/v leaves each rank heads / tensor of them. Counted
    from a transformers model's config; your own model's heads ckrun cannot see (its layers' features
    are still checked), so its attention must reshape by the local width (`view(b, t, -1, head_dim)`)."""
    config = getattr(model, "config", None)
    found = []
    for key in HEAD_KEYS:
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tensor:
            found.append(KeyedError(("distributed", "tensor"), f"{tensor} ranks cannot split {heads} attention heads "
                                    f"(model.config.{key}); use a tensor size that divides {heads}"))
    return found[:1]



def recipe_problems(recipe, user_code: bool = True) -> list[KeyedError]:
    """The tensor-parallel plan of a `tp` recipe checked on its model built on the meta device (no memory,
    no weights read), for `ckrun validate` and every verb that loads a recipe, so a plan that cannot
    work is one line before any rank starts. `user_code=False`: a python model's factory is not run."""
    if not isinstance(recipe.distributed, TensorParallel) or (recipe.model.source == "python" and not user_code):
        return []
    try:
        model = _meta_model(recipe.model)
    except Exception:  # noqa: BLE001 - a model that does not build is the model checks' line, not this one's
        return []
    return resolve(model, recipe.distributed)[1]


def _meta_model(spec) -> nn.Module:
    """The model's modules and shapes: a transformers directory's config, never its weights."""
    from .model import build_model

    return build_model(spec, "meta", weights=False)
