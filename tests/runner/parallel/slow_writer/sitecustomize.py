"""Put on PYTHONPATH by test_async_checkpoint.py: DCP's file writer sleeps while it writes the
checkpoint of one step, so that save stays in flight. CKRUN_SLOW_WRITE="STEP:SECONDS"."""

import os

_wanted = os.environ.get("CKRUN_SLOW_WRITE", "")
if _wanted:
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    _step, _seconds = _wanted.split(":")
    _real = FileSystemWriter.write_data

    def _slow_write_data(self, plan, planner):
        if f"step-{int(_step):08d}" in str(self.path):
            time.sleep(float(_seconds))
        return _real(self, plan, planner)

    FileSystemWriter.write_data = _slow_write_data
