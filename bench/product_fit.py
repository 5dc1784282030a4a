"""The time model's product figures for a GPU, fitted to a published table of measured products.

A product's time in the model (runner/predict/roofline.py) is its FLOPs at a share of the dtype's matrix
peak, slowed by wave quantisation (`DeviceFacts.wave_share`), plus a fixed fill time per product (the tiles'
prologue and epilogue, the last wave's tail): `t = flops / (share * peak * wave) + fill`. Both figures are
fitted, by least squares on log time, to measured throughput of many shapes; the fit is to kernel-level
measurements only, never to training runs.

    python bench/product_fit.py bench/data/xla_sm90_products.csv --gpu h100

prints, per dtype, the share, the fill time and the fit's median and worst error over the rows; the
calibration table's sm90 figures (runner/predict/calibration.json) cite this command.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PEAK_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "tf32", "tf32": "tf32"}  # XLA's f32 runs on TF32 cores


def rows(path: Path) -> list[dict]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    return [{**r, **{k: int(r[k]) for k in "bmnk"}, "flops_per_s": float(r["flops_per_s"])}
            for r in csv.DictReader(lines)]


def fit(measured: list[dict], facts, dtype: str, peak_dtype: str | None = None) -> tuple[float, float, list[float]]:
    """(share, fill seconds, relative errors of the fitted times) for the rows of `dtype`, against the peak of
    `peak_dtype` (default: XLA's naming, its f32 on TF32 cores)."""
    import numpy as np

    chosen = [r for r in measured if r["dtype"] == dtype]
    peak = facts.peak_flops(peak_dtype or PEAK_DTYPE[dtype])
    flops = np.array([2.0 * r["b"] * r["m"] * r["n"] * r["k"] for r in chosen])
    seconds = flops / np.array([r["flops_per_s"] for r in chosen])
    waves = np.array([facts.wave_share((r["b"], r["m"], r["n"]), f) for r, f in zip(chosen, flops, strict=True)])
    shares, fills = np.linspace(0.5, 1.0, 501), np.linspace(0.0, 30e-6, 601)
    best = None
    for share in shares:
        ideal = flops / (share * peak * waves)
        error = np.log((ideal[None, :] + fills[:, None]) / seconds[None, :]) ** 2
        total = error.sum(axis=1)
        index = int(total.argmin())
        if best is None or total[index] < best[0]:
            best = (total[index], share, fills[index])
    _, share, fill = best
    fitted = flops / (share * peak * waves) + fill
    return float(share), float(fill), [float(x) for x in fitted / seconds - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    parser.add_argument("--gpu", default="h100")
    args = parser.parse_args(argv)
    from ckrun.runner.predict.hardware import resolve_device

    facts = resolve_device(args.gpu)
    measured = rows(args.table)
    for dtype in sorted({r["dtype"] for r in measured}):
        share, fill, errors = fit(measured, facts, dtype)
        size = [abs(e) for e in errors]
        print(f"{dtype}: share {share:.3f} of the {PEAK_DTYPE[dtype]} peak, fill {fill * 1e6:.2f} us; "
              f"{len(errors)} rows, |error| median {statistics.median(size):.1%}, worst {max(size):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
