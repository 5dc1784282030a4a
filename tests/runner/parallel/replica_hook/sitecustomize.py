"""Put on PYTHONPATH by tests/runner/parallel/test_pool_knobs_ranks.py: each rank writes the weights it
holds after every step (its own pieces of FSDP2's shards) to CKRUN_REPLICAS/rank-R-step-S.pt, so the
test can compare replicas bit for bit. Processes without a RANK (the launcher) are left alone."""

import os

_folder = os.environ.get("CKRUN_REPLICAS", "")
if _folder and os.environ.get("RANK") is not None:
    import torch

    import ckrun.runner.train.trainer as _trainer

    _real = _trainer.Trainer.train_step

    def _train_step_then_write(self, *args, **kwargs):
        record = _real(self, *args, **kwargs)
        held = {name: getattr(tensor, "to_local", lambda t=tensor: t)().detach().clone()
                for name, tensor in self.model.state_dict().items()}
        torch.save(held, os.path.join(_folder, f"rank-{os.environ['RANK']}-step-{self.step}.pt"))
        return record

    _trainer.Trainer.train_step = _train_step_then_write
