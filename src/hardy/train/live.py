"""The trainer under live recovery (`fault.recovery = "live"`): one replica group of a torchft job.

The loop is the Trainer's; what a step does differs. Each step starts with the quorum
(hardy.fault.live); this group computes its slots of the global batch, the groups sum their gradients
(one all-reduce per process, with the loss and the stop flag riding in the same buffer), and the step
commits only if every group in the quorum got through it. An uncommitted step (a peer died or hung
mid-step) is computed again with the next quorum, from the same data position. Checkpoints (for
whole-job failures and preemption) are written by the first group of the quorum into RUN_DIR; each
group logs into RUN_DIR/replica_<g>.
"""
from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch

from hardy.errors import HardyError, first_line
from hardy.fault.preempt import read_preemption, wait_for_preemption
from hardy.fault.live import (ENV_GROUP, ENV_GROUPS, GroupStragglers, LiveReplica, StepPlan, combine_slot_rows,
                              launcher_stopping, wait_for_start)
from hardy.fsio import write_json_atomic
from hardy.parallel import distributed as D
from hardy.parallel.dims import ParallelDims
from hardy.parallel.grads import grad_sq_norm
from hardy.parallel.parallelize import autocast_context, grad_sync_context
from hardy.train.local_state import load_local_state, local, local_state, trainable
from hardy.train.trainer import Trainer, train

LIVE_STOP_SIGNALS = (signal.SIGUSR1,)  # SIGTERM stays fatal: torchrun's agent ends a failed group's workers with it


class GroupEvicted(Exception):
    """This group was a persistent straggler and leaves the job (health.straggler_action = evict)."""


def group_dir(run_dir: Path, group: int) -> Path:
    return Path(run_dir) / f"replica_{group}"


class LiveTrainer(Trainer):
    def __init__(self, cfg, run_dir, watchdog, stop=None, shared_dir=None):
        self.group, self.groups = int(os.environ[ENV_GROUP]), int(os.environ[ENV_GROUPS])
        self.stale_stop = read_preemption(Path(shared_dir or run_dir))  # an earlier run's, if any
        if cfg.precision.dtype == "fp16":
            raise HardyError("fault.recovery = live trains in fp32 or bf16 (fp16's loss scale is per group)")
        super().__init__(cfg, run_dir, watchdog, stop, shared_dir)
        self.params = trainable(self.model)
        self.numel = sum(local(p).numel() for p in self.params)
        f = cfg.fault
        self.warm_up()
        self.replica = LiveReplica(self.group, self.groups, self.env.rank, self.env.world_size, f.exact,
                                   self.live_state, self.load_live_state, f.live_timeout_s, f.quorum_timeout_s,
                                   self.env.device)
        # after the manager heartbeats: the lighthouse then waits for every group at the first quorum
        wait_for_start(self.group, self.env.rank, f.startup_timeout_s or 7 * 86400)
        self.columns = self.groups + f.spares  # one busy-time column per group in the all-reduce buffer
        h = cfg.health
        self.group_stragglers = GroupStragglers(h.straggler_every, h.straggler_factor, h.straggler_stop_after) \
            if h.straggler_every else None
        self.busy_s = 0.0  # this group's last step, less its waits on the others (quorum, all-reduce)
        self.plan: StepPlan | None = None  # the quorum the next step runs with, when already formed
        self.notes: list[tuple[str, dict, str]] = []  # events to log once the logger exists
        self.last_participants = None

    def warm_up(self) -> None:
        """One forward and backward before joining, its gradients dropped: first-call costs (FSDP's lazy
        set-up, the allocator) would otherwise make this group's first step late enough for its peers'
        all-reduce to time out."""
        batch = self.loader.rows(0).to(self.env.device)
        with autocast_context(self.env.device, self.cfg.precision.dtype, self.wrapper == "fsdp"):
            loss = self.model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    # --- the layout: G groups, each a world of its own ----------------------------------------------

    def build_dims(self) -> ParallelDims:
        p = self.cfg.parallel
        return ParallelDims.build(self.env.world_size, 1, p.dp_shard, p.tp)

    def data_parallel_place(self) -> tuple[int, int]:
        group_dp = self.dims.dp
        return (self.group % self.groups) * group_dp + self.dims.dp_rank(self.env.rank), self.groups * group_dp

    def job_rank(self) -> int:
        return self.group * self.env.world_size + self.env.rank

    def random_kill_victims(self) -> int:
        return (self.groups + self.cfg.fault.spares) * self.env.world_size  # any process of any group

    def make_logger(self):
        logger = super().make_logger()
        logger.prefix = f"[group {self.group}] "
        logger.step_lines = self.group == 0  # one group's step lines on the console; each logs every step
        self.logger = logger
        self.flush_notes()  # how this group joined
        return logger

    def write_config(self) -> None:
        super().write_config()
        if self.env.is_main and self.group == 0:  # RUN_DIR/config.json: what `hardy export --model RUN_DIR` reads
            write_json_atomic(self.shared_dir / "config.json", self.resolved)

    # --- state a replacement takes from a live peer ------------------------------------------------

    def live_state(self) -> dict:
        return local_state(self)

    def load_live_state(self, state: dict) -> None:
        load_local_state(self, state)

    def maybe_resume(self) -> Path | None:
        """Join the quorum first: a live peer ahead of us heals us. Only with none ahead (the whole job
        restarting, or every other group down) does the group read the newest checkpoint."""
        self.plan = self.replica.begin_step()
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.plan.healed:  # train_step reports it
            return None
        if self.cfg.checkpoint.resume == "never":
            path = None
        else:
            path = super().maybe_resume()
        if path is not None:
            self.replica.set_step(self.step)
            self.note("live_fallback", f"replica group {self.group}: no live peer ahead of it; resumed from "
                                       f"checkpoint {path.name} (step {self.step})", step=self.step,
                      checkpoint=str(path))
        elif restarted:
            self.note("live_fallback", f"replica group {self.group} restarted with no live peer and no checkpoint: "
                                       "training starts again from step 0", step=0, checkpoint=None)
        return path

    def note(self, event: str, line: str, **fields) -> None:
        self.notes.append((event, fields, line))

    def flush_notes(self) -> None:
        for event, fields, line in self.notes:
            self.logger.event(event, group=self.group, **fields)
            self.logger.print(line)
        self.notes.clear()

    # --- the step -----------------------------------------------------------------------------------

    def train_step(self) -> dict:
        self.timer.start()
        t0 = time.perf_counter()
        self.hooks.before_step(self.step + 1)
        waited = time.perf_counter()
        plan, self.plan = self.plan or self.replica.begin_step(), None
        waited = time.perf_counter() - waited
        while True:
            if plan.healed:
                self.note("live_heal", f"replica group {self.group} healed from a live peer at step {self.step}",
                          step=self.step)
            self.report_quorum(plan)
            buffer = self.compute(plan)
            t_reduce = time.perf_counter()
            reduced = self.replica.all_reduce(buffer)
            # should_commit every time, whatever the all-reduce did: the group's processes agree in it, and a
            # failure it counts makes the lighthouse start a new quorum (a fresh process group)
            committed = self.replica.commit() and reduced
            waited += time.perf_counter() - t_reduce
            if committed:
                break
            error = self.replica.error()
            self.note("live_retry", f"step {self.step + 1} did not commit ({error or 'a replica group failed'}): "
                                    "computing it again with the next quorum", step=self.step + 1, error=error)
            self.flush_notes()
            self.optimizer.zero_grad(set_to_none=True)
            t_quorum = time.perf_counter()
            plan = self.replica.begin_step()
            waited += time.perf_counter() - t_quorum
        self.flush_notes()
        record = self.apply(plan, buffer)
        self.busy_s = time.perf_counter() - t0 - waited
        return record

    def report_quorum(self, plan: StepPlan) -> None:
        if plan.participants == self.last_participants:
            return
        self.last_participants = plan.participants
        missing = self.groups - min(plan.participants, self.groups)
        if missing and self.cfg.fault.exact:
            how = f"the others compute its share{'s' if missing > 1 else ''} (exact)"
        elif missing:
            how = f"{missing} share(s) of the batch dropped per step until it is back (fast mode)"
        else:
            how = "the full batch"
        spares = max(0, plan.participants - self.groups)
        self.note("live_quorum", f"step {self.step + 1}: {plan.participants} replica group(s) in the quorum "
                                 f"({self.groups} computing{f', {spares} spare' if spares else ''}): {how}",
                  step=self.step + 1, participants=plan.participants, slots=list(plan.computed))

    def compute(self, plan: StepPlan) -> torch.Tensor:
        """Forward and backward for this group's slots; returns the buffer the groups sum: per row, the
        flat local gradient shard, then the row's loss and non-finite count; in row 0, the stop flag and each
        group's busy time of the previous step (its own column)."""
        cfg, device, accum = self.cfg, self.env.device, self.cfg.train.grad_accum
        rows = self.groups if cfg.fault.exact else 1
        n = self.numel
        buffer = torch.zeros(rows, n + 3 + self.columns, dtype=torch.float32, device=device)
        group_dp, local_dp = self.dims.dp, self.dims.dp_rank(self.env.rank)
        for slot in plan.slots:
            # dropout: the same draws whichever group computes the slot
            torch.manual_seed(cfg.train.seed * 1_000_003 + (self.step * self.groups + slot) * group_dp + local_dp)
            self.loader.dp_rank = slot * group_dp + local_dp
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            for micro in range(accum):
                batch = self.loader.rows(micro).to(device, non_blocking=True)
                with grad_sync_context(self.model, micro == accum - 1):
                    with autocast_context(device, cfg.precision.dtype, self.wrapper == "fsdp"):
                        loss = self.model(batch[:, :-1], targets=batch[:, 1:])
                    loss = self.hooks.loss(self.step + 1, loss)
                    (loss / accum).backward()
                loss_sum += loss.detach().float()
            row = buffer[slot if cfg.fault.exact else 0]
            torch.cat([local(p.grad).reshape(-1) for p in self.params], out=row[:n])
            row[n] = loss_sum / accum
            row[n + 1] = (~torch.isfinite(loss_sum)).float()
            self.optimizer.zero_grad(set_to_none=True)
        buffer[0, n + 2] = float(self.stop.requested)
        buffer[0, n + 3 + self.group] = self.busy_s  # the previous step's: this one is not over
        return buffer

    def apply(self, plan: StepPlan, buffer: torch.Tensor) -> dict:
        """The committed step: the mean gradient of the computed slots, then the Trainer's decisions."""
        cfg, device, n = self.cfg, self.env.device, self.numel
        grads = combine_slot_rows(buffer[:, :n], plan.computed) if cfg.fault.exact else \
            buffer[0, :n].div_(len(plan.computed))
        offset = 0
        for p in self.params:
            p.grad = torch.zeros_like(p)
            shard = local(p.grad)
            shard.copy_(grads[offset:offset + shard.numel()].view_as(shard))
            offset += shard.numel()
        extras = torch.cat([torch.stack([buffer[:, n].sum(), buffer[:, n + 1].sum(), buffer[:, n + 2].sum()]),
                            buffer[0, n + 3:]]).double()
        summed = D.all_reduce_sum(extras)  # over the group's processes: every process of every group sees the same
        sq_norm = grad_sq_norm(self.params, device)
        readings = torch.cat([summed, sq_norm.reshape(1)])
        self.timer.mark()  # the step's one read-back follows
        loss_total, bad_count, stops, *busy, sq = readings.tolist()
        self.watch_groups(busy)
        mean_loss = loss_total / (len(plan.computed) * self.env.world_size)
        grad_norm = math.sqrt(sq)
        bad = bad_count > 0 or not (math.isfinite(grad_norm) and math.isfinite(mean_loss))
        if bad and not cfg.fault.skip_nonfinite:
            raise HardyError(f"non-finite loss or gradient at step {self.step + 1} (fault.skip_nonfinite = false)")
        # every group sees the same loss: the same spike decision. Live recovery skips a spike's step
        # (no rollback: that would send every group back to a checkpoint)
        spike = not bad and cfg.fault.spike_detection and self.spikes.is_spike(mean_loss)
        lr = self.scheduler.get_last_lr()[0]
        ckpt_wait = 0.0
        if bad or spike:
            self.skipped += 1
        else:
            ckpt_wait = self.update_weights(self.params, mean_loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.advance_schedule()
        self.loader.consumed += cfg.train.grad_accum  # the whole global batch, computed or dropped
        self.step += 1
        self.last_rank = plan.rank
        dt = self.timer.stop()
        self.hooks.after_step(self.step)
        share = len(plan.computed) / self.groups
        return {"step": self.step, "loss": mean_loss, "grad_norm": grad_norm, "lr": lr,
                "tokens": self.step * self.tokens_per_step, "tokens_per_s": self.tokens_per_step * share / dt,
                "step_time_s": dt, "skipped": bool(bad or spike), "loss_scale": 1.0, "ckpt_wait_s": ckpt_wait,
                "stop": stops > 0, "participants": plan.participants, "slots": len(plan.computed),
                "own_slots": len(plan.slots)}

    def watch_groups(self, busy: list[float]) -> None:
        """Per-group busy times of the previous step (every group reads the same): name a straggler group,
        and act on one slow for health.straggler_stop_after windows in a row."""
        if self.group_stragglers is None or self.step == 0:
            return
        verdict = self.group_stragglers.observe(busy)
        h, act = self.cfg.health, verdict.act
        for group, ratio in verdict.slow:
            self.note("straggler", f"straggler: replica group {group} took {ratio:.1f}x the other groups' time "
                                   f"per step over the last {h.straggler_every} steps", step=self.step,
                      straggler_group=group, ratio=ratio)
        if act is None:
            self.flush_notes()
            return
        if h.straggler_action == "stop":
            raise HardyError(f"replica group {act} was a straggler in {h.straggler_stop_after} windows in a row: "
                             "stopping (health.straggler_action = stop)")
        self.note("straggler_evicted", f"replica group {act} evicted: a straggler in {h.straggler_stop_after} windows "
                                       "in a row (health.straggler_action = evict); the others go on without it",
                  step=self.step, straggler_group=act)
        self.flush_notes()
        if act == self.group:
            raise GroupEvicted()

    # --- checkpoints: the quorum's first group writes them -------------------------------------------

    last_rank = -1

    def writes_checkpoints(self) -> bool:
        return self.last_rank == 0

    def checkpoint_due(self, since_last: float, last_stall: float | None) -> bool:
        return self.writes_checkpoints() and super().checkpoint_due(since_last, last_stall)

    def save_checkpoint(self, final: bool = False):
        if not self.writes_checkpoints():
            return None, 0.0
        return super().save_checkpoint(final)

    def checkpoint_on_stop(self, logger) -> str | None:
        if self.writes_checkpoints():
            return super().checkpoint_on_stop(logger)
        # the launcher of this node reports the stop once its groups exit: not before the checkpoint exists,
        # which another node's group may still be writing
        f = self.cfg.fault
        timeout = f.hang_timeout_s or f.startup_timeout_s or 600.0
        logger.print(f"stopped on {self.stop.signal or 'a stop signal'} after step {self.step}; waiting up to "
                     f"{timeout:g} s for the quorum's first replica group to checkpoint it")
        record = wait_for_preemption(self.shared_dir, self.step, self.stale_stop, timeout)
        if record is None:
            logger.print(f"no checkpoint of step {self.step} appeared in {timeout:g} s")
            return None
        logger.print(f"the quorum's first replica group checkpointed step {self.step}: {record['checkpoint']}")
        return str(record["checkpoint"])

    def run(self):
        try:
            return super().run()
        except GroupEvicted:  # exit 0: torchrun does not restart it; the others leave it out from the next quorum
            return None
        except (HardyError, SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:  # a process of this group died (a collective inside the group failed, or
            # its quorum server went with its rank 0): this group restarts, the others go on
            raise HardyError(f"replica group {self.group} lost a process ({type(e).__name__}: {first_line(e)}); "
                             "it restarts and heals from a live peer while the others go on") from e
        finally:
            self.replica.shutdown()


def train_live(cfg, run_dir: Path):
    group = int(os.environ.get(ENV_GROUP, "-1"))
    if group < 0 or ENV_GROUPS not in os.environ:
        raise HardyError("fault.recovery = live runs under `hardy launch` (it starts the lighthouse and the "
                         "replica groups)")
    stopping = launcher_stopping(cfg.fault.startup_timeout_s or 7 * 86400)
    if stopping is not None:  # exit 0: its agent does not restart it again, and the launcher reports the stop
        print(f"[group {group}] the launcher forwarded {stopping}: this restart of replica group {group} does "
              "not rejoin (the others stopped at one step and checkpointed)", flush=True)
        return None
    return train(cfg, run_dir, LiveTrainer, group_dir(run_dir, group), LIVE_STOP_SIGNALS)
