"""The GPU campaign's results as markdown: the figures the issue sets goals for, device and versions,
the call's steps, memory facts, the time model's calibration, plans, knobs, tuning.

    python bench/gpu/tables.py RESULTS_DIR [RESULTS_DIR ...] --out docs/benchmarks_gpu.md

Reads campaign.json, facts.json, calibration.json, plans.json, knobs.json and tune.json from the
given directories (any subset, or none; a later directory's file wins: a second call's after the
first's). Every figure (P1, P2, P4, P5, P6, the step-time prediction and the tuned plan's use of the
cap) is written, as "not measured" where its step has not run. Without --out the markdown goes to
stdout. plans.py and tune.py print their own table with the same functions; sections.py holds the
newer sections and the call's summary lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/tables.py` must find it too
    sys.path.insert(0, str(REPO))

from bench.stats import spearman  # noqa: E402
from runner.policies import short_list  # noqa: E402

VERSION_KEYS = ("python", "torch", "cuda", "transformers", "torchvision", "optuna", "pydantic")


# --- numbers --------------------------------------------------------------------------------------


def gb(count) -> str:
    return "" if count is None else f"{count / 1e9:.2f}"


def size(count) -> str:
    """Small amounts (workspaces, contexts) in MB, large ones in GB."""
    if count is None:
        return "n/a"
    return f"{count / 1e9:.2f} GB" if abs(count) >= 1e9 else f"{count / 1e6:.1f} MB"


def percent(fraction, signed: bool = False) -> str:
    if fraction is None:
        return ""
    return f"{100 * fraction:+.1f}%" if signed else f"{100 * fraction:.1f}%"


def plan_label(memory: dict) -> str:
    """`micro-batch 16, checkpointing every 2, offload all, compiled` from a recipe's memory section (as JSON)."""
    checkpointing, offload = memory.get("checkpointing", {}), memory.get("offload", {})
    parts = [f"micro-batch {memory.get('micro_batch') or 'whole batch'}",
             f"checkpointing {_policy(checkpointing)}"]
    if offload.get("policy", "none") != "none":
        parts.append(f"offload {_policy(offload)}")
    if memory.get("compile"):
        parts.append("compiled")
    return ", ".join(parts)


def _policy(part: dict) -> str:
    """`every 2`, `layers 19,20,21`: a checkpointing or offload section as its policy writes itself."""
    label = part.get("policy", "none")
    for key in ("every", "layers"):
        if key in part:  # every:2, layers:0,2: the policies' own labels (runner/policies.py)
            label += ":" + (short_list(part[key]) if key == "layers" else str(part[key]))
    return label.replace(":", " ", 1)



NOT_MEASURED = "not measured"


def _goal(value, goal: float, text: str | None = None, at_most: bool = False, goal_text: str | None = None) -> str:
    """`0.95 (goal >= 0.97: MISSED)`; "not measured" for None."""
    if value is None:
        return NOT_MEASURED
    met = value <= goal if at_most else value >= goal
    return (f"{text or f'{value:.2f}'} (goal {'<=' if at_most else '>='} {goal_text or f'{goal:g}'}: "
            f"{'met' if met else 'MISSED'})")


# --- the figures ----------------------------------------------------------------------------------


def figure_texts(found: dict) -> dict[str, str]:
    """Each figure's result as text, "not measured" where its step has not run."""
    plans_found = found.get("plans") or {}
    plans = plans_found.get("figures") or {}
    tune = (found.get("tune") or {}).get("figures") or {}
    return {"P1": _p1(tune), "P2": _p2(tune), "P4": _p4(plans), "P5": _p5(tune), "P6": _p6(plans),
            "cap": _cap(tune.get("cap")), "step time": step_time_text(plans_found.get("plans") or [])}


def figures_table(found: dict) -> str:
    texts = figure_texts(found)
    rows = [("P1", "tuned under 40 GB / fastest uncapped plan", texts["P1"]),
            ("P2", "tuned / HF `gradient_checkpointing_enable()`, same batch and precision", texts["P2"]),
            ("P4", "predicted vs measured peak (reserved), absolute error: median; worst", texts["P4"]),
            ("P5", "`ckrun tune` under 40 GB, wall time", texts["P5"]),
            ("P6", "MFU, best eager plan; best compiled plan", texts["P6"]),
            ("step time", "predicted vs measured step time over the plans: rank correlation; error", texts["step time"]),
            ("cap", "tuned plan's measured peak (reserve + CUDA context) under the cap, using >= 90% of it",
             texts["cap"])]
    dry = any((found.get(name) or {}).get("dry_run") for name in found)
    lines = ["## Figures", "", "| figure | what | result |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    if not found:
        lines += ["", "No GPU results yet: every figure waits for a lent GPU (`bash bench/gpu/call.sh`)."]
    elif dry:
        lines += ["", "Dry run: toy sizes on a CPU; the goals are for BERT-large on a GPU."]
    return "\n".join(lines)


def _p1(tune: dict) -> str:
    return _goal((tune.get("P1") or {}).get("value"), 0.97)


def _p2(tune: dict) -> str:
    return _goal((tune.get("P2") or {}).get("value"), 1.25)


def _p4(plans: dict) -> str:
    p4 = plans.get("P4") or {}
    if p4.get("median_abs_error") is None:
        return NOT_MEASURED
    median, worst = (_goal(p4[k], goal, percent(p4[k]), at_most=True, goal_text=percent(goal))
                     for k, goal in (("median_abs_error", 0.03), ("worst_abs_error", 0.08)))
    return f"{median}; {worst}; {p4['plans']} plans, predicted by {p4.get('predictions_from')}"


def _p5(tune: dict) -> str:
    p5 = tune.get("P5") or {}
    if p5.get("seconds") is None:
        return NOT_MEASURED
    text = f"{p5['seconds'] / 60:.1f} min" + ("" if p5.get("finished") else ", killed at its share of the call")
    return _goal(p5["seconds"] / 60, 10, text, at_most=True, goal_text="10 min")


def _p6(plans: dict) -> str:
    p6 = plans.get("P6") or {}
    shown = lambda kind, goal: _goal(p6.get(f"{kind}_mfu"), goal, p6.get(f"{kind}_mfu") is not None and  # noqa: E731
                                     f"{percent(p6[f'{kind}_mfu'])} ({p6.get(f'{kind}_plan')})", goal_text=percent(goal))
    return f"eager {shown('eager', 0.35)}; compiled {shown('compiled', 0.45)}"


def _cap(cap: dict | None) -> str:
    if not cap or cap.get("card_peak_bytes") is None:
        return NOT_MEASURED
    within = "under the cap" if cap["within_cap"] else "OVER THE CAP"
    return f"{gb(cap['card_peak_bytes'])} GB of {gb(cap['cap_bytes'])} GB: {within}, " + \
        _goal(cap["cap_used"], 0.9, f"{percent(cap['cap_used'])} used", goal_text="90%")


# --- sections -------------------------------------------------------------------------------------


def header(found: dict) -> str:
    versions = next((found[name]["versions"] for name in ("facts", "calibration", "plans", "knobs", "tune")
                     if (found.get(name) or {}).get("versions")), {})
    dry = any(found[name].get("dry_run") for name in found)
    lines = ["# ckrun on a GPU: memory facts, calibration, plans and tuning", "",
             f"Generated by `bench/gpu/tables.py` from the GPU campaign's results ({versions.get('date', 'none yet')}).",
             "", "How they are made (docs/DEVELOPING.md, GPU campaign): `bash bench/gpu/wheels.sh` here, then on a lent GPU "
             "`bash bench/gpu/call.sh` in one call of at most 9 minutes with the machine's start included (device "
             "tool `timeout_s` 400, `.whl` carried; give the machine back at once; a second call only where the "
             "first names one), then `python bench/gpu/tables.py OUT [OUT2] --out docs/benchmarks_gpu.md` and "
             "`python bench/gpu/calibrate.py OUT/calibration.json --write`."]
    if dry:
        lines.append("**Dry run: toy sizes on a CPU. These numbers say nothing about a GPU.**")
    if not versions:
        return "\n".join(lines)
    device = versions.get("device", "?")
    if versions.get("total_bytes"):
        device += f" ({size(versions['total_bytes'])}, compute capability {versions.get('capability')})"
    lines += ["", f"- device: {device}", f"- driver: {versions.get('driver') or 'n/a'}",
              "- versions: " + ", ".join(f"{key} {versions.get(key) or 'n/a'}" for key in VERSION_KEYS),
              f"- allocator settings: PYTORCH_CUDA_ALLOC_CONF `{versions.get('alloc_conf') or '(unset)'}`, "
              f"PYTORCH_ALLOC_CONF `{versions.get('alloc_conf_generic') or '(unset)'}`; in effect, as torch reports "
              f"them: {_in_effect(versions.get('alloc_in_effect'))}"]
    return "\n".join(lines)


def _in_effect(settings: str | None) -> str:
    if settings is None:
        return "n/a (this torch cannot say)"
    return f"`{settings}`" if settings else "none (the defaults)"


def facts_table(facts: dict) -> str:
    context, cublas = facts.get("context") or {}, facts.get("cublas") or {}
    attention, bandwidth = facts.get("attention") or {}, facts.get("bandwidth") or {}
    matmul = facts.get("matmul") or {}
    rate = lambda key: "n/a" if bandwidth.get(key) is None else f"{bandwidth[key] / 1e9:.1f} GB/s"  # noqa: E731
    rows = [
        ("CUDA context at init", size(context.get("context_at_init_bytes"))),
        ("CUDA context after a BERT step's kernels", size(context.get("context_after_bert_kernels_bytes"))),
        ("the same, this process only (ckrun's measure)", size(context.get("ckrun_context_after_kernels_bytes"))),
        ("cuBLAS workspace, default stream", size(cublas.get("cublas_workspace_bytes"))),
        ("cuBLAS workspace, a side stream", size(cublas.get("cublas_workspace_side_stream_bytes"))),
        (f"flash attention backward scratch {attention.get('shape', '')}",
         size(attention.get("flash_backward_scratch_bytes"))),
        (f"memory-efficient attention backward scratch {attention.get('shape', '')}",
         size(attention.get("efficient_backward_scratch_bytes"))),
        ("pinned host to device copy", rate("pinned_h2d_bytes_per_s")),
        ("pinned device to host copy", rate("pinned_d2h_bytes_per_s")),
        (f"bf16 matrix product {matmul.get('shape', '')}, random data",
         "n/a" if matmul.get("bf16_flops_per_s") is None else f"{matmul['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"),
    ]
    errors = [f"- {name}: {facts[name]['error']}" for name in ("context", "cublas", "attention", "bandwidth", "matmul")
              if isinstance(facts.get(name), dict) and "error" in facts[name]]
    table = "## Memory facts\n\n| what | measured |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    return table + ("\n\nProbes that failed:\n" + "\n".join(errors) if errors else "")


def _plan_row(plan: dict, base: dict | None, floor) -> str:
    name, micro = plan["name"], plan["micro_batch"]
    predicted = plan.get("predicted_bytes", plan.get("predicted_here_bytes"))
    step_predicted = "not predicted" if plan.get("predicted_step_s") is None else f"{plan['predicted_step_s']:.3f}"
    if plan["status"] != "ok":
        why = "out of memory" if plan["status"] == "oom" else plan.get("reason", plan["status"])
        return f"| {name} | {micro} | {why} | {step_predicted} | | | | | | | {gb(predicted)} | | |"
    vs = plan["step_time_s"] / base["step_time_s"] if base and base.get("step_time_s") else None
    tflops = None if plan.get("achieved_flops_per_s") is None else f"{plan['achieved_flops_per_s'] / 1e12:.0f}"
    loss = ""
    if plan.get("loss_diff_vs_none") is not None:
        verdict = "within" if plan.get("loss_within_noise") else "OUTSIDE"
        loss = f"{plan['loss_diff_vs_none']:.1e} ({verdict}; floor {floor:.1e})" if floor is not None else \
            f"{plan['loss_diff_vs_none']:.1e}"
    return (f"| {name} | {micro} | {plan['step_time_s']:.3f} | {step_predicted} | "
            f"{'' if vs is None else f'{vs:.2f}x'} | {plan['samples_per_s']:.1f} | {tflops or ''} | "
            f"{percent(plan.get('mfu'))} | {percent(plan.get('hfu'))} | {gb(plan['measured_peak_bytes'])} | "
            f"{gb(predicted)} | {percent(plan.get('error'), True)} | {loss} |")


def plans_table(plans: dict) -> str:
    measured = "reserved" if not plans.get("dry_run") else "live tensors (CPU)"
    settings = plans["settings"]
    lines = [f"## Plans on {plans['recipe']}", "",
             f"Batch {settings['batch_size']}, {settings['precision']}; step time: median of {settings['timed_steps']} "
             f"timed steps after {settings['warmup_steps']} warm-up; memory: largest peak over all steps; predicted: "
             f"{plans.get('predictions_from', 'n/a')}; error = (predicted - measured) / measured. MFU counts the "
             "model's FLOPs (the step with no plan), HFU the FLOPs the plan's step ran, recompute included; TFLOP/s "
             "is HFU's. Predicted step time: the time model's, where the predictions carry one.", "",
             f"| plan | micro-batch | step time (s) | predicted step (s) | vs none | samples/s | TFLOP/s | MFU | HFU | "
             f"measured {measured} (GB) | predicted (GB) | error | max loss diff vs none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for plan in plans["plans"]:
        base = next((p for p in plans["plans"] if p["name"] == "none" and p["micro_batch"] == plan["micro_batch"]
                     and p["status"] == "ok"), None)
        lines.append(_plan_row(plan, base, plans.get("noise_floor", {}).get(str(plan["micro_batch"]))))
    lines += _solver_lines(plans.get("solver") or {})
    summary = plans.get("summary") or {}
    if summary.get("plans"):
        lines += ["", f"Prediction error over {summary['plans']} measured plans: median "
                      f"{percent(summary['median_abs_error'])}, worst {percent(summary['worst_abs_error'])} "
                      f"({summary.get('worst_plan')})."]
    lines += ["", f"Predicted step time against measured: {step_time_text(plans['plans'])}."]
    if plans.get("summary_here", {}).get("plans") and plans.get("predictions_from", "").endswith(")"):
        here = plans["summary_here"]
        lines.append(f"Re-predicted with this machine's torch: median {percent(here['median_abs_error'])}, "
                     f"worst {percent(here['worst_abs_error'])}.")
    lines += ["", "Loss noise floor: max |loss difference| between two runs of `none` with the same seed "
                  "(FlashAttention's backward is not deterministic); a plan is within the noise when its "
                  f"difference is at most {plans.get('noise_multiple', 3)}x that."]
    return "\n".join(lines) + "\n\n" + snapshot_line(plans.get("snapshot") or {})


def step_time_text(plans: list[dict]) -> str:
    """The time model against the measured steps: rank correlation and error, the calibration a GPU gives."""
    timed = [p for p in plans if p["status"] == "ok" and p.get("predicted_step_s") and p.get("step_time_s")]
    if len(timed) < 2:
        return NOT_MEASURED + " (fewer than two measured plans carry a prediction)"
    measured, predicted = [p["step_time_s"] for p in timed], [p["predicted_step_s"] for p in timed]
    errors = sorted(abs(b / a - 1) for a, b in zip(measured, predicted, strict=True))
    return (f"Spearman {spearman(measured, predicted):.2f}, median error {percent(errors[len(errors) // 2])}, "
            f"worst {percent(errors[-1])} over {len(timed)} plans")


def _solver_lines(solver: dict) -> list[str]:
    if not solver:
        return []
    return ["", "The solver's plans (limit: the tune call's cap less margin and context): " + "; ".join(
        f"micro-batch {micro}: {plan_label({**found['memory']}) if found.get('memory') else 'none'} "
        f"(limit {gb(found.get('limit_bytes'))} GB)" for micro, found in solver.items()) + "."]


def snapshot_line(found: dict) -> str:
    if found.get("status") == "skipped" or "error" in found or "real_reserved_peak_bytes" not in found:
        return f"Allocator replay: {found.get('reason') or found.get('error') or 'not recorded'}."
    return (f"Allocator replay ({found.get('plan', 'full')}, {found.get('steps', 1)} step(s) from an emptied cache, "
            f"{found['events']} events): the real steps reserved up to {gb(found['real_reserved_peak_bytes'])} GB, "
            f"ckrun's allocator model replaying the same "
            f"events {gb(found['model_reserved_peak_bytes'])} GB: replay error "
            f"{percent(found['replay_error'], True)} (the model's own error, apart from events the prediction "
            f"misses). At start: {gb(found['real_reserved_start_bytes'])} GB real, "
            f"{gb(found['model_reserved_start_bytes'])} GB seeded into the model; allocated peak: "
            f"{gb(found.get('steps_peak_allocated_bytes'))} GB real, {gb(found['model_peak_allocated_bytes'])} GB "
            f"in the model.")


def _search_line(name: str, run: dict | None) -> str:
    if not run:
        return f"- {name}: not run"
    return (f"- {name}: `ckrun {' '.join(run['command'][3:])}`: exit status {run.get('exit_code')}, "
            f"{run.get('seconds', 0):.0f} s{' (killed at its share of the call)' if run.get('timed_out') else ''}, "
            f"{run.get('trials', '?')} trials")


def tune_table(tune: dict) -> str:
    lines = [f"## Tuning {tune['recipe']} under {tune['cap_text']}", "",
             _search_line("the search under the cap", tune.get("tune")),
             _search_line("the same search with the card's memory as the cap", tune.get("uncapped_tune")), "",
             "| candidate | plan | samples/s per run | median samples/s | in its search | peak: reserve + context (GB) |",
             "|---|---|---|---|---|---|"]
    for candidate in tune.get("candidates", []):
        runs = ", ".join(f"{r['samples_per_s']:.1f}" if r.get("samples_per_s") else r.get("status", "?")
                         for r in candidate["runs"])
        median, search = candidate.get("median_samples_per_s"), candidate.get("search_samples_per_s")
        lines.append(f"| {candidate['name']} | {candidate['label']} | {runs} | "
                     f"{'' if median is None else f'{median:.1f}'} | {'' if search is None else f'{search:.1f}'} | "
                     f"{gb(candidate.get('max_card_peak_bytes'))} |")
    ratios = tune.get("ratios") or {}
    lines += ["", f"- tuned / fastest uncapped: {_goal(ratios.get('tuned_vs_fastest_uncapped'), 0.97)} "
                  f"(in the searches' own probes: {_ratio(ratios.get('tuned_vs_fastest_uncapped_in_the_searches'))})",
              f"- tuned / HF gradient checkpointing: {_goal(ratios.get('tuned_vs_hf_full_checkpointing'), 1.25)}",
              f"- tuned / ckrun's full checkpointing in one pass: {_ratio(ratios.get('tuned_vs_full_checkpointing'))}",
              f"- tuned plan's peak: {_cap(tune.get('tuned_peak'))}"]
    if tune.get("rounds_note"):
        lines.append(f"- {tune['rounds_note']}")
    return "\n".join(lines)


def _ratio(value) -> str:
    return NOT_MEASURED if value is None else f"{value:.2f}"


# --- assembling -----------------------------------------------------------------------------------


FILES = ("campaign", "facts", "calibration", "plans", "knobs", "tune")


def load(directories: list[Path]) -> dict:
    found = {}
    for directory in directories:
        for name in FILES:
            path = Path(directory) / f"{name}.json"
            if path.exists():
                found[name] = json.loads(path.read_text(encoding="utf-8"))
    return found


def render(found: dict) -> str:
    from bench.gpu import sections  # it builds on this module's helpers

    parts = [header(found), figures_table(found)]
    for name, section in (("campaign", sections.campaign_table), ("facts", facts_table),
                          ("calibration", sections.calibration_table), ("plans", plans_table),
                          ("knobs", sections.knobs_table), ("tune", tune_table)):
        if name in found:
            parts.append(section(found[name]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", type=Path, help="directories holding the campaign's results ($OUT of each call)")
    parser.add_argument("--out", type=Path, help="write the markdown here (docs/benchmarks_gpu.md); default stdout")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.results if not Path(d).is_dir()]
    if missing:
        print(f"tables.py: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    markdown = render(load(args.results))
    if args.out:
        args.out.write_text(markdown, encoding="utf-8")
    else:
        sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
