"""A training run's event files, read while they grow, as one plain line per event.

What a newcomer watching a fault-tolerant run wants to see is what happened and what the job did
about it ("rank 0 killed (injected) at step 120 → restarted, resumed from step 100 in 4.1 s"), not
the ranks' own output (that stays in the run directory). The sources: RUN_DIR/metrics.jsonl (rank
0's event stream, appended across restarts), faults_fired.json (which injected faults have fired)
and hang_rank<R>.jsonl (the watchdog's reports).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hardy.fault.inject import LEDGER
from hardy.fsio import parse_json_lines

ARROW = "→"


@dataclass
class Incident:
    """One failure and the recovery from it, for the report's loss curve and event table."""
    kind: str  # killed | hung | failed | nan | spike
    step: int  # the step it struck
    time: float  # when (seconds since the epoch)
    injected: bool
    rank: int | None = None
    resumed_from: int | None = None  # the step training restarted from (restarts and rollbacks)
    recovery_s: float | None = None  # failure -> the resumed run's start (restarts)
    detect_s: float | None = None  # hangs: how long the watchdog waited
    line: str = ""


@dataclass
class RunWatcher:
    run_dir: Path
    total_steps: int
    progress_every: int = 25
    events: list[dict] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    _offset: int = 0
    _fired: set = field(default_factory=set)
    _hangs: dict = field(default_factory=dict)  # hang file -> lines already seen
    _last_time: float | None = None  # the newest event of the current attempt
    _last_step: int = 0
    _attempts: int = 0

    def _new_events(self) -> list[dict]:
        path = Path(self.run_dir) / "metrics.jsonl"
        if not path.is_file():
            return []
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        return parse_json_lines(data[:end].decode(errors="replace"))

    def _take_fired(self, kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """(kind, step, rank) of the injected faults of these kinds that fired since they were last
        taken; the others stay for the event they belong to."""
        path = Path(self.run_dir) / LEDGER
        try:
            fired = set(json.loads(path.read_text())) if path.is_file() else set()
        except (OSError, ValueError):
            return []  # being replaced right now: read it next time
        out = []
        for key in sorted(fired - self._fired):
            parts = key.split("@")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].startswith("rank"):
                fault = (parts[0], int(parts[1]), int(parts[2][4:]))
            elif len(parts) == 2 and parts[0] == "random_kill" and parts[1].isdigit():
                fault = ("kill", int(parts[1]), 0)
            else:
                continue
            if fault[0] in kinds:
                out.append(fault)
                self._fired.add(key)
        return out

    def _new_hangs(self) -> list[dict]:
        out = []
        for path in sorted(Path(self.run_dir).glob("hang_rank*.jsonl")):
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            seen = self._hangs.get(path.name, 0)
            out += parse_json_lines("\n".join(lines[seen:]))
            self._hangs[path.name] = len(lines)
        return out

    def poll(self) -> list[str]:
        lines = []
        for e in self._new_events():
            self.events.append(e)
            line = self._describe(e)
            if line:
                lines.append(line)
            if e.get("event") in ("start", "step", "checkpoint", "rollback", "end") and "time" in e:
                self._last_time = e["time"]
        return lines

    def _describe(self, e: dict) -> str | None:
        kind = e.get("event")
        if kind == "start":
            self._attempts += 1
            if self._attempts == 1 and not e.get("resumed_from"):
                resolved = (e.get("config") or {}).get("resolved", {})
                model = resolved.get("model", {}).get("name", "the model")
                return (f"training started: {model} on {resolved.get('world_size', '?')} process(es), "
                        f"{e.get('device', '')}, {self.total_steps} steps")
            return self._restart_line(e)
        if kind == "step":
            step = int(e["step"])
            self._last_step = step
            if e.get("skipped"):
                injected = bool(self._take_fired(("nan",)))
                inc = Incident("nan", step, e["time"], injected)
                inc.line = (f"step {step}: loss not finite ({'NaN injected' if injected else 'not injected'}) "
                            f"{ARROW} update skipped, training goes on")
                self.incidents.append(inc)
                return inc.line
            if step % self.progress_every == 0 or step == self.total_steps:
                return (f"step {step}/{self.total_steps}: loss {e['loss']:.3f}, {e['step_time_s']:.2f} s/step, "
                        f"{e['tokens_per_s']:,.0f} tokens/s")
            return None
        if kind == "rollback":
            injected = bool(self._take_fired(("spike",)))
            inc = Incident("spike", int(e["from_step"]), e["time"], injected, resumed_from=int(e["to_step"]))
            inc.line = (f"step {e['from_step']}: loss spike ({e['loss']:.2f}{', injected' if injected else ''}) "
                        f"{ARROW} rolled back to step {e['to_step']}")
            self.incidents.append(inc)
            return inc.line
        if kind == "straggler":
            return (f"straggler: rank {e['rank']} took {e['ratio']:.1f}x the others' compute "
                    f"(steps {e['steps'][0]}-{e['steps'][1]})")
        if kind == "health_warning":
            return f"health warning (rank {e.get('rank')}): {e.get('warning')}"
        if kind == "end":
            g = e.get("goodput") or {}
            tail = f", goodput {100 * g['goodput']:.1f}% over {g['restarts']} restart(s)" if g else ""
            return (f"training finished: {e['steps']} steps, final loss {e['final_loss']:.3f}, "
                    f"{e['tokens_per_s']:,.0f} tokens/s in its last attempt{tail}")
        return None

    def _restart_line(self, e: dict) -> str:
        resumed = int(e.get("step") or 0)
        hangs = self._new_hangs()
        fired = self._take_fired(("kill", "kill_in_ckpt", "hang"))
        since = self._last_time
        if hangs:
            hang = hangs[0]
            injected = next(((s, r) for k, s, r in fired if k == "hang"), None)
            step = injected[0] if injected else self._last_step + 1
            # the rank that stalled itself: the others stall in its collectives too, and whichever watchdog
            # fires first reports; an injected hang names its own rank
            inc = Incident("hung", step, hang["time"], injected is not None,
                           rank=injected[1] if injected else hang.get("rank"), detect_s=hang.get("detect_s"))
            since = hang["time"]
            what = (f"rank {inc.rank} hung{' (injected)' if inc.injected else ''} at step {step} {ARROW} "
                    f"watchdog stopped it after {inc.detect_s:.1f} s")
        elif fired:
            kind, step, rank = fired[0]
            inc = Incident("killed", step, since if since is not None else e["time"], True, rank=rank)
            what = f"rank {rank} killed (injected{', mid-checkpoint' if kind == 'kill_in_ckpt' else ''}) at step {step}"
        else:
            inc = Incident("failed", self._last_step + 1, since if since is not None else e["time"], False)
            what = f"a training process failed after step {self._last_step} (not injected; its log is in the run dir)"
        inc.resumed_from = resumed
        inc.recovery_s = e["time"] - since if since is not None else None
        took = f" in {inc.recovery_s:.1f} s" if inc.recovery_s is not None else ""
        inc.line = f"{what} {ARROW} restarted, resumed from step {resumed}{took}"
        self.incidents.append(inc)
        return inc.line
