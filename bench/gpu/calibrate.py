"""The time model's calibration: the rows kernel_rates.py measures on a card made into one entry of
runner/predict's per-op-class table, and the command that writes a campaign's entry there.

    rows = kernel_rates.measure(...)     # one dict per measurement (kernel_rates.py)
    entry = calibration_entry(rows, ...) # the shape of runner/predict's calibration table

The entry (`calibration_entry`) is one entry of the time model's per-op-class table
(runner/predict/calibration.json, issue 35): `applies_to` (ckrun's key for the card, else its
compute capability `smXY`), `efficiency` {matmul: {dtype: share}, conv: {dtype: share}, attention:
{family: share}, memory: share, optimizer: share, tile}, `source`, `device`, `date`, `versions`.
Shares come from the large products (8192^3: little wave quantisation), the median of each other
class's rows, and fused AdamW (what ckrun's trainer runs on CUDA). The products by shape stay in the
rows for a wave-quantisation model to be checked against. `python bench/gpu/calibrate.py OUT/calibration.json
--write` puts a measured entry into the repository's table, where runner/predict has one.
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


# --- the table's entry ----------------------------------------------------------------------------


def _shares(rows: list[dict], **match) -> list[float]:
    return [r["share"] for r in rows if r.get("share") and all(r.get(k) == v for k, v in match.items())]


def _share(values: list[float]) -> float | None:
    """The median share, kept within (0, 1] as the table's shares are; None without a measurement."""
    return min(1.0, statistics.median(values)) if values else None


def efficiency(rows: list[dict]) -> dict:
    """{matmul, conv, attention, memory, optimizer, tile} from the rows (module docstring); a class or
    dtype nothing measured is left out."""
    found = {"matmul": {d: _share(_shares(rows, op_class="matmul", kernel="large", dtype=d)) for d in DTYPES},
             "conv": {d: _share(_shares(rows, op_class="conv", dtype=d)) for d in DTYPES},
             "attention": {f: _share(_shares(rows, op_class="attention", kernel=f))
                           for f in ("flash", "efficient", "cudnn")},
             "memory": _share(_shares(rows, op_class="memory")),
             "optimizer": _share(_shares(rows, op_class="optimizer", kernel="adamw_fused")), "tile": TILE}
    return {k: ({d: s for d, s in v.items() if s is not None} if isinstance(v, dict) else v)
            for k, v in found.items() if v is not None and v != {}}


def calibration_entry(rows: list[dict], versions: dict, applies_to: str) -> dict:
    """The measured entry for runner/predict's calibration table (module docstring)."""
    measured = sum(1 for r in rows if "error" not in r)
    return {"applies_to": applies_to, "efficiency": efficiency(rows),
            "source": f"measured by the GPU campaign (bench/gpu/calibrate.py, {measured} of {len(rows)} rows): "
                      "matmul from 8192^3 products per dtype, conv from ResNet-50 convolutions forward and backward, "
                      "attention from SDPA forward and backward per kernel family (causal at half the counted FLOPs), "
                      "memory from a copy, add, GELU, layer norm and softmax (median), optimizer from fused AdamW "
                      "over BERT-large's parameter shapes; tile not measured",
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
        args.facts_json.write_text(json.dumps(found["device_facts"], indent=1), encoding="utf-8")
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
