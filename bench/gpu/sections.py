"""The campaign's newer sections for docs/benchmarks_gpu.md (tables.py assembles them): the call's
steps and accounting, the time model's calibration, issue 33's knobs; and the summary the call
prints at its end, one line per figure."""

from __future__ import annotations

from bench.gpu.figures import NOT_MEASURED, figure_texts, gb, percent, size

CLASSES = ("matmul", "matmul_fill_us", "conv", "attention", "attention_causal", "attention_backward",
           "efficient_fp32_slowdown", "norm", "memory", "optimizer", "launch_us")


# --- the call -------------------------------------------------------------------------------------


def campaign_table(campaign: dict) -> str:
    accounting = campaign.get("accounting") or {}
    lines = ["## The call", "",
             f"One call of at most {accounting.get('call_limit_s', '?')} s with the machine's start included: "
             f"start {accounting.get('machine_start_s')} s + transfers {accounting.get('transfers_s')} s + the "
             f"command {accounting.get('command_s')} s (wheels {accounting.get('install_s')} s, then the steps) + "
             f"backstop {accounting.get('backstop_s')} s = {accounting.get('call_total_s')} s; "
             f"{'fits' if accounting.get('fits') else 'DOES NOT FIT'}. Started {campaign.get('started', '?')}"
             + (f"; {campaign['stopped']}" if campaign.get("stopped") else "") + ".", "",
             "| step | what | status | seconds | limit (s) | usual (s) |", "|---|---|---|---|---|---|"]
    for step in campaign.get("steps", []):
        status = step["status"] + (f": {step['reason']}" if step.get("reason") else "")
        lines.append(f"| {step['step']} | {step.get('what', '')} | {status} | {step.get('seconds', '')} | "
                     f"{step.get('limit_s', '')} | {step.get('usual_s', '')} |")
    tests = cuda_tests(campaign)
    if tests:
        lines += ["", f"`pytest -m cuda`: {tests}"]
    return "\n".join(lines)


def cuda_tests(campaign: dict) -> str | None:
    """The pytest summary line of the cuda_tests step, and the failed tests' names."""
    step = next((s for s in campaign.get("steps", []) if s["step"] == "cuda_tests"), None)
    if step is None or "log_tail" not in step:
        return None if step is None else f"{step['status']} ({step.get('reason', '')})"
    lines = step["log_tail"].strip().splitlines()
    failed = [line.split(" ", 2)[1] for line in lines if line.startswith("FAILED ")]
    return f"{step['status']}: {lines[-1] if lines else ''}" + (f"; failed: {', '.join(failed)}" if failed else "")


# --- the calibration ------------------------------------------------------------------------------


def entry_figures(entry: dict) -> dict:
    """An entry's figures as nested values (`{"matmul": {"bf16": 0.8}, "memory": 0.8}`): its rows, one per figure
    (runner/predict/efficiency.py), or an older call's `efficiency` as it was written."""
    if "figures" not in entry:
        return entry.get("efficiency") or {}
    nested: dict = {}
    for row in entry["figures"]:
        head, _, key = row["figure"].partition(".")
        if key:
            nested.setdefault(head, {})[key] = row["value"]
        else:
            nested[head] = row["value"]
    return nested


def shares_text(efficiency: dict) -> str:
    """`matmul bf16 0.81, tf32 0.62; attention flash 0.35; memory 0.85; ...`"""
    parts = []
    for name in CLASSES:
        value = efficiency.get(name)
        if isinstance(value, dict) and value:
            parts.append(f"{name} " + ", ".join(f"{k} {v:.2f}" for k, v in value.items()))
        elif isinstance(value, int | float):
            parts.append(f"{name} {value:.2f}")
    return "; ".join(parts) or NOT_MEASURED


def _rate(row: dict) -> str:
    if row.get("rate") is None:
        return row.get("error", "n/a")
    return f"{row['rate'] / 1e12:.1f} TFLOP/s" if "flops" in row else f"{row['rate'] / 1e9:.0f} GB/s"


def calibration_table(calibration: dict) -> str:
    entry = calibration.get("entry") or {}
    lines = ["## The time model's calibration", "",
             f"Shares of the datasheet peaks ({calibration.get('peaks_from', '?')}) each class of kernel reached "
             f"(bench/gpu/calibrate.py); the entry for runner/predict's calibration table, `applies_to: "
             f"{entry.get('applies_to')}`: {shares_text(entry_figures(entry))}."
             + (f" The table refuses it: {calibration['entry_problem']}." if calibration.get("entry_problem") else ""),
             "", "| class | kernel | dtype | shape | time (ms) | reached | share of peak |", "|---|---|---|---|---|---|---|"]
    for row in calibration.get("rows", []):
        took = "" if row.get("seconds") is None else f"{row['seconds'] * 1e3:.3f}"
        lines.append(f"| {row['op_class']} | {row['kernel']} | {row['dtype']} | {row['shape']} | {took} | "
                     f"{_rate(row)} | {percent(row.get('share'))} |")
    return "\n".join(lines)


# --- the knobs ------------------------------------------------------------------------------------


def knob_rows(knobs: dict) -> list[dict]:
    """Each knob's plan beside the same plan without it (`none` on the same base)."""
    plans = knobs.get("plans", [])
    rows = []
    for plan in plans:
        if not plan.get("knob"):
            continue
        suffix = plan["name"][len(plan["knob"]["label"]):]
        base = next((p for p in plans if p["name"] == "none" + suffix and p.get("status") == "ok"), None)
        rows.append({"plan": plan, "base": base})
    return rows


def _signed(count: int) -> str:
    return ("+" if count >= 0 else "-") + size(abs(count))


def _knob_line(plan: dict, base: dict | None) -> tuple[str, ...]:
    if plan.get("status") != "ok":
        reason = str(plan.get("reason", ""))
        return (reason if reason.startswith(plan.get("status", "?")) else f"{plan.get('status')}: {reason}",) + \
            ("",) * 7
    step = "" if not base else f"{plan['step_time_s'] / base['step_time_s']:.2f}x"
    peak = "" if not base else _signed(plan["measured_peak_bytes"] - base["measured_peak_bytes"])
    loss = "" if not base else f"{max(abs(a - b) for a, b in zip(plan['losses'], base['losses'], strict=False)):.1e}"
    predicted = plan.get("predicted_bytes", plan.get("predicted_here_bytes"))
    predicted_step = plan.get("predicted_step_s")
    return ("ok", f"{plan['step_time_s']:.3f}", "n/a" if predicted_step is None else f"{predicted_step:.3f}", step,
            size(plan["measured_peak_bytes"]), peak, size(predicted), loss)


def knobs_table(knobs: dict) -> str:
    if knobs.get("status") == "none present":
        return "## Pool knobs\n\nNone present in this checkout's memory plan."
    lines = ["## Pool knobs", "",
             "Each knob on the whole batch in one pass with full checkpointing, beside the same plan without it "
             "(`none`); where the recipe refuses a knob there, once more without gradient clipping.", "",
             "| knob | status | step time (s) | predicted (s) | vs without | measured peak | vs without | predicted peak "
             "| max loss diff vs without |", "|---|---|---|---|---|---|---|---|---|"]
    for row in knob_rows(knobs):
        lines.append(f"| {row['plan']['name']} | " + " | ".join(_knob_line(row["plan"], row["base"])) + " |")
    experts = (knobs.get("experts") or {}).get("plans") or []
    if experts:
        base = next((p for p in experts if p["name"] == "experts grouped_mm" and p.get("status") == "ok"), None)
        lines += ["", "Mixture of experts (recipes/mixtral_tiny.yaml at the width knobs.py gives): transformers' "
                  "grouped_mm experts beside its eager loop.", "",
                  "| experts | status | step time (s) | predicted (s) | vs grouped_mm | measured peak | vs grouped_mm | "
                  "predicted peak | max loss diff |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {plan['name']} | " + " | ".join(_knob_line(plan, base)) + " |" for plan in experts]
    left = knobs.get("left_out") or []
    if left:
        lines += ["", "Left out: " + "; ".join(f"{item['field']} {item.get('policy', '')}: {item['reason']}"
                                               for item in left) + "."]
    return "\n".join(lines)


# --- the summary ----------------------------------------------------------------------------------


def summary_lines(found: dict) -> list[str]:
    """One line per figure the campaign measures, "not measured" where its step did not run."""
    facts, calibration = found.get("facts") or {}, found.get("calibration") or {}
    versions = next((found[n].get("versions") for n in ("facts", "calibration", "plans", "tune")
                     if (found.get(n) or {}).get("versions")), None) or {}
    matmul = facts.get("matmul") or {}
    context = facts.get("context") or {}
    lines = [
        "device: " + (", ".join([versions.get("device", "?")] + [f"{k} {versions[k]}" for k in
                                                                  ("torch", "cuda", "driver", "date") if versions.get(k)])
                      if versions else NOT_MEASURED) + (" (DRY RUN: a CPU at toy sizes)" if _dry(found) else ""),
        "bf16 matmul: " + (NOT_MEASURED if not matmul.get("bf16_flops_per_s") else
                           f"{matmul['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s at {matmul.get('shape')}"
                           + (f", {percent(matmul['datasheet_share'])} of the datasheet peak"
                              if matmul.get("datasheet_share") else "")),
        "calibration: " + shares_text(entry_figures(calibration.get("entry") or {})),
        "CUDA context: " + (NOT_MEASURED if not context.get("context_at_init_bytes") else
                            f"{gb(context['context_at_init_bytes'])} GB at init, "
                            f"{gb(context.get('context_after_bert_kernels_bytes'))} GB after a step's kernels"),
    ]
    texts = figure_texts(found)
    lines += [f"{name}: {texts[name]}" for name in ("P4", "step time", "P6")]
    lines.append("knobs: " + knobs_summary(found.get("knobs")))
    lines += [f"{name}: {texts[name]}" for name in ("P1", "P2", "P5", "cap")]
    campaign = found.get("campaign") or {}
    lines.append("cuda tests: " + (cuda_tests(campaign) or NOT_MEASURED))
    lines.append("steps: " + (", ".join(f"{s['step']} {s['status']}" + (f" {s['seconds']:.0f} s" if "seconds" in s else "")
                                        for s in campaign.get("steps", [])) or "no campaign.json"))
    return lines


def _dry(found: dict) -> bool:
    return any((found.get(name) or {}).get("dry_run") for name in found)


def knobs_summary(knobs: dict | None) -> str:
    if not knobs:
        return NOT_MEASURED
    if knobs.get("status") == "none present":
        return "none present in this checkout"
    parts = []
    for row in knob_rows(knobs):
        plan, base = row["plan"], row["base"]
        if plan.get("status") != "ok" or not base:
            parts.append(f"{plan['name']} {plan.get('status')}")
            continue
        parts.append(f"{plan['name']} peak {_signed(plan['measured_peak_bytes'] - base['measured_peak_bytes'])}, "
                     f"step {plan['step_time_s'] / base['step_time_s']:.2f}x")
    return "; ".join(parts) or "no knob measured"
