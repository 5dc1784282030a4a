"""The trainer: a recipe built on its device (model, memory plan, parallel wrapping, data,
optimizer, schedule), its state saved and restored, and one optimizer step at a time run, timed
between device synchronisations and its peak memory measured against the cap. The loop (loop.py)
drives it through a run; the tuner's probe (measure/probe.py) steps it directly.
"""

from __future__ import annotations

import gc
import logging
import math
import time

import torch

from ..builders.adapters import TRAINABLE_ONLY, load_trainable_state, trainable_state
from ..builders.model import BuildError, build_model
from ..builders.oom import describe_out_of_memory, is_out_of_memory
from ..builders.optim import build_scheduler, total_steps
from ..builders.sources import build_data
from ..memory.allocator import apply_allocator, apply_compile_budget
from ..memory.measure import PeakMeter, card_peak, cuda_context_bytes, note_card_before_cuda
from ..memory.optimizers import build_planned_optimizer
from ..parallel.ranks import Ranks, reduce_step_record
from ..parallel.ranks import join as join_ranks
from ..parallel.wrap import wrap_model
from ..plan.memory_plan import gradients_final
from ..problems import InputError, Place, Problem, keyed_error
from ..recipe.recipe import Recipe
from ..units import format_bytes
from .checkpoint.fingerprint import fingerprint
from .checkpoint.sharded import load_full_into_shards
from .checkpoint.store import restore_rng_state, rng_state
from .measure.update_error import UpdateErrorMeter, lossy_labels, report_update_error
from .ranked import rank_share
from .run.memory_cap import CONTEXT_SLACK, MemoryCapExceeded, OutOfMemory, limit_cuda_memory
from .step import make_precision, run_step, set_fp32_math

log = logging.getLogger(__name__)


def planned_device_kind(recipe: Recipe) -> str:
    """The device type the run will use, found without initialising CUDA (is_available only counts)."""
    wanted = recipe.train.device
    return ("cuda" if torch.cuda.is_available() else "cpu") if wanted == "auto" else wanted


def pick_device(recipe: Recipe, source: str = "<recipe>") -> torch.device:
    wanted = recipe.train.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise InputError([Problem(Place(source), "train.device", "cuda asked for but no CUDA GPU is visible; use auto or cpu")])
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    # an index, because per-device calls (set_per_process_memory_fraction) refuse a bare "cuda"
    return torch.device("cuda", torch.cuda.current_device()) if wanted == "cuda" else torch.device(wanted)

def join_group(recipe: Recipe, source: str) -> Ranks:
    """This process's ranks, joined; the allocator's setting first, since joining under nccl starts CUDA."""
    apply_allocator(recipe.memory.allocator, planned_device_kind(recipe))
    note_card_before_cuda()  # what other processes hold on the card, read before our context joins them
    return join_ranks(recipe, source)


class Trainer:
    def __init__(self, recipe: Recipe, source: str = "<recipe>", ranks: Ranks | None = None):
        self.recipe, self.source = recipe, source
        # before the device: under nccl joining picks this rank's GPU
        self.ranks = join_group(recipe, source) if ranks is None else ranks
        self.device = pick_device(recipe, source)
        self.precision = make_precision(recipe.precision, self.device, source, recipe.memory.weights.autocast_cache())
        if self.device.type == "cuda":
            log.info(set_fp32_math(recipe.tf32))
        torch.manual_seed(recipe.train.seed)
        self.limited_at_context = None  # the CUDA context the allocator limit was set for
        self.out_of_memory_reason = ""  # what the allocator said when a step ran out
        if recipe.memory.max_mem is not None and self.device.type == "cuda":
            self.limited_at_context = limit_cuda_memory(self.device, int(recipe.memory.max_mem))
        try:
            self._build()
        except BuildError as err:
            raise err.at(source) from None

    def _build(self) -> None:
        recipe = self.recipe
        # the masters' plan builds in host memory: its optimizer moves the bfloat16 copies to the device, so the
        # device never holds the float32 model (27 GB for a 7B, more than the plan needs in all)
        on_host = recipe.memory.optimizer_offload.masters_on_host and self.device.type == "cuda"
        if on_host:
            log.info("memory.optimizer_offload master: the model is built in host memory, its bf16 copies then moved "
                     "to the GPU; weights it initialises at random are drawn by the CPU's generator (a run without "
                     "the plan draws them on the GPU), pretrained ones are the same")
        self.model = build_model(recipe.model, torch.device("cpu") if on_host else self.device)
        self.model.train()
        self.plan = _apply_plan(self.model, recipe, self.device, self.source)
        wrapped = wrap_model(self.model, recipe, self.ranks, self.device, self.source)  # after the plan, before the optimizer
        apply_compile_budget(recipe.memory)
        self.forward_model = torch.compile(wrapped) if recipe.memory.compile else wrapped
        if self.ranks.data_rank > 0:  # every rank built the same weights; dropout now draws a stream of its own
            # per data-parallel group: the ranks of a tensor group must drop the same features of the
            # activations they each hold whole (their split layers' inputs), or they would compute on
            # different inputs; on an activation each holds a piece of (attention's heads), each piece
            # then gets the mask the others' pieces get, a correlation a single process does not have
            torch.manual_seed(recipe.train.seed + (self.ranks.data_rank << 32))
        self.data = build_data(recipe, self.model)
        self.total_steps = total_steps(recipe, self.data)  # what the loop, schedule and evaluation count to
        # before the optimizer: its hooks (the update in the backward, float32 sums, the host's copies) would act
        # on the measuring passes' gradients, an update or a sum before step 1
        self.step = 0
        self.gradient_error = self._lossy_error()  # None for an exact plan
        self.planned = build_planned_optimizer(self.model, recipe.train, recipe.memory, self.device,
                                               gradients_final(recipe.memory, recipe.step_facts()))
        self.optimizer = self.planned.optimizer  # what the schedule, checkpoints and the memory meter see
        self.scheduler = build_scheduler(self.optimizer, recipe.train, self.total_steps)
        self.scaler = self.precision.grad_scaler()
        self.meter = PeakMeter(self.device, self.model, self.optimizer, recipe.output.log_every)
        self.saving = None  # a sharded checkpoint still being written behind the steps (train/sharded.py)
        self.update_error: float | None = None  # a lossy optimizer's, measured over the first steps from step 0
        self.update_meter: UpdateErrorMeter | None = None

    def _lossy_error(self) -> float | None:
        if self.plan.compression is None:
            return None
        from .measure.lossy import gradient_error, report_gradient_error

        # one micro-batch: the exact pass keeps every activation, which the whole batch may not fit
        micro = self.recipe.micro_batch
        batch = self.data.global_batch(self.step).slice(0, micro).to(self.device)
        try:
            error = gradient_error(self.model, self.plan.compression, batch, micro, self.precision, self.device,
                                   self.plan.head)
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            log.warning("memory.compression: the gradient error was not measured: the exact plan ran out of memory "
                        "on one micro-batch (%s)", describe_out_of_memory(err))
            return None
        log.info(report_gradient_error(error, self.recipe.memory.compression.label()))
        return error

    # --- state ------------------------------------------------------------------------------

    def state(self) -> dict:
        """The training state; under model.lora the model's part is what trains (the adapter), not the frozen
        base model.pretrained rebuilds, and the optimizer holds state for that part alone anyway."""
        adapted = self.recipe.model.lora is not None
        return {
            "step": self.step, "model": trainable_state(self.model) if adapted else self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(), TRAINABLE_ONLY: adapted,
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else {},
            "rng": rng_state(self.device), "recipe": fingerprint(self.recipe),
        }

    def restore(self, state: dict) -> None:
        """From a single process's checkpoint (state.pt), on any world size and strategy."""
        if self.ranks.joined and self.recipe.distributed.shards:
            load_full_into_shards(self, state)
        else:
            if self.recipe.model.lora is not None:
                load_trainable_state(self.model, state["model"])
            else:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if self.ranks.is_main:  # one process's random streams: the other ranks keep their own (seeded apart)
            restore_rng_state(state["rng"], self.device)
        self.step = int(state["step"])

    def close(self) -> None:
        """Shut down the data's worker processes; the trainer can still step afterwards (they restart)."""
        self.data.close()

    # --- running ----------------------------------------------------------------------------

    def train_step(self) -> dict:
        """Run the next optimizer step and return its metrics record."""
        try:
            batch, label_total = rank_share(self.data.global_batch(self.step), self.ranks)
            batch = batch.to(self.device)
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            raise OutOfMemory(self.step + 1, f"{describe_out_of_memory(err)} for its batch", self.device) from None
        if self.plan.switch is not None:
            self.plan.switch.select(batch)  # memory.adaptive: this batch length's checkpointing
        self._follow_exact_update()
        lr = self.scheduler.get_last_lr()[0]
        _synchronize(self.device)
        ran = self._timed_step(batch, label_total)
        if ran is None:
            del batch
            raise self._out_of_memory()
        result, seconds, peak = ran
        self.scheduler.step()
        self.step += 1
        if self.update_meter is not None and self.update_meter.stepped() is not None:
            self.update_error, self.update_meter = self.update_meter.error, None
            log.info(report_update_error(self.update_error, lossy_labels(self.recipe)))
        record = {"step": self.step, "loss": result.loss.item(), "lr": lr,
                  "samples_per_s": len(batch.labels) / seconds, "step_time_s": seconds, **peak.record()}
        record = reduce_step_record(record, result.loss, self.ranks, self.recipe.train.batch_size)
        if "input_ids" in batch.inputs:  # tokens fed per second, padding included (as HF's tokens/s counts them)
            record["tokens_per_s"] = record["samples_per_s"] * batch.inputs["input_ids"].shape[-1]
        if getattr(self.data, "rows", None):  # finite data: how far through it, as HF Trainer logs it
            record["epoch"] = round(self.step * self.recipe.train.batch_size / self.data.rows, 4)
        if result.grad_norm is not None:  # the same on every rank: clipping reduces it over the group
            norm = float(result.grad_norm)
            record["grad_norm"] = norm if math.isfinite(norm) else None  # an fp16 overflow: that step is skipped
        if result.skipped:
            record["skipped"] = True
            log.info("step %d: fp16 loss scaler found inf/nan gradients; the update was skipped", self.step)
        self._check_cap(record)
        return record

    def _follow_exact_update(self) -> None:
        """A lossy optimizer starting from step 0: exact AdamW follows its first steps (measure/update_error.py)."""
        if self.step == 0 and self.update_error is None and self.update_meter is None and lossy_labels(self.recipe):
            params = [p for p in self.model.parameters() if p.requires_grad]
            stepped = getattr(self.optimizer, "stepped", None)  # an offload steps the host's copies
            self.update_meter = UpdateErrorMeter(self.optimizer, stepped(params) if stepped else params)

    def _timed_step(self, batch, label_total=None):
        """(result, seconds, peak) of one optimizer step, or None when the device ran out of memory."""
        try:
            with self.meter.measure(batch.tensors(), self.step + 1) as peak:
                started = time.perf_counter()
                result = run_step(self.forward_model, self.planned.stepper, batch, self.recipe.micro_batch,
                                  self.precision, self.scaler, self.recipe.train.grad_clip, label_total,
                                  self.plan.head)
                _synchronize(self.device)
                seconds = time.perf_counter() - started
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            # returning (not raising) here ends the except block, and with it the traceback whose
            # frames hold the step's activations: they are freed before anything else is measured
            self.out_of_memory_reason = describe_out_of_memory(err)
            return None
        return result, seconds, peak

    def _out_of_memory(self) -> MemoryCapExceeded:
        """Under a cap the allocator stops at the cap, so running out is the cap being hit."""
        self.planned.stepper.zero_grad(set_to_none=True)  # gradients (and float32 sums) of the micro-batches that ran
        if self.device.type != "cuda":
            gc.collect()
            return OutOfMemory(self.step + 1, self.out_of_memory_reason, self.device)
        peak = card_peak({"peak_mem_bytes": torch.cuda.max_memory_reserved(self.device),
                          "cuda_context_bytes": cuda_context_bytes(self.device)})
        gc.collect()
        torch.cuda.empty_cache()
        cap = int(self.recipe.memory.max_mem or torch.cuda.get_device_properties(self.device).total_memory)
        return MemoryCapExceeded(cap, peak, self.step + 1)

    def _check_cap(self, record: dict) -> None:
        """The step's card peak (allocator reserve + CUDA context: `card_peak`, what the tuner and the
        screened estimate compare too) against the cap. Under the limit the allocator releases its
        cached free blocks and retries before it fails, as a card of the cap's size would, so the
        reserve counts no cache a real card would have given back; what can still pass the cap is
        context the kernels of this step added after the limit was set."""
        cap = self.recipe.memory.max_mem
        if cap is None:
            return
        if card_peak(record) > cap:
            detail = "" if self.device.type != "cuda" else (
                f"allocator reserve {format_bytes(record['peak_mem_bytes'])} + CUDA context "
                f"{format_bytes(record.get('cuda_context_bytes') or 0)}")
            raise MemoryCapExceeded(int(cap), card_peak(record), self.step, detail)
        grown = record.get("cuda_context_bytes", 0) - (self.limited_at_context or 0)
        if self.limited_at_context is not None and grown > CONTEXT_SLACK:
            # kernels beyond those context_after_kernels loads (the model's own) grew the context
            log.info("memory cap: the CUDA context grew by %s after step %d loaded its kernels; lowering the "
                     "allocator limit", format_bytes(grown), self.step)
            self.limited_at_context = limit_cuda_memory(self.device, int(cap))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _apply_plan(model, recipe: Recipe, device: torch.device, source: str):
    from ..memory.apply import apply_plan

    try:
        return apply_plan(model, recipe.memory, device)
    except ValueError as err:
        raise keyed_error(err, source, "memory") from None
