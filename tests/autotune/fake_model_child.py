"""A model child for tests: the protocol of ckrun.autotune.probes.model_child (facts.json, ready.json, one
answer-N.json per request line) without torch, faulting where FAKE_MODEL_FAULTS says.

FAKE_MODEL_FAULTS=STAGE:KIND[,...]: STAGE is `facts`, `ready` or the number of a request (counted
over every child a test starts, from FAKE_MODEL_COUNTER); KIND is `hang`, `segfault`, `exit` or
`raise` (an answer with status crash, as a Python exception in the user's forward gives).

FAKE_MODEL_TENSOR=JSON: the facts' tensor_parallel (autotune/space/tp_facts.py). Under --nproc N a
request is read back as the tuner's typed Candidate and answered from a formula with a time (for
`tune --predict`): 800 MB of parameters and optimizer state split over FSDP2's group, 50 MB per
sample of a micro-batch, and a communication cost per strategy."""

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
    tensor = json.loads(os.environ.get("FAKE_MODEL_TENSOR", "null"))
    act(fault("facts"), directory / "facts.json", {"status": "ok", "container_name": "blocks", "blocks": ["b.0", "b.1"],
                                                   "containers": ["b", "b"], "batchnorm": [], "dropout": [],
                                                   **({"tensor_parallel": tensor} if tensor else {})})
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
        nproc = int(sys.argv[sys.argv.index("--nproc") + 1]) if "--nproc" in sys.argv else 1
        answer = ranked(request, nproc) if nproc > 1 else {"peak_bytes": 1000 * request["plan"]["micro_batch"]}
        act(fault(str(number)), directory / f"answer-{request['id']}.json", {"status": "ok", "warnings": [], **answer})


COMMUNICATION_S = {"ddp": 0.002, "fsdp": 0.010, "hsdp": 0.006, "tp": 0.008}


def ranked(request: dict, nproc: int) -> dict:
    from ckrun.autotune.space.candidate import Candidate  # the request must read back as the tuner's typed candidate

    candidate = Candidate.from_request(request)
    plan, strategy = candidate.plan, candidate.strategy
    micro, share = plan.micro_batch, 8 // strategy.data_parallel(nproc)
    peak = 800_000_000 // strategy.shard_group(nproc) + 50_000_000 * micro
    keep = plan.sharding is not None and not plan.sharding.reshard_after_forward
    seconds = 0.001 * share / micro + COMMUNICATION_S[strategy.strategy] - 0.001 * keep
    time = {"seconds": seconds, "samples_per_s": 8 / seconds, "mfu": 0.5, "hfu": 0.5}
    return {"peak_bytes": peak, "time": time}


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
