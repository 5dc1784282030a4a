"""`eval.best`: the weights of the best evaluations, kept as exports, and the best one exported at the end.

Each evaluation whose metric ranks among the `keep` best so far is exported to OUTPUT_DIR/best/step-N
(the same loadable directory as OUTPUT_DIR/model: `model.pretrained` or `from_pretrained` read it);
one that falls out of the top k is deleted. best/best.json lists the kept ones, best first, with their
values. With `restore`, the run's export (OUTPUT_DIR/model) is the best one's, copied once training
ends (after a finished run, early stopping or a Ctrl-C alike); the final checkpoint keeps the last
step's full training state for --resume. A resumed run reads best.json back and drops entries past
the step it resumes from: those evaluations are made again.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ...builders.resolve import BuildError
from ...disk.files import write_atomic
from ...parallel.ranks import any_rank
from ..output.directory import BEST_DIR as FOLDER, BEST_RANKING as RANKING  # the run's start checks the folder
from ..ranked import full_weights

log = logging.getLogger(__name__)

class BestKept:
    def __init__(self, spec, out_dir: Path, step: int):
        self.spec, self.root = spec, out_dir / FOLDER
        self.larger = (spec.mode or ("max" if spec.metric == "accuracy" else "min")) == "max"
        self.kept = [entry for entry in self._read() if entry["step"] <= step]
        for stale in self.root.glob("step-*"):  # past the resumed step, or never listed (a save cut short)
            if stale.name not in {self._name(e["step"]) for e in self.kept}:
                shutil.rmtree(stale, ignore_errors=True)

    def observe(self, record: dict, trainer) -> None:
        """An evaluation record; its weights are exported when it ranks among the `keep` best."""
        values = record["eval"]
        if self.spec.metric not in values:
            raise BuildError("eval.best.metric", f"the evaluation reports {', '.join(values)}, not "
                                                 f"{self.spec.metric!r}; name one of them")
        entry = {"step": record["step"], "value": float(values[self.spec.metric])}
        ranked = self._ranked([e for e in self.kept if e["step"] != entry["step"]] + [entry])
        # every rank evaluated the same batches; any_rank keeps the gathering below a collective all join
        if not any_rank(entry in ranked[: self.spec.keep], trainer.ranks):
            return
        weights = full_weights(trainer)  # a collective under FSDP: every rank takes part
        if trainer.ranks.is_main:
            from ..output.export import export_model

            export_model(trainer.model, trainer.recipe, self.root / self._name(entry["step"]), entry["step"], weights,
                         getattr(trainer.data, "label_ids", None))
            for dropped in ranked[self.spec.keep:]:
                shutil.rmtree(self.root / self._name(dropped["step"]), ignore_errors=True)
        self.kept = ranked[: self.spec.keep]
        if trainer.ranks.is_main:
            write_atomic(self.root / RANKING, json.dumps({"metric": self.spec.metric, "larger_is_better": self.larger,
                                                          "kept": self.kept}, indent=1) + "\n")

    def restore(self, exported: Path) -> None:
        """Put the best evaluation's export in place of the last step's (`exported`), when asked to."""
        if not self.spec.restore or not self.kept:
            return
        best = self.kept[0]
        temporary = exported.with_name(f".{exported.name}.best")
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.copytree(self.root / self._name(best["step"]), temporary)
        shutil.rmtree(exported, ignore_errors=True)
        temporary.rename(exported)
        log.info("the export %s holds the best evaluation's weights: step %d, eval %s %.4g (eval.best.restore; the "
                 "last step's training state is in checkpoints/)", exported, best["step"], self.spec.metric,
                 best["value"])

    def _ranked(self, entries: list[dict]) -> list[dict]:
        """Best first; between equal values the earlier step (the first to reach it)."""
        return sorted(entries, key=lambda e: (-e["value"] if self.larger else e["value"], e["step"]))

    def _read(self) -> list[dict]:
        try:
            kept = json.loads((self.root / RANKING).read_text(encoding="utf-8"))["kept"]
            return [e for e in kept if isinstance(e.get("step"), int) and isinstance(e.get("value"), float)
                    and (self.root / self._name(e["step"])).is_dir()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []

    @staticmethod
    def _name(step: int) -> str:
        return f"step-{step:08d}"
