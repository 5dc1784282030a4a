"""A module the warm-server tests fork as `python -m warm_target OUT [--parent PID] [--code N | --signal N |
--sleep S]`: it writes what it sees (argv, cwd, an environment variable, its session, a stdin line) to OUT."""

import json
import os
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    out = args[0]
    option = lambda name: args[args.index(name) + 1] if name in args else None  # noqa: E731
    if option("--parent"):
        from ckrun.autotune.probes.child import die_with_parent

        die_with_parent(int(option("--parent")))
    seen = {"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WARM_TEST"),
            "sid": os.getsid(0), "pid": os.getpid(), "ppid": os.getppid(),
            "stdin": sys.stdin.readline().strip() if option("--read") else None}
    print("warm_target ran", flush=True)
    with open(out, "w", encoding="utf-8") as file:
        json.dump(seen, file)
    if option("--signal"):
        os.kill(os.getpid(), int(option("--signal")))
    if option("--sleep"):
        time.sleep(float(option("--sleep")))
    return int(option("--code") or 0)


if __name__ == "__main__":
    sys.exit(main())
