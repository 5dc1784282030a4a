"""Put on PYTHONPATH by test_ranks.py: a real kill -9 of one rank at a chosen moment of a DCP save.

CKRUN_KILL="RANK:STEP:MOMENT" makes that rank SIGKILL itself while saving the checkpoint of STEP:
`shards` right after its shards are written (before the barrier), `marker` (rank 0) just before the
COMPLETE marker. Processes without that RANK (the launcher, the other ranks) are left alone.
"""

import os
import signal
import sys

_wanted = os.environ.get("CKRUN_KILL", "")
if _wanted and os.environ.get("RANK") == _wanted.split(":")[0]:
    _rank, _step, _moment = _wanted.split(":")
    import ckrun.runner.train.checkpoint.sharded as _sharded

    _name = "rng_state" if _moment == "shards" else "_mark_complete"
    _real = getattr(_sharded, _name)

    def _kill_at_step(*args, **kwargs):
        saving = sys._getframe(1).f_locals  # save_sharded's frame: the trainer, or the marker's step
        step = saving["trainer"].step if "trainer" in saving else args[1]
        if step == int(_step):
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(*args, **kwargs)

    setattr(_sharded, _name, _kill_at_step)
