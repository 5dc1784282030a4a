"""The GPU campaign in one call: its steps in order of value, each in its own process within its
share of the call, results written as they land, one summary line per figure at the end.

    python bench/gpu/campaign.py OUT_DIR [STEP ...] [--budget-s 375] [--dry-run]   (bash bench/gpu/call.sh runs it)
    python bench/gpu/campaign.py --accounting                                      # the plan, before any GPU

Steps (`STEPS`), in this order unless named: facts (device facts and the time model's per-op-class
calibration), plans (BERT-large's plans, predicted vs measured: the calibration data), knobs (the pool
knobs and grouped_mm experts, predicted vs measured), tune (`ckrun tune` and its P1/P2 figures: in the
second call), cuda_tests (`pytest -m cuda`, when time is left; else in a second call).

The budget. A step starts only when its usual time (`usual_s`, from the H100 runs and the sizes
chosen) is left; it gets at most `most_s` (the last steps: whatever is left), told to it as its own
`--budget-s`, and its whole process group is killed at that limit, so a hung step costs no more than
its share. A watchdog writes campaign.json and ends the call at the deadline. `accounting()` checks
before any GPU is asked for that the first call fits 9 minutes with the machine's start included
(budget.py), the dry run in the default tests asserts it, and campaign.json carries it.

What comes back. A call brings back at most 8 files from $OUT: campaign.json (the accounting, each
step's status, time, files and log tail, the summary lines), facts.json, calibration.json,
plans.json, snapshot_full_mb16.json.gz, knobs.json, tune.json. Each is rewritten whole as its step
measures (a crash or a timeout loses nothing already measured); full logs stay on the machine, and
a copy of each step's files stays there too (`kept()`: /tmp/ckrun-campaign-last, or
$CKRUN_CAMPAIGN_KEPT), where a second call's tune finds the first call's plans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package
    sys.path.insert(0, str(REPO))

from bench.gpu import budget as call  # noqa: E402
from bench.gpu.budget import Budget, write_json  # noqa: E402

EXIT_S = 5  # a step is told its limit less this: time to write its results and leave before it is killed
LOG_TAIL = 3000  # characters of each step's log kept in campaign.json


def kept() -> Path:
    """Where each step's results are copied too: $OUT is emptied before every call, and a second call on
    the warm machine (`call.sh tune`) still finds the first call's plans there."""
    return Path(os.environ.get("CKRUN_CAMPAIGN_KEPT") or Path(tempfile.gettempdir()) / "ckrun-campaign-last")


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    usual_s: float  # what it usually takes on an H100: it starts only with this much left
    most_s: float | None  # the most it may take; None: whatever is left
    outputs: tuple[str, ...]  # its files under OUT
    command: Callable[[Path, float, bool], list[str]]  # (OUT, its budget in seconds, dry run) -> argv


def _script(name: str, *extra: str) -> Callable[[Path, float, bool], list[str]]:
    def command(out: Path, seconds: float, dry_run: bool) -> list[str]:
        return [sys.executable, str(REPO / "bench" / "gpu" / name), str(out), "--budget-s", f"{seconds:.0f}",
                *(["--dry-run"] if dry_run else []), *(part.format(out=out, kept=kept()) for part in extra)]
    return command


def _cuda_tests(out: Path, seconds: float, dry_run: bool) -> list[str]:
    # the dry run collects one CUDA-marked file: the command line is checked, no test needs a GPU
    scope = ["--collect-only", "tests/runner/predict/test_hardware.py"] if dry_run else []
    return [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rf", *scope]


STEPS = (
    Step("facts", "device facts, memory facts and the per-op-class calibration (bf16 matmul rate first)",
         30, 60, ("facts.json", "calibration.json"), _script("facts.py")),
    Step("plans", "BERT-large's plans: predicted vs measured step time and peak", 45, 110,
         ("plans.json", "snapshot_full_mb16.json.gz"), _script("plans.py")),
    Step("knobs", "the pool knobs (torchao's low-bit AdamW, bf16 weights, the host offload, the step in backward, the "
         "chunked loss) and grouped_mm experts, each against the same plan without it", 90, 120, ("knobs.json",),
         _script("knobs.py")),
    Step("tune", "ckrun tune under 40 GB; P1, P2, P5 and the cap's use", 140, None, ("tune.json",),
         _script("tune.py", "--plans", "{out}/plans.json", "--plans", "{kept}/plans.json")),
    Step("cuda_tests", "pytest -m cuda", 90, None, (), _cuda_tests),
)
# what the first call's accounting guarantees a start: the calibration, the plans and the knobs (issue 44); tune
# (about 140 s) follows in the second call on the warm machine
FIRST_CALL = ("facts", "plans", "knobs")


# --- the accounting -------------------------------------------------------------------------------


def accounting(steps: tuple[Step, ...] = STEPS, install_s: float = call.INSTALL_S) -> dict:
    """The first call, planned before it runs: each step given its most after the ones before took
    theirs, the machine's start, the transfers and the backstop around the command. `fits` says
    that the call stays within CALL_S and every step of FIRST_CALL still gets its usual time."""
    left, planned = call.COMMAND_S - install_s, {}
    for step in steps:
        gets = max(0.0, left if step.most_s is None else min(step.most_s, left))
        planned[step.name] = {"usual_s": step.usual_s, "most_s": step.most_s, "gets_at_least_s": gets,
                              "starts": gets >= step.usual_s}
        left -= gets
    total = call.MACHINE_START_S + call.TRANSFERS_S + call.COMMAND_S + call.BACKSTOP_S
    fits = total <= call.CALL_S and all(planned[name]["starts"] for name in FIRST_CALL if name in planned)
    return {"session_s": call.SESSION_S, "call_limit_s": call.CALL_S, "machine_start_s": call.MACHINE_START_S,
            "transfers_s": call.TRANSFERS_S, "command_s": call.COMMAND_S, "backstop_s": call.BACKSTOP_S,
            "install_s": install_s, "call_total_s": total, "run_timeout_s": call.RUN_TIMEOUT_S,
            "second_call_command_s": call.SECOND_CALL_S, "steps": planned, "fits": fits}


# --- running the steps ----------------------------------------------------------------------------


class Runner:
    """Runs steps one after another in their own process groups; campaign.json after each."""

    def __init__(self, out: Path, budget: Budget, dry_run: bool, record: dict):
        self.out, self.budget, self.dry_run, self.record = out, budget, dry_run, record
        self.logs = Path(tempfile.mkdtemp(prefix="ckrun-campaign-logs-"))  # full logs stay on the machine
        self.child: subprocess.Popen | None = None

    def write(self) -> None:
        self.record["budget"] = self.budget.record()
        write_json(self.out / "campaign.json", self.record)

    def at_deadline(self) -> None:
        """The watchdog's last act: the running step's group killed, what was measured written and
        summed up."""
        self.kill()
        self.record["stopped"] = "at the call's deadline"
        self.record["summary"] = summary(self.out)
        self.write()
        print_summary(self.record)

    def kill(self) -> None:
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signal.SIGKILL)  # its probes and tuners too
            except ProcessLookupError:
                pass

    def run(self, step: Step) -> dict:
        entry = {"step": step.name, "what": step.what, "usual_s": step.usual_s, "most_s": step.most_s}
        why_not = self.skip_reason(step)
        if why_not:
            entry.update(status="skipped", reason=why_not)
        else:
            entry.update(self.launch(step))
        entry["files"] = {name: (self.out / name).stat().st_size for name in step.outputs if (self.out / name).exists()}
        self.keep(entry["files"])
        entry["ended_at"] = time.time()  # its files are older: written as it measured, not at the campaign's end
        self.record["steps"].append(entry)
        self.write()
        print(f"campaign: {step.name}: {entry['status']}" + (f" in {entry['seconds']:.0f} s" if "seconds" in entry
              else f" ({entry.get('reason')})"), flush=True)
        return entry

    def keep(self, files: dict) -> None:
        place = kept()
        if self.out.resolve() == place.resolve():
            return
        place.mkdir(parents=True, exist_ok=True)
        for name in files:
            shutil.copyfile(self.out / name, place / name)

    def skip_reason(self, step: Step) -> str | None:
        if step.name == "knobs" and not self.knobs_present():
            return "not present: this checkout's memory plan has no knob beyond those the plans step measures"
        if not self.dry_run and not self.budget.allows(step.usual_s):
            return f"{self.budget.left():.0f} s of the call left, it usually takes {step.usual_s:.0f} s"
        return None

    def knobs_present(self) -> bool:
        from bench.gpu import knobs

        found, left = knobs.present()
        self.record["knobs_looked_for"] = {"knobs": [k["label"] for k in found], "left_out": left}
        return bool(found)

    def launch(self, step: Step) -> dict:
        most = step.most_s if step.most_s is not None and not self.dry_run else self.budget.left()
        limit = max(1.0, min(most, self.budget.left()))
        command = step.command(self.out, max(1.0, limit - EXIT_S), self.dry_run)
        log = self.logs / f"{step.name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        with open(log, "w", encoding="utf-8") as sink:
            self.child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=REPO, env=env, start_new_session=True)
            try:
                code, status = self.child.wait(timeout=limit), None
            except subprocess.TimeoutExpired:
                self.kill()
                code, status = self.child.wait(), "timed out"
        self.child = None
        tail = log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL:]
        status = status or ("done" if code == 0 else "cut short at its deadline" if code == 124 else
                            f"failed (exit {code})")
        return {"status": status, "exit_code": code, "seconds": round(time.monotonic() - started, 1),
                "limit_s": round(limit), "command": command[1:], "log": str(log), "log_tail": tail}


def run_steps(out: Path, names: list[str], budget: Budget, dry_run: bool, steps: tuple[Step, ...] = STEPS) -> dict:
    """Every named step in order within `budget`; campaign.json after each, and at the deadline."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"dry_run": dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "accounting": accounting(steps),
              "steps_asked": names, "steps": [], "nvidia_smi": _nvidia_smi(out)}
    campaign = Runner(out, budget, dry_run, record)
    watchdog = budget.arm(campaign.at_deadline, call.DEADLINE_EXIT)
    campaign.write()
    for step in (s for s in steps if s.name in names):
        campaign.run(step)
    record["summary"] = summary(out)
    record["next"] = next_call(record)
    campaign.write()
    watchdog.set()  # done in time: a caller that goes on (a test) must not be ended at the deadline
    return record


def _nvidia_smi(out: Path) -> str | None:
    """call.sh's nvidia-smi line, folded into campaign.json (a call brings back at most 8 files)."""
    path = out / "nvidia-smi.txt"
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    path.unlink()
    return text.strip()


def summary(out: Path) -> list[str]:
    from bench.gpu.sections import summary_lines
    from bench.gpu.tables import load

    return summary_lines(load([out]))


def next_call(record: dict) -> str | None:
    """The command for a second call, when steps were skipped or cut short (and the session has time)."""
    unfinished = [s["step"] for s in record["steps"] if s["status"] != "done" and not
                  s.get("reason", "").startswith("not present")]
    if not unfinished:
        return None
    return f"bash bench/gpu/call.sh {' '.join(unfinished)}   # a second call, on the warm machine, if " \
           f"{call.SECOND_CALL_S + call.TRANSFERS_S + call.BACKSTOP_S} s of device time are left"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("steps", nargs="*", help=f"steps to run, in the campaign's order (default: all of "
                                                 f"{', '.join(s.name for s in STEPS)})")
    parser.add_argument("--budget-s", type=float, help=f"the campaign's seconds (default {call.COMMAND_S - call.INSTALL_S}; "
                                                       f"call.sh passes what its install left)")
    parser.add_argument("--dry-run", action="store_true", help="every step at toy size on the CPU")
    parser.add_argument("--accounting", action="store_true", help="print the first call's plan and leave")
    args = parser.parse_args(argv)
    if args.accounting or args.out is None:
        print(json.dumps(accounting(), indent=1))
        return 0
    unknown = sorted(set(args.steps) - {s.name for s in STEPS})
    if unknown:
        print(f"campaign.py: no step {', '.join(unknown)}; steps: {', '.join(s.name for s in STEPS)}", file=sys.stderr)
        return 2
    seconds = args.budget_s or (call.DRY_RUN_S if args.dry_run else call.COMMAND_S - call.INSTALL_S)
    record = run_steps(args.out, args.steps or [s.name for s in STEPS], Budget(seconds), args.dry_run)
    print_summary(record)
    return 0


def print_summary(record: dict) -> None:
    print("\n".join(["", "campaign summary (one line per figure):", *record.get("summary", [])]), flush=True)
    if record.get("next"):
        print(f"next: {record['next']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
