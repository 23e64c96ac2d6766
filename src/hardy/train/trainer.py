"""`hardy train`: the training loop, the same code single-process and under torchrun.

State that a resumed run needs — model, optimizer, scheduler, loss scaler, data-loader position,
RNG — is all checkpointed (see hardy.checkpoint.manager), so a resumed run continues exactly.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path

import torch

from hardy import fast_exit
from hardy.checkpoint.manager import CheckpointManager, SaveFailed, rng_state, set_rng_state
from hardy.data.loader import PackedLoader
from hardy.data.prepare import load_index, load_split
from hardy.devices import DTYPES, configure_cuda
from hardy.errors import HardyError
from hardy.fault.goodput import account, format_goodput
from hardy.fault.inject import FaultInjector
from hardy.fault.policy import SpikeDetector, daly_interval
from hardy.fault.preempt import StopRequest, clear_preemption, record_preemption
from hardy.fault.straggler import StragglerMonitor
from hardy.fault.watchdog import Watchdog
from hardy.fsio import write_json_atomic
from hardy.model.config import count_parameters, flops_per_token
from hardy.model.transformer import meta_transformer
from hardy.ops.matmul_probe import cached_matmul_flops, has_fast_bf16
from hardy.ops.memory import MemoryMeter, return_freed_memory_to_os
from hardy.ops.telemetry import TelemetrySampler, Thresholds, device_sensors
from hardy.parallel import distributed as D
from hardy.parallel.dims import ParallelDims
from hardy.parallel.grads import grad_sq_norm, scale_grads
from hardy.parallel.parallelize import (
    assign_full_state,
    autocast_context,
    build_mesh,
    fsdp_policies,
    grad_sync_context,
    parallelize,
    wrapping,
)
from hardy.parallel.parallelize import preload as preload_parallel
from hardy.train.config import TrainConfig
from hardy.train.hooks import StepHooks
from hardy.train.metrics import MetricsLogger
from hardy.train.precision import load_scaler_state, make_grad_scaler, quiet_unscale, scale_tensor
from hardy.train.setup import make_optimizer, prepare_dataset, resolve_model_config
from hardy.train.snapshots import make_snapshots, restore_snapshot, take_snapshot
from hardy.train.summary import RunSummary
from hardy.train.timing import StepTimer

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, watchdog: Watchdog, stop: StopRequest | None = None,
                 shared_dir: Path | None = None):
        self.cfg, self.run_dir, self.watchdog = cfg, Path(run_dir), watchdog
        # data, checkpoints and the preemption record: RUN_DIR itself; under live recovery each replica
        # group logs to a directory of its own inside it
        self.shared_dir = Path(shared_dir or run_dir)
        self.stop = stop or StopRequest()  # SIGTERM/SIGUSR1: checkpoint after the step all ranks agree on
        self.start_process()
        self.dims = self.build_dims()
        self.wrapper = wrapping(self.dims, cfg.parallel.wrap)
        self.peak_flops, self.peak_source = self.find_peak_flops()
        preload_parallel()
        if cfg.train.release_memory and self.env.device.type == "cpu":
            return_freed_memory_to_os()
        self.memory = MemoryMeter(self.env.device)
        if cfg.precision.dtype != "fp32" and not has_fast_bf16(self.env.device):
            log.warning("precision.dtype = %s on hardware without native bf16/fp16 matmul (no AVX512-BF16/AMX): "
                        "expect it to run much slower than fp32 (~100x for bf16 matmul on AVX2 CPUs)",
                        cfg.precision.dtype)
        pretrained = self.load_data_and_config()
        dp_rank, dp_size = self.data_parallel_place()
        self.build_model(pretrained, dp_rank)
        self.loader = PackedLoader(self.tokens, cfg.data.seq_len, cfg.train.micro_batch, cfg.train.grad_accum,
                                   dp_rank=dp_rank, dp_size=dp_size, seed=cfg.train.seed,
                                   pin_memory=self.env.device.type == "cuda")
        self.timer = StepTimer(self.env.device)
        self.resharded = ""
        self.sample_log = (open(self.run_dir / f"sample_ids_rank{self.env.rank}.jsonl", "a")
                           if cfg.log.sample_ids else None)
        self.ckpt = CheckpointManager(self.shared_dir, cfg.checkpoint.keep, self.env.rank, self.env.device)
        self.snapshots = make_snapshots(self)
        self.step = 0
        self.skipped = 0
        self.rollbacks = 0
        self.telemetry: TelemetrySampler | None = None
        self._telemetry_file = None
        self.straggler, self.hooks = self.build_step_hooks()
        f = cfg.fault
        self.spikes = SpikeDetector(f.spike_window, f.spike_threshold, f.spike_warmup)
        self.logger: MetricsLogger | None = None
        self.tokens_per_step = dp_size * cfg.train.grad_accum * cfg.train.micro_batch * cfg.data.seq_len
        self.flops_per_token = flops_per_token(self.model_cfg, cfg.data.seq_len)

    def start_process(self) -> None:
        """CUDA's settings, the process group (self.env), threads and determinism."""
        cfg = self.cfg
        cuda_notes = []
        if torch.cuda.is_available() and cfg.parallel.backend != "gloo":  # before the first cuBLAS call
            cuda_notes = configure_cuda(cfg.train.deterministic, cfg.precision.tf32)
        # A wrapper at world size 1 (parallel.wrap) still needs a process group: a one-rank one.
        self.env = D.init_distributed(cfg.parallel.backend, single_group=cfg.parallel.wrap != "auto")
        device = self.env.device
        self.device_notes = [torch.cuda.get_device_name(device), *cuda_notes] if device.type == "cuda" else []
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

    def find_peak_flops(self) -> tuple[float | None, str]:
        """Peak FLOP/s for MFU: the datasheet's when given, else measured before the memory meter starts
        so its matrices do not count (by the main rank only: None on the others)."""
        t, world = self.cfg.train, self.env.world_size
        if t.peak_tflops:
            return t.peak_tflops * 1e12 * world, "train.peak_tflops"
        if not self.env.is_main:
            return None, "measured matmul"
        flops, when = cached_matmul_flops(DTYPES[self.cfg.precision.dtype], self.env.device)
        return flops * world, "measured matmul" + (f" on {when}, kept in HARDY_CACHE/matmul" if when else "")

    def load_data_and_config(self):
        """The prepared dataset (self.tokens), the model's config and the resolved run config (saved);
        returns the pretrained weights, or None for a fresh model."""
        cfg = self.cfg
        data_dir = prepare_dataset(cfg, self.shared_dir, self.env)
        index = load_index(data_dir)
        self.tokens = load_split(data_dir, "train")
        self.model_cfg, pretrained = resolve_model_config(cfg, index["vocab_size"])
        if cfg.data.seq_len > self.model_cfg.max_seq_len:
            raise HardyError(f"data.seq_len {cfg.data.seq_len} exceeds the model's context {self.model_cfg.max_seq_len}")
        self.resolved = {**cfg.to_dict(), "resolved": {
            "model": self.model_cfg.to_dict(), "dataset": str(data_dir), "world_size": self.env.world_size,
            "parallel": self.dims.describe(), "dp": self.dims.dp}}
        self.write_config()
        return pretrained

    def build_model(self, pretrained, dp_rank: int) -> None:
        """The parallelized model on its mesh, its optimizer, scheduler and loss scaler."""
        cfg, device = self.cfg, self.env.device
        # The global RNG draws only dropout masks (weights come from a seeded generator of their own):
        # the ranks of one tensor-parallel group must agree (their activations are replicated), the
        # data-parallel replicas should not.
        torch.manual_seed(cfg.train.seed + dp_rank)
        model = meta_transformer(self.model_cfg)
        self.mesh = build_mesh(self.dims, device.type, self.wrapper)

        def materialize(m, on):
            values = pretrained if pretrained is not None else m.initial_state(cfg.train.seed)
            assign_full_state(m, values)
            m.reset_rope(cfg.data.seq_len, device=on)

        self.model = parallelize(
            model, self.dims, self.mesh, device, materialize, ac=cfg.train.activation_checkpoint,
            compile=cfg.train.compile, dtype=cfg.precision.dtype, reduce_dtype=cfg.precision.reduce_dtype,
            reshard_after_forward=cfg.parallel.reshard_after_forward, cpu_offload=cfg.parallel.cpu_offload,
            wrap=cfg.parallel.wrap)
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg)
        self.scaler = make_grad_scaler(cfg.precision.dtype == "fp16", device, self.env.distributed,
                                       cfg.precision.loss_scale, cfg.precision.loss_scale_growth_interval)

    def build_step_hooks(self) -> tuple[StragglerMonitor | None, StepHooks]:
        """The straggler monitor (several ranks, health.straggler_every) and the step hooks around it."""
        f, h = self.cfg.fault, self.cfg.health
        injector = FaultInjector(f.inject, self.run_dir, self.job_rank(), f.random_kill_rate, f.random_seed,
                                 self.random_kill_victims())
        straggler = None
        if self.env.world_size > 1 and h.straggler_every:
            straggler = StragglerMonitor(h.straggler_every, h.straggler_factor, h.straggler_stop_after,
                                         self.env.device, lambda: self.telemetry and self.telemetry.latest,
                                         self.report_health)
        # the injector first: a slowed step is slow by the time the straggler monitor reads its clock
        return straggler, StepHooks([hook for hook in (injector if injector.active else None, straggler) if hook])

    # --- what live recovery (hardy.train.live) changes --------------------------------------------

    def build_dims(self) -> ParallelDims:
        p = self.cfg.parallel
        return ParallelDims.build(self.env.world_size, p.dp_replicate, p.dp_shard, p.tp)

    def data_parallel_place(self) -> tuple[int, int]:
        """(this process's data-parallel rank, the data-parallel degree the batch is cut for)."""
        return self.dims.dp_rank(self.env.rank), self.dims.dp

    def make_logger(self) -> MetricsLogger:
        c = self.cfg
        return MetricsLogger(self.run_dir, c.train.steps, self.step, self.env.is_main, c.log.every, c.log.jsonl,
                             c.log.tensorboard, c.log.progress)

    def job_rank(self) -> int:
        """The rank `fault.inject`'s @rankR names."""
        return self.env.rank

    def random_kill_victims(self) -> int:
        return 1  # rank 0: any death restarts the whole job

    def write_config(self) -> None:
        if self.env.is_main:
            write_json_atomic(self.run_dir / "config.json", self.resolved)

    # --- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self, final: bool = False) -> tuple[Path, float]:
        t0 = time.perf_counter()
        trainer_state = {"step": self.step, "skipped": self.skipped, "rollbacks": self.rollbacks,
                         "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                         "spikes": self.spikes.state_dict(), "config": self.resolved, "world_size": self.env.world_size}
        rank_state = {"rng": rng_state(), "loader": self.loader.state_dict()}

        step = self.step

        def written():  # DCP files are on disk, COMPLETE is not (asynchronous: later steps may be running)
            self.hooks.checkpoint_written(step)

        asynchronous = self.cfg.checkpoint.async_save and not final
        try:
            path = self.ckpt.save(self.step, self.model, self.optimizer, trainer_state, rank_state, written,
                                  asynchronous)
        except SaveFailed as e:
            self.report_failed_save(e)
            return None, time.perf_counter() - t0
        stall = time.perf_counter() - t0
        if asynchronous:
            return path, stall  # completed (and possibly damaged by injection) in poll()/wait()
        self.after_save(path)
        return path, stall

    def complete_async_save(self, complete, logger) -> float:
        """Run `complete` (the manager's poll or wait); returns the seconds it held up training and
        records them when it finished a save (merging checksums, renaming, COMPLETE)."""
        t0 = time.perf_counter()
        try:
            path = complete()
        except SaveFailed as e:
            self.report_failed_save(e)
            path = None
        held = time.perf_counter() - t0
        if path is not None:
            self.after_save(path)
            logger.event("checkpoint_complete", step=int(path.name.split("_")[1]), path=str(path), stall_s=held)
        return held

    def report_failed_save(self, e: SaveFailed) -> None:
        """Out of space: the run ends (one line, exit 2), as no later save can succeed. Any other failed
        write: said, and training goes on; the newest complete checkpoint stays the resume point."""
        if e.disk_full:
            if not self.env.is_main:  # every rank stops; rank 0 says why, once
                raise SystemExit(2)
            raise e
        if self.logger is not None:
            self.logger.event("checkpoint_failed", step=self.step, error=str(e))
            self.logger.print(f"warning: {e}")

    def checkpoint_on_stop(self, logger) -> str | None:
        """A stop signal reached some rank: every rank saves this step and the run ends (exit 0)."""
        path, stall = self.save_checkpoint(final=True)
        if path is None:
            return None
        reason = self.stop.signal or "SIGTERM/SIGUSR1 on another rank"
        logger.event("preempted", step=self.step, path=str(path), stall_s=stall, signal=reason)
        logger.print(f"stopped on {reason} after step {self.step}: checkpoint {path}; the same command resumes it")
        if self.env.is_main:
            record_preemption(self.shared_dir, self.step, str(path), reason)
        return str(path)

    def after_save(self, path: Path) -> None:
        self.hooks.checkpoint_saved(path, int(path.name.split("_")[1]), self.env.is_main)

    def restore(self, path: Path) -> None:
        trainer_state, rank_state = self.ckpt.load(path, self.model, self.optimizer)
        self.step, self.skipped = int(trainer_state["step"]), int(trainer_state.get("skipped", 0))
        self.rollbacks = int(trainer_state.get("rollbacks", 0))
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        load_scaler_state(self.scaler, trainer_state["scaler"], self.cfg.precision.loss_scale_growth_interval)
        if "spikes" in trainer_state:
            self.spikes.load_state_dict(trainer_state["spikes"])
        self.loader.load_state_dict(rank_state["loader"])
        set_rng_state(rank_state["rng"])
        saved_on = int(trainer_state.get("world_size", self.env.world_size))
        self.resharded = (f" (saved by {saved_on} processes, resharded to {self.env.world_size}; the data goes on "
                          f"from sample {self.loader.position()})" if saved_on != self.env.world_size else "")

    def maybe_resume(self) -> Path | None:
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            return None
        explicit = None if mode == "auto" else Path(mode)
        if explicit is not None and not explicit.is_dir():
            raise HardyError(f"checkpoint.resume: {explicit} is not a checkpoint directory")
        if explicit is None and self.snapshots is not None:
            step = restore_snapshot(self)
            if step is not None:
                self.resharded = " (its in-memory snapshot in /dev/shm: no shared storage read)"
                return self.snapshots.own / f"step_{step:08d}"
        path = self.ckpt.find_resumable(explicit)
        if path is None:
            return None
        self.restore(path)
        return path

    def rollback(self, spike_loss: float) -> None:
        """PaLM practice: back to the last good checkpoint, and skip the batches since then."""
        cfg = self.cfg.fault
        completed = None
        try:
            completed = self.ckpt.wait()  # the newest checkpoint may still be being written
        except SaveFailed as e:
            self.report_failed_save(e)
        if completed is not None:
            self.after_save(completed)
        bad_step, position = self.step, self.loader.position()
        self.rollbacks += 1
        if self.rollbacks > cfg.max_rollbacks:
            raise HardyError(f"loss spike at step {bad_step} (loss {spike_loss:.4f}) after {cfg.max_rollbacks} "
                             "rollback(s); stopping: lower the learning rate or inspect the data near this step")
        path = self.ckpt.find_resumable()
        rollbacks = self.rollbacks
        if path is not None:
            self.restore(path)
        else:  # nothing to roll back to yet: the spike step counts as skipped, the schedule moves on
            self.skipped += 1
            self.advance_schedule()
        self.rollbacks = rollbacks
        per_batch = self.loader.dp_size * self.loader.micro_batch
        skipped_batches = (position - self.loader.position()) // per_batch
        self.loader.seek(position)  # the offending batches are not seen again
        self.optimizer.zero_grad(set_to_none=True)
        event = {"from_step": bad_step, "to_step": self.step, "loss": spike_loss, "skipped_batches": skipped_batches,
                 "checkpoint": str(path) if path else None, "rollbacks": self.rollbacks}
        if self.logger is not None:
            self.logger.event("rollback", **event)
            self.logger.print(f"loss spike at step {bad_step} ({spike_loss:.4f}): rolled back to step {self.step}, "
                              f"skipping {skipped_batches} micro-batch(es) per rank")

    # --- the loop ------------------------------------------------------------------------------

    def advance_schedule(self) -> None:
        """The schedule follows steps taken, skipped or not, so a resumed run is exact."""
        with warnings.catch_warnings():  # a skipped step did not call optimizer.step(): expected here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    def train_step(self) -> dict:
        cfg, device = self.cfg, self.env.device
        accum = cfg.train.grad_accum
        self.timer.start()
        step = self.step + 1
        self.hooks.before_step(step)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        if self.sample_log is not None:
            ids = [q for m in range(accum) for q in self.loader.sample_ids(m)]
            self.sample_log.write(json.dumps({"step": step, "rank": self.env.rank, "samples": ids}) + "\n")
            self.sample_log.flush()
        for micro in range(accum):
            rows = self.loader.next_rows().to(device, non_blocking=True)  # pinned on CUDA: an async copy
            inputs, targets = rows[:, :-1], rows[:, 1:]
            with grad_sync_context(self.model, micro == accum - 1):
                with autocast_context(device, cfg.precision.dtype, self.wrapper == "fsdp"):
                    loss = self.model(inputs, targets=targets)
                loss = self.hooks.loss(step, loss)
                self.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler.is_enabled():
            with quiet_unscale():
                self.scaler.unscale_(self.optimizer)  # the norm, clipping and AdamW see true gradients
        sq_norm = grad_sq_norm(params, device)
        nonfinite = (~torch.isfinite(loss_sum) | ~torch.isfinite(sq_norm)).double()
        t_sync = time.perf_counter()
        if self.straggler is not None:
            self.straggler.compute_done()
        stop = torch.full((), float(self.stop.requested), dtype=torch.float64, device=device)  # a fill, not a copy
        # any rank non-finite -> all skip; any rank asked to stop -> all stop after this step
        summed = D.all_reduce_sum(torch.stack([loss_sum / accum, nonfinite, stop]))
        readings = torch.stack([summed[0], summed[1], summed[2], sq_norm, scale_tensor(self.scaler, device).double()])
        self.timer.mark()
        # The step's one read-back from the device: everything the decisions below need.
        loss_total, bad_ranks, stops, sq, scale = readings.tolist()
        if self.straggler is not None:
            self.straggler.sync_wait = time.perf_counter() - t_sync
        mean_loss, grad_norm = loss_total / self.env.world_size, math.sqrt(sq)
        bad = bad_ranks > 0 or not (math.isfinite(grad_norm) and math.isfinite(mean_loss))
        skip = bad and (cfg.fault.skip_nonfinite or self.scaler.is_enabled())
        if bad and not skip:
            raise HardyError(f"non-finite loss or gradient at step {self.step + 1} (fault.skip_nonfinite = false)")
        lr = self.scheduler.get_last_lr()[0]
        spike = (not bad and cfg.fault.spike_detection and self.spikes.is_spike(mean_loss))
        if spike:
            self.scaler.update()  # finite gradients: counts as a good step for the scale (rollback restores it)
            dt = self.timer.stop()
            self.step += 1
            record = {"step": self.step, "loss": mean_loss, "grad_norm": grad_norm, "lr": lr,
                      "tokens": self.step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / dt,
                      "step_time_s": dt, "skipped": True, "loss_scale": scale, "spike": True}
            return record
        ckpt_wait = 0.0
        if skip:
            self.skipped += 1
        else:
            ckpt_wait = self.update_weights(params, mean_loss, grad_norm)
        self.scaler.update()  # the overflow flag unscale_ found: halve the scale, or count a good step
        self.optimizer.zero_grad(set_to_none=True)
        self.advance_schedule()
        self.step += 1
        dt = self.timer.stop()
        self.hooks.after_step(self.step)
        return {"step": self.step, "loss": mean_loss, "grad_norm": grad_norm, "lr": lr,
                "tokens": self.step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step / dt,
                "step_time_s": dt, "skipped": bool(skip), "loss_scale": scale, "ckpt_wait_s": ckpt_wait,
                "stop": stops > 0}

    def update_weights(self, params, loss: float, grad_norm: float) -> float:
        """A good step: into the spike window, clip by the global norm, the optimizer step. Returns the
        seconds spent waiting for an asynchronous save to finish copying the weights first."""
        self.spikes.observe(loss)
        clip = self.cfg.optim.grad_clip
        if clip and grad_norm > clip:
            scale_grads(params, clip / (grad_norm + 1e-6))
        t_wait = time.perf_counter()
        self.ckpt.staged()  # an asynchronous save must finish copying before the weights change
        ckpt_wait = time.perf_counter() - t_wait
        self.optimizer.step()
        return ckpt_wait

    def checkpoint_due(self, since_last: float, last_stall: float | None) -> bool:
        """Every N steps, every T seconds, or "auto": the Young/Daly optimum for this job's MTBF."""
        c = self.cfg.checkpoint
        if self.step >= self.cfg.train.steps:
            return False  # the final save is at_end's business
        if c.interval == "auto":
            if last_stall is None:
                return True  # one save early on measures the stall the optimum depends on
            mtbf_s = c.device_mtbf_hours * 3600 / self.env.world_size
            return since_last >= daly_interval(max(last_stall, 1e-3), mtbf_s)
        if c.interval and self.step % c.interval == 0:
            return True
        return bool(c.interval_seconds) and since_last >= c.interval_seconds

    # --- health: telemetry and stragglers ---------------------------------------------------------

    def report_health(self, event: str, fields: dict, line: str | None) -> None:
        """The main rank logs health events to the metrics stream and the console; the others keep their
        telemetry in RUN_DIR/telemetry_rank<R>.jsonl and their warnings in their own log."""
        if self.env.is_main:
            if self.logger is not None:
                self.logger.event(event, step=self.step, **fields)
                if line:
                    self.logger.print(line)
            return
        if event == "telemetry":
            if self._telemetry_file is None:
                self._telemetry_file = open(self.run_dir / f"telemetry_rank{self.env.rank}.jsonl", "a", buffering=1)
            self._telemetry_file.write(json.dumps({"event": event, "time": time.time(), "step": self.step,
                                                  **fields}) + "\n")
        if event == "health_warning":  # its own sensors: only this rank knows (straggler reports are rank 0's)
            log.warning("%s", line)

    def start_telemetry(self) -> None:
        h = self.cfg.health
        if not h.telemetry_interval_s:
            return
        gpu = device_sensors(self.env.device)
        limits = Thresholds(h.warn_gpu_temp_c, h.warn_cpu_temp_c, h.warn_swap_growth_mib, h.warn_disk_free_gib)

        def emit(sample: dict, warnings: list[str]) -> None:
            self.report_health("telemetry", sample, None)
            if self.env.is_main and self.logger is not None:
                self.logger.scalars("health", sample, self.step)
            for warning in warnings:
                self.report_health("health_warning", {"rank": self.env.rank, "warning": warning},
                                   f"health warning (rank {self.env.rank}): {warning}")

        self.telemetry = TelemetrySampler(self.run_dir, h.telemetry_interval_s, emit, limits, gpu).start()

    def run(self) -> RunSummary:
        cfg = self.cfg
        resumed = self.maybe_resume()
        main = self.env.is_main
        logger = self.logger = self.make_logger()
        peak = self.peak_flops
        counts = count_parameters(self.model_cfg)
        on = ", ".join([str(self.env.device)] + self.device_notes)
        layout = self.dims.describe() + (f" through {self.wrapper.upper()}" if cfg.parallel.wrap != "auto" else "")
        logger.print(f"hardy train: {self.model_cfg.name} ({counts.total:,} parameters), {layout}, "
                     f"{cfg.precision.dtype} on {on}, {self.tokens_per_step:,} tokens/step, run dir {self.run_dir}"
                     + (f", resumed from {resumed.name}{self.resharded}" if resumed else ""))
        if peak:
            logger.print(f"MFU against {peak / 1e12:,.1f} TFLOP/s in all ({self.peak_source})")
        logger.event("start", step=self.step, config=self.resolved, peak_flops=peak, peak_source=self.peak_source,
                     device=on, flops_per_token=self.flops_per_token, resumed_from=str(resumed) if resumed else None,
                     fsdp=fsdp_policies(self.model))
        self.start_telemetry()
        watchdog = self.watchdog
        t_start = time.perf_counter()
        last_save, last_stall = time.perf_counter(), None
        steps_run, last_loss, last_ckpt = 0, float("nan"), str(resumed) if resumed else None
        try:
            while self.step < cfg.train.steps:
                m = self.train_step()
                steps_run += 1
                watchdog.beat(cfg.fault.hang_timeout_s)  # after the first step: the per-step timeout
                completion = self.complete_async_save(self.ckpt.poll, logger)
                if m.get("spike"):  # a stop request stays set: the next step carries it again
                    m.update(ckpt_stall_s=completion, mfu=None, peak_mem_bytes=self.memory.peak_bytes())
                    logger.step(m)
                    self.rollback(m["loss"])
                    self.timer.pause()
                    watchdog.beat()
                    continue
                if not m["skipped"]:
                    last_loss = m["loss"]
                stall = 0.0
                if not m["stop"] and self.checkpoint_due(time.perf_counter() - last_save, last_stall):
                    # one save in flight: the previous one is finished here, with its event, not inside the next
                    completion += self.complete_async_save(self.ckpt.wait, logger)
                    path, stall = self.save_checkpoint()
                    self.timer.pause()
                    last_save, last_stall = time.perf_counter(), stall
                    if path is not None:
                        last_ckpt = str(path)
                        logger.event("checkpoint", step=self.step, path=str(path), stall_s=stall)
                    watchdog.beat()
                if self.snapshots and not m["stop"] and self.step % cfg.checkpoint.memory_interval == 0:
                    snap = take_snapshot(self)
                    self.timer.pause()
                    logger.event("snapshot", **snap)
                    stall += snap["stall_s"]
                m["ckpt_stall_s"] = stall + completion + m["ckpt_wait_s"]
                m["mfu"] = (m["tokens_per_s"] * self.flops_per_token / peak) if peak else None
                m["peak_mem_bytes"] = self.memory.peak_bytes()
                logger.step(m)
                if m["stop"]:
                    break
            watchdog.stop()
            self.complete_async_save(self.ckpt.wait, logger)
            stopped = steps_run and self.step < cfg.train.steps  # the loop ended on a stop request
            if stopped:
                last_ckpt = self.checkpoint_on_stop(logger) or last_ckpt
            elif cfg.checkpoint.at_end and steps_run:
                path, stall = self.save_checkpoint(final=True)
                if path is not None:
                    last_ckpt = str(path)
                    logger.event("checkpoint", step=self.step, path=str(path), stall_s=stall)
            wall = time.perf_counter() - t_start
            summary = RunSummary(steps=self.step, final_loss=last_loss, tokens=steps_run * self.tokens_per_step,
                                 wall_s=wall, tokens_per_s=steps_run * self.tokens_per_step / wall if wall else 0.0,
                                 peak_mem_bytes=self.memory.peak_bytes(), skipped_steps=self.skipped,
                                 checkpoint=last_ckpt, rollbacks=self.rollbacks)
            goodput = account(self.run_dir, now=time.time()) if main else {}
            logger.event("end", **summary.__dict__, goodput=goodput)
            for line in summary.lines() + format_goodput(goodput):
                logger.print(line)
            if main:
                write_json_atomic(self.run_dir / "summary.json", {**summary.__dict__, "goodput": goodput})
                if not stopped:
                    clear_preemption(self.shared_dir)
            if self.snapshots is not None and not stopped:
                self.snapshots.discard()
            return summary
        finally:
            watchdog.stop()
            if self.telemetry is not None:
                self.telemetry.stop()
            if self._telemetry_file is not None:
                self._telemetry_file.close()
            self.ckpt.close()
            logger.close()
            if self.sample_log is not None:
                self.sample_log.close()


def train(cfg: TrainConfig, run_dir: Path, trainer_class=Trainer, log_dir: Path | None = None,
          stop_signals=None) -> RunSummary:
    """`log_dir`: where this process's group logs (default RUN_DIR itself)."""
    run_dir = Path(run_dir)
    log_dir = Path(log_dir or run_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # Armed from the very start: a rendezvous or collective that never completes during start-up
    # is a hang like any other, and the launcher can only restart a process that exits.
    watchdog = Watchdog(log_dir, int(os.environ.get("RANK", "0")), cfg.fault.startup_timeout_s).start()
    stop = StopRequest().install(stop_signals)  # from the start: a signal during set-up stops after the first step
    try:
        return trainer_class(cfg, log_dir, watchdog, stop, shared_dir=run_dir).run()
    finally:
        launched = "TORCHELASTIC_RUN_ID" in os.environ  # a torchrun worker: the process exits next
        stop.restore(ignore_late=launched)
        watchdog.stop()
        D.destroy()
        if launched:  # its files are closed: `python -m hardy` ends it without the interpreter's teardown
            fast_exit.request()
