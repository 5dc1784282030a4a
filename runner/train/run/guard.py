"""What can end a run early besides bad input, each turned into one line and a distinct exit status:
a loss that stopped being a number, a stop asked for by SIGINT/SIGTERM, memory the machine
cannot give, and user code (a model factory, a config class) that raises while being built.
"""

from __future__ import annotations

import logging
import math
import signal
import threading

from ...problems import EXIT_NON_FINITE, CkrunError
from ..checkpoint.store import complete_checkpoints

log = logging.getLogger(__name__)

# fp16: the GradScaler skips a step whose gradients overflowed and halves its scale; that is normal.
# A loss that stays non-finite this many steps in a row is not an overflow the scale can fix.
FP16_NON_FINITE_LIMIT = 20


class NonFiniteLoss(CkrunError, RuntimeError):
    """The loss of an optimizer step was NaN or infinite; the weights after it are not worth keeping."""

    exit_status = EXIT_NON_FINITE
    every_rank = False  # the loss is reduced over the ranks: rank 0 says it for the group

    def __init__(self, step: int, loss: float, skipped_in_row: int = 0):
        self.step = step
        where = f"step {step}: the loss is {loss}"
        if skipped_in_row:
            where += f" for the {skipped_in_row}th step in a row, each skipped by the fp16 loss scaler"
        super().__init__(f"{where}; training stopped. Lower train.optimizer.lr, set train.grad_clip, or train in "
                         "bf16/fp32; the checkpoints hold only steps before it")


# A loss this many times the run's first is divergence, not noise: at the start a classifier or language model
# predicts near-uniformly (cross-entropy ln(classes)), so five times that is confident and wrong on nearly every
# token (the right class at classes^-5), and a sound run's spikes, however sharp against the loss of the moment,
# stay below where it started. Adam at lr 30 on a tiny BERT: 5.5, 11242, 36633, ...; at lr 1: 5.5, 19.5, 35.8.
DIVERGED = 5.0


class LossWatch:
    """Stops the run at the first non-finite loss (fp16: the first the scaler cannot explain), and says once,
    in one line, when a finite loss has grown to DIVERGED times the run's first (a learning rate far too
    high trains on to a loss of thousands with no other sign). `start`: the first step's loss, for a
    resumed run (from metrics.jsonl)."""

    def __init__(self, start: float | None = None, lr: float | None = None) -> None:
        self.skipped_in_row = 0
        self.start, self.lr = start, lr
        self.diverged: str | None = None  # the line said, for the run's last line

    def check(self, record: dict) -> None:
        loss = record["loss"]
        if math.isfinite(loss):
            self.skipped_in_row = 0
            self._watch_growth(record["step"], loss, record.get("grad_norm"))
            return
        if record.get("skipped"):
            self.skipped_in_row += 1
            if self.skipped_in_row < FP16_NON_FINITE_LIMIT:
                return
            raise NonFiniteLoss(record["step"], loss, self.skipped_in_row)
        raise NonFiniteLoss(record["step"], loss)

    def _watch_growth(self, step: int, loss: float, grad_norm) -> None:
        if self.start is None:
            self.start = loss
            return
        if self.diverged is not None or self.start <= 0 or loss < DIVERGED * self.start:
            return
        norm = f", gradient norm {grad_norm:.3g}" if isinstance(grad_norm, float) and math.isfinite(grad_norm) else ""
        rate = f" (train.optimizer.lr {self.lr:g})" if self.lr is not None else ""
        self.diverged = (f"step {step}: the loss {loss:.5g} is {loss / self.start:,.0f} times the first step's "
                         f"{self.start:.4g}{norm}: training diverges; a lower learning rate{rate}, a longer warm-up or "
                         "train.grad_clip would keep it down")
        log.warning(self.diverged)

    def finite(self, step: int) -> bool:
        """Whether the weights after `step` are worth a checkpoint: not in a run of non-finite losses
        (fp16), which would replace the last good checkpoint with one that cannot train."""
        if self.skipped_in_row:
            log.warning("step %d: no checkpoint saved: the loss has not been finite for %d step(s)", step,
                        self.skipped_in_row)
        return not self.skipped_in_row


class Abandoned(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: the current step is abandoned (checkpoints are atomic, metrics whole)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class StopRequest:
    """SIGINT and SIGTERM ask the loop to stop after the current step, so the run ends through its
    normal end (whatever runs there, runs) and exits 130/143. A second signal abandons the step."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # only there can handlers be set
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            raise Abandoned(signum)
        self.signum = signum
        log.warning("%s: stopping after the current step (send it again to abandon the step now)",
                    signal.Signals(signum).name)


def stop_line(signum: int, steps_done: int, total: int, out_dir) -> str:
    """The one line a stopped run ends with: where it stopped and how to continue."""
    name = signal.Signals(signum).name
    checkpoints = complete_checkpoints(out_dir / "checkpoints")
    if checkpoints:
        how = f"`--resume` continues from {checkpoints[-1].name}"
    else:
        how = "no checkpoint was written, so a new run starts from step 0"
    return f"ckrun: stopped by {name} after step {steps_done} of {total}; {how}"
