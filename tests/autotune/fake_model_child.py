"""A model child for tests: the protocol of autotune.model_child (facts.json, ready.json, one
answer-N.json per request line) without torch, faulting where FAKE_MODEL_FAULTS says.

FAKE_MODEL_FAULTS=STAGE:KIND[,...]: STAGE is `facts`, `ready` or the number of a request (counted
over every child a test starts, from FAKE_MODEL_COUNTER); KIND is `hang`, `segfault`, `exit` or
`raise` (an answer with status crash, as a Python exception in the user's forward gives)."""

import json
import os
import signal
import sys
import time
from pathlib import Path


def fault(stage: str) -> str | None:
    for item in os.environ.get("FAKE_MODEL_FAULTS", "").split(","):
        where, _, kind = item.partition(":")
        if where == stage:
            return kind
    return None


def act(kind: str | None, path: Path, answer: dict) -> None:
    if kind == "hang":
        time.sleep(3600)
    elif kind == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "exit":
        os._exit(7)
    elif kind == "raise":
        answer = {"status": "crash", "reason": "RuntimeError: injected"}
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(answer))
    os.replace(temporary, path)


def main() -> None:
    directory, facts_only = Path(sys.argv[2]), "--facts-only" in sys.argv
    act(fault("facts"), directory / "facts.json", {"status": "ok", "container_name": "blocks", "blocks": ["b.0", "b.1"],
                                                   "containers": ["b", "b"], "batchnorm": [], "dropout": []})
    if facts_only:
        return
    act(fault("ready"), directory / "ready.json", {"status": "ok"})
    counter = Path(os.environ["FAKE_MODEL_COUNTER"])
    for line in sys.stdin:
        request = json.loads(line)
        if "frontier" in request:  # no solver here; not counted, so faults keep their numbers
            act(None, directory / f"answer-{request['id']}.json", {"status": "unavailable", "reason": "fake child"})
            continue
        number = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(number + 1))
        peak = 1000 * request["plan"]["micro_batch"]
        act(fault(str(number)), directory / f"answer-{request['id']}.json",
            {"status": "ok", "peak_bytes": peak, "warnings": []})


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
