"""The time model's calibration: the rows kernel_rates.py measures on a card made into one entry of
runner/predict's per-op-class table, and the command that writes a campaign's entry there.

    rows = kernel_rates.measure(...)     # one dict per measurement (kernel_rates.py)
    entry = calibration_entry(rows, ...) # the shape of runner/predict's calibration table

The entry (`calibration_entry`) is one entry of the time model's calibration table
(runner/predict/calibration.json): `applies_to` (ckrun's key for the card, else its compute capability
`smXY`), `figures` (one row per fact: `matmul.bf16`, `matmul_fill_us.bf16`, `attention.flash`,
`attention_causal.flash`, `attention_backward.flash`, `efficient_fp32_slowdown`, `memory`, `norm.forward`,
`norm.backward`, `optimizer`, `launch_us`, each with the rows it was taken from), `source`, `device`,
`date`, `versions`. Products: a share and a fill time fitted to the products by shape, as
bench/product_fit.py fits a published table (the large square products alone where too few shapes were
measured); attention: the median share of each family's forward rows without and with a causal mask and
of its backward rows; the memory-efficient kernel's fp32 slowdown from its fp32 and bf16 rows of one shape;
the rest the median of their rows. A figure nothing measured is left out: the entry less specific than
this one gives it. `python bench/gpu/calibrate.py OUT/calibration.json --write` puts a measured entry into
the repository's table; `--facts-json FILE` writes the card's measured facts (with the host's AdamW rate)
for `--gpu FILE`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package
    sys.path.insert(0, str(REPO))

from bench.gpu.kernel_rates import DTYPES  # noqa: E402

TILE = 128  # a product's output tile edge: not measured here, the table's default
MIN_PRODUCT_SHAPES = 4  # fewer products by shape than this: the share from the large squares, no fill time


# --- the table's entry ----------------------------------------------------------------------------


def _match(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if r.get("share") and all(r.get(k) == v for k, v in match.items())]


def _median(rows: list[dict]) -> float | None:
    """The median share, kept within (0, 1] as the table's shares are; None without a measurement."""
    return min(1.0, statistics.median(r["share"] for r in rows)) if rows else None


def figures(rows: list[dict], facts=None) -> list[dict]:
    """The entry's figure rows (module docstring), each saying which measured rows it comes from."""
    found: list[dict] = []

    def add(name: str, value: float | None, chosen: list[dict], how: str) -> None:
        if value is not None:
            shapes = "; ".join(f"{r['kernel']} {r.get('direction', '')} {r['shape']}".replace("  ", " ") for r in chosen)
            found.append({"figure": name, "value": round(value, 4),
                          "source": f"measured by the GPU campaign: {how} of {len(chosen)} row(s) ({shapes})"})

    for dtype in DTYPES:
        _products(add, rows, dtype, facts)
        add(f"conv.{dtype}", _median(chosen := _match(rows, op_class="conv", dtype=dtype)), chosen, "median share")
    for family in ("flash", "efficient", "cudnn"):
        for name, causal, direction in (("attention", False, "forward"), ("attention_causal", True, "forward"),
                                        ("attention_backward", False, "backward")):
            chosen = _match(rows, op_class="attention", kernel=family, dtype="bf16", causal=causal, direction=direction)
            add(f"{name}.{family}", _median(chosen), chosen, "median share")
    _fp32_slowdown(add, rows)
    add("memory", _median(chosen := _match(rows, op_class="memory")), chosen, "median share of bandwidth")
    for direction in ("forward", "backward"):
        chosen = _match(rows, op_class="norm", direction=direction)
        add(f"norm.{direction}", _median(chosen), chosen, "median share of bandwidth")
    chosen = _match(rows, op_class="optimizer", kernel="adamw_fused")
    add("optimizer", _median(chosen), chosen, "share of bandwidth (fused AdamW)")
    launch = [r for r in rows if r.get("op_class") == "launch" and r.get("seconds")]
    add("launch_us", launch[0]["seconds"] * 1e6 if launch else None, launch, "seconds an autograd-recording add takes")
    return found


def _products(add, rows: list[dict], dtype: str, facts) -> None:
    """matmul.DTYPE and matmul_fill_us.DTYPE: fitted to the products by shape where enough were measured."""
    large = _match(rows, op_class="matmul", kernel="large", dtype=dtype)
    shaped = [r for r in rows if r.get("op_class") == "matmul" and r.get("dtype") == dtype and r.get("rate")]
    if facts is None or len(shaped) < MIN_PRODUCT_SHAPES or getattr(facts, "sms", 0) == 0:
        add(f"matmul.{dtype}", _median(large), large, "share of the large square product")
        return
    from bench.product_fit import fit

    table = [{"dtype": dtype, "b": 1, "m": r["shape"][0], "n": r["shape"][1], "k": r["shape"][2],
              "flops_per_s": r["rate"]} for r in shaped]
    share, fill, errors = fit(table, facts, dtype, dtype)
    how = f"fitted (bench/product_fit.py: |error| median {statistics.median(abs(e) for e in errors):.1%})"
    add(f"matmul.{dtype}", min(1.0, share), shaped, how)
    add(f"matmul_fill_us.{dtype}", fill * 1e6, shaped, how)


def _fp32_slowdown(add, rows: list[dict]) -> None:
    """efficient_fp32_slowdown: the memory-efficient kernel's fp32 forward time over its bf16 one, same shape."""
    fp32 = [r for r in rows if r.get("op_class") == "attention" and r.get("kernel") == "efficient"
            and r.get("dtype") == "fp32" and r.get("direction") == "forward" and r.get("seconds")]
    for row in fp32:
        twin = next((r for r in rows if r.get("kernel") == "efficient" and r.get("dtype") == "bf16"
                     and r.get("direction") == "forward" and r.get("shape") == row["shape"] and r.get("seconds")), None)
        if twin:
            add("efficient_fp32_slowdown", max(1.0, row["seconds"] / twin["seconds"]), [row, twin],
                "fp32 over bf16 forward time")
            return


def calibration_entry(rows: list[dict], versions: dict, applies_to: str, facts=None) -> dict:
    """The measured entry for runner/predict's calibration table (module docstring); `facts`: the card's
    datasheet facts the shares are of (for the products' fit: its SMs)."""
    measured = sum(1 for r in rows if "error" not in r)
    return {"applies_to": applies_to, "figures": figures(rows, facts),
            "source": f"measured by the GPU campaign (bench/gpu/calibrate.py, {measured} of {len(rows)} rows): products "
                      "by shape per dtype, convolutions forward and backward, attention forward and backward per kernel "
                      "family, memory-bound and normalisation kernels, fused AdamW, the launch floor; tile not measured",
            "device": versions.get("device", "?"), "date": versions.get("date", datetime.date.today().isoformat()),
            "versions": ", ".join(f"{k} {versions.get(k)}" for k in ("torch", "cuda", "cudnn", "driver")
                                  if versions.get(k) is not None)}


def applies_to(device_name: str, capability: str | None) -> str:
    """ckrun's key for the card (`h100`), else its compute capability (`sm90`), else `*`; `cpu` in a dry run."""
    from ckrun.runner.predict import hardware

    if device_name.startswith("cpu"):
        return "cpu"

    try:
        facts = hardware.resolve_device(device_name)
        return next((key for key, row in hardware.GPUS.items() if row.name == facts.name), None) or \
            (f"sm{capability.replace('.', '')}" if capability else "*")
    except Exception:  # noqa: BLE001 - an unknown card is named by its capability
        return f"sm{capability.replace('.', '')}" if capability else "*"


def check_entry(entry: dict) -> str | None:
    """None where runner/predict's table takes the entry (or has no table yet to ask), else why not."""
    try:
        from ckrun.runner.predict.efficiency import CalibrationEntry
    except ImportError:
        return None
    try:
        CalibrationEntry.model_validate(entry)
    except Exception as err:  # noqa: BLE001 - the reason is the answer
        return (str(err).strip().splitlines() or ["invalid"])[0][:300]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="put a campaign's measured calibration into runner/predict's table")
    parser.add_argument("calibration", type=Path, help="OUT/calibration.json from a GPU campaign")
    parser.add_argument("--write", action="store_true", help="write its entry into runner/predict/calibration.json")
    parser.add_argument("--facts-json", type=Path, help="write the card's measured facts here (for --gpu FILE)")
    args = parser.parse_args(argv)
    found = json.loads(args.calibration.read_text(encoding="utf-8"))
    entry = found["entry"]
    print(json.dumps(entry, indent=1))
    if args.facts_json and found.get("device_facts"):
        facts = dict(found["device_facts"])
        adamw = next((r for r in found.get("rows", []) if r.get("kernel") == "adamw" and r.get("params_per_s")), None)
        if adamw:  # the host's measured AdamW rate (memory.optimizer_offload's update)
            facts["host_adamw_per_s"] = adamw["params_per_s"]
        args.facts_json.write_text(json.dumps(facts, indent=1), encoding="utf-8")
        print(f"written: {args.facts_json} (ckrun estimate --gpu {args.facts_json})")
    if found.get("dry_run") and args.write:
        print("calibrate.py: a dry run's figures (a CPU at toy sizes): not written", file=sys.stderr)
        return 2
    if args.write:
        try:
            from ckrun.runner.predict.efficiency import CalibrationEntry, write_entry
        except ImportError:
            print("calibrate.py: this checkout's runner/predict has no calibration table (efficiency.py)",
                  file=sys.stderr)
            return 2
        write_entry(CalibrationEntry.model_validate(entry))
        print(f"written: the {entry['applies_to']!r} entry of runner/predict/calibration.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
