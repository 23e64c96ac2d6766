"""`hardy demo`: the whole story on this machine, each stage one entry point of the layers below.

probe the machine → plan a small Llama for it → prepare the bundled text → train on 2 processes under
the launcher while a crash, a NaN and a hang are injected → perplexity → int8 / int4 compression
compared → generate → RUN_DIR/report.html. Every number the report shows is measured in this run
and kept in RUN_DIR/demo.json.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hardy.compress.kernel_rate import measure_quant_gemv
from hardy.compress.pipeline import CompressConfig, calibration_windows, compress_model
from hardy.compress.store import save_compressed
from hardy.data.prepare import PrepareReport, load_split, prepare
from hardy.demo.events import Incident, RunWatcher
from hardy.errors import HardyError
from hardy.eval.compare import measure_speed, quality, size_on_disk
from hardy.fault.goodput import account, read_events
from hardy.fsio import read_json_lines, write_json_atomic
from hardy.infer.generate import SamplingConfig, generate
from hardy.loading.load import load_model, set_threads
from hardy.model.config import count_parameters, get_preset
from hardy.ops.probe import run_probe
from hardy.plan.arch import arch_from_llama
from hardy.plan.check import check_run, run_hardware
from hardy.plan.hardware import hardware_from_profile, read_profile
from hardy.plan.runtime_probe import measure_training_runtime
from hardy.plan.train import TrainJob, plan_train

MARKER = "demo.json"  # a directory holding it is a demo's and may be replaced by the next demo
CORPORA = ("tinyshakespeare", "wikitext2-valid")  # bundled; wikitext2-test stays for evaluation elsewhere
ASSUMED_RESTART_S = 5.0  # the planner's restart cost before this run measures one
# what the demo's stages and report read from a probe profile, beyond what the planner checks
PROFILE_FIELDS = ("cpu.model", "cpu.physical_cores", "cpu.flags", "memory.bandwidth", "disk.write_bandwidth",
                  "disk.read_bandwidth", "allreduce", "duration_s")


@dataclass
class DemoOptions:
    run_dir: Path = Path("runs/demo")
    steps: int = 320
    nproc: int = 2
    preset: str = "small"
    layers: int = 4
    vocab: int = 4096
    seq: int = 128
    micro_batch: int = 4
    hang_timeout_s: float = 6.0
    faults: str | None = None  # default: a NaN, a crash and a hang spread over the run
    eval_tokens: int = 16384
    quick_probe: bool = True
    probe_file: Path | None = None  # a `hardy probe` profile of this machine, used instead of probing again
    prompt: str = "ROMEO:"

    def default_faults(self) -> str:
        s = self.steps
        return f"nan@{max(2, s // 5)},kill@{max(3, s * 11 // 20)},hang@{max(4, s * 4 // 5)}"


@dataclass
class Stage:
    name: str
    seconds: float
    summary: str


@dataclass
class Demo:
    opts: DemoOptions
    say: callable = print
    results: dict = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.opts.run_dir)

    def _stage(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        summary = fn()
        self.stages.append(Stage(name, time.perf_counter() - t0, summary))
        self.say(f"[{len(self.stages)}/9] {name}: {summary} ({self.stages[-1].seconds:.1f} s)")
        self._save()

    def _save(self) -> None:
        self.results["stages"] = [vars(s) for s in self.stages]
        write_json_atomic(self.run_dir / MARKER, self.results)

    def run(self) -> dict:
        if self.opts.nproc < 2:
            raise HardyError("the demo trains on at least 2 processes (--nproc 2)")
        if self.opts.steps < 20:
            raise HardyError(f"--steps {self.opts.steps}: the demo needs at least 20 steps to place its faults")
        profile = self.probe_file_profile()  # a bad file is refused before the run directory is touched
        prepare_run_dir(self.run_dir)
        self.results = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.opts).items()},
                        "started": time.time()}
        self._stage("probe", lambda: self.probe(profile))
        self._stage("plan", self.plan)
        self._stage("data", self.data)
        self._stage("train", self.train)
        self._stage("live recovery", self.live)
        self._stage("evaluate", self.evaluate)
        self._stage("compress", self.compress)
        self._stage("generate", self.generate)
        self._stage("report", self.report)
        self.results["wall_s"] = time.time() - self.results["started"]
        self._save()
        return self.results

    # ---------------------------------------------------------------------------------- stages

    def probe_file_profile(self) -> dict | None:
        """--probe FILE's profile, checked for what the planner and the report read from it."""
        path = self.opts.probe_file
        if path is None:
            return None
        profile = read_profile(path)
        where = f"probe profile {path}"
        hardware_from_profile(profile, where=where)
        for dotted in PROFILE_FIELDS:
            value = profile
            for key in dotted.split("."):
                if not isinstance(value, dict) or key not in value:
                    raise HardyError(f"{where}: no {dotted} (written by an older hardy probe? run it again)")
                value = value[key]
        return profile

    def probe(self, profile: dict | None = None) -> str:
        source = f" (from {self.opts.probe_file})" if profile is not None else ""
        if profile is None:
            profile = run_probe(self.run_dir, quick=self.opts.quick_probe, progress=False,
                                measure_quant=measure_quant_gemv, measure_runtime=measure_training_runtime)
        write_json_atomic(self.run_dir / "hardware-profile.json", profile)
        self.results["probe"] = profile
        cpu, mm = profile["cpu"], profile["matmul"]
        flags = "+".join(f for f, on in cpu["flags"].items() if on) or "no vector extensions of interest"
        best = max(d["best_flops"] for d in mm["dtypes"].values())
        return (f"{cpu['model']}, {cpu['physical_cores']} cores ({flags}); matmul {best / 1e9:,.0f} GFLOP/s, "
                f"memory {profile['memory']['bandwidth'] / 1e9:.1f} GB/s, disk write "
                f"{profile['disk']['write_bandwidth'] / 1e9:.2f} GB/s{source}")

    def _job(self, hw, device_mtbf_hours: float | None, restart_s: float) -> TrainJob:
        o = self.opts
        arch = arch_from_llama(self.model_config())
        return TrainJob(arch=arch, hw=hw, devices=o.nproc, seq=o.seq, global_batch_tokens=o.seq * o.micro_batch * o.nproc,
                        dp=o.nproc, zero=3, micro_batch=o.micro_batch, precision="fp32", restart_s=restart_s,
                        persistent_grads=False, device_mtbf_hours=device_mtbf_hours)

    def model_config(self):
        o = self.opts
        base = get_preset(o.preset)
        return base.first_layers(o.layers, name=f"{base.name}[:{o.layers} layers]").replace(vocab_size=o.vocab)

    def per_process_hardware(self):
        profile = self.results["probe"]
        machine = hardware_from_profile(profile, name="this machine")
        return run_hardware(machine, self.opts.nproc, 1, int(profile.get("threads") or 1))

    def plan(self) -> str:
        o = self.opts
        hw = self.per_process_hardware()
        first = plan_train(self._job(hw, None, ASSUMED_RESTART_S))
        # The failures this run will meet: the injected crash and hang over the planned time. The
        # planner turns that failure rate into the checkpoint interval the training then uses.
        stops = sum(1 for f in self.faults().split(",") if f.split("@")[0] in ("kill", "hang", "kill_in_ckpt"))
        planned_s = o.steps * first.step_s
        job_mtbf_s = planned_s / max(stops, 1)
        plan = plan_train(self._job(hw, job_mtbf_s * o.nproc / 3600, ASSUMED_RESTART_S + o.hang_timeout_s / 2))
        r = plan.reliability
        interval = max(2, min(int(r["interval_steps"]), o.steps // 4))
        self.results["plan"] = {**plan.to_dict(), "interval_used": interval, "job_mtbf_s": job_mtbf_s,
                                "injected_stops": stops, "assumed_restart_s": ASSUMED_RESTART_S}
        params = count_parameters(self.model_config()).total
        return (f"{self.model_config().name}, {params / 1e6:.1f}M parameters, FSDP on {o.nproc} processes: "
                f"{plan.peak_memory / 2**20:,.0f} MiB per process, {plan.step_s:.2f} s/step, checkpoint every "
                f"{interval} steps (Young/Daly for {stops} failures in ~{planned_s:.0f} s), goodput "
                f"{100 * r['goodput']:.0f}%")

    def faults(self) -> str:
        return self.opts.faults if self.opts.faults is not None else self.opts.default_faults()

    def data(self) -> str:
        report: PrepareReport = prepare(list(CORPORA), f"bpe:{self.opts.vocab}", self.run_dir / "data",
                                        val_fraction=0.05, seed=1)
        self.results["data"] = vars(report)
        removed = sum(report.removed.values())
        why = ", ".join(f"{n} {k}" for k, n in report.removed.items() if n)
        return (f"{report.documents:,} documents read, {removed:,} removed ({why or 'none'}), "
                f"{report.tokens['train']:,} training and {report.tokens['val']:,} validation tokens")

    def train_config(self) -> str:
        o = self.opts
        return "\n".join([
            "# written by `hardy demo`: the run it trained (rerun with `hardy launch --nproc 2 THIS_FILE`)",
            "[model]", f'preset = "{o.preset}"', f"n_layers = {o.layers}",
            "[data]", f'path = "{(self.run_dir / "data").resolve()}"', f"seq_len = {o.seq}",
            "[train]", f"steps = {o.steps}", "seed = 1234", f"micro_batch = {o.micro_batch}", "threads = 1",
            "[optim]", "lr = 3e-3", f"warmup_steps = {max(1, o.steps // 16)}",
            "[parallel]", f"dp_shard = {o.nproc}", 'backend = "gloo"',  # this machine's CPUs, GPU or not
            "[checkpoint]", f"interval = {self.results['plan']['interval_used']}", "keep = 2",
            "[fault]", f'inject = "{self.faults()}"', f"hang_timeout_s = {o.hang_timeout_s}",
            "[health]", "telemetry_interval_s = 2",
            "[log]", "every = 1000", "progress = false", ""])

    def train(self) -> str:
        config = self.run_dir / "train.toml"
        config.write_text(self.train_config())
        train_dir, log_dir = self.run_dir / "train", self.run_dir / "logs"
        cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", str(self.opts.nproc), "--max-restarts", "3",
               str(config), "--run-dir", str(train_dir), "--log-dir", str(log_dir)]
        watcher = RunWatcher(train_dir, self.opts.steps, progress_every=max(10, self.opts.steps // 4))
        self.say(f"      training: {' '.join(cmd[2:])}  (each rank's output: {log_dir}/)")
        with open(self.run_dir / "launcher.log", "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            while True:
                done = proc.poll() is not None
                for line in watcher.poll():
                    self.say(f"      {line}")
                if done:
                    break
                time.sleep(0.3)
        if proc.returncode:
            raise HardyError(f"training failed (exit {proc.returncode}); see {self.run_dir / 'launcher.log'} and "
                             f"{log_dir}/")
        goodput = account(train_dir)
        machine = hardware_from_profile(self.results["probe"], name="this machine")
        rows = check_run(train_dir, machine, int(self.results["probe"].get("threads") or 1)).rows
        self.results["train"] = {"events": watcher.events, "incidents": [vars(i) for i in watcher.incidents],
                                 "goodput": goodput, "check": [list(r) for r in rows],
                                 "telemetry": telemetry(train_dir)}
        end = next(e for e in reversed(watcher.events) if e.get("event") == "end")
        return (f"{end['steps']} steps, final loss {end['final_loss']:.3f}, {len(watcher.incidents)} incidents "
                f"recovered, goodput {100 * goodput['goodput']:.1f}% ({goodput['restarts']} restarts)")

    def live(self) -> str:
        """The same job under live recovery (torchft): 2 replica groups of 1 process, one SIGKILLed at a
        quarter of the run; the other goes on without it, and the restarted one heals from it."""
        o = self.opts
        kill = max(3, o.steps // 4)
        config = self.run_dir / "live.toml"
        config.write_text(self.train_config().replace(f"dp_shard = {o.nproc}", "dp_replicate = 2").replace(
            f'inject = "{self.faults()}"', f'inject = "kill@{kill}@rank1"\nrecovery = "live"\nexact = true'))
        live_dir = self.run_dir / "live"
        cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "2", "--max-restarts", "2", str(config),
               "--run-dir", str(live_dir), "--log-dir", str(self.run_dir / "logs-live")]
        self.say(f"      live recovery: {' '.join(cmd[2:])}")
        with open(self.run_dir / "live-launcher.log", "wb") as out:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        if code:
            raise HardyError(f"live-recovery training failed (exit {code}); see {self.run_dir / 'live-launcher.log'}")
        self.results["live"] = live = live_recovery(live_dir, kill)
        restarts = [i.recovery_s for i in self._incidents() if i.recovery_s is not None]
        live["restart_recovery_s"] = sum(restarts) / len(restarts) if restarts else None
        healed = (f"the killed group healed from its peer {live['heal_s']:.1f} s after the kill"
                  if live["heal_s"] is not None else "the run ended before the killed group was back")
        return (f"group 1 killed at step {kill}: group 0 went on after {live['stall_s']:.2f} s (restart recovery "
                f"above: {live['restart_recovery_s'] or float('nan'):.1f} s); {healed}")

    def _incidents(self):
        return [Incident(**i) for i in self.results.get("train", {}).get("incidents", [])]

    def evaluate(self) -> str:
        loaded = load_model(str(self.run_dir / "train"))
        tokens = [int(t) for t in load_split(self.run_dir / "data", "val")[:self.opts.eval_tokens]]
        q = quality([loaded.model], tokens, self.opts.seq, "full", None, False, batch_size=8)[0]
        self.results["evaluate"] = {"ppl": q["ppl"], "ppl_se": q["ppl_se"], "tokens": len(tokens), "ctx": self.opts.seq}
        return f"validation perplexity {q['ppl']:.2f} ± {q['ppl_se']:.2f} over {len(tokens):,} held-out tokens"

    def compress(self) -> str:
        source = str(self.run_dir / "train")
        train_ids = torch.from_numpy(load_split(self.run_dir / "data", "train")[:200_000].astype("int64"))
        variants = {"int8": CompressConfig(quant="rtn", bits=8, group_size=0),
                    "int4": CompressConfig(quant="gptq", bits=4, group_size=32, calib_samples=32,
                                           calib_seq=self.opts.seq)}
        for name, cfg in variants.items():
            loaded = load_model(source)
            calib = calibration_windows(train_ids, cfg.calib_samples, cfg.calib_seq, 0) if cfg.needs_calibration else None
            result = compress_model(loaded.model, cfg, calib, progress=False)
            save_compressed(loaded.config, result.state, result.quantized, loaded.tokenizer, self.run_dir / name,
                            {"source": source, "compress": cfg.to_dict(), "report": {}})
        specs = {"fp32": source, **{name: str(self.run_dir / name) for name in variants}}
        models = [load_model(spec).model for spec in specs.values()]
        tokens = [int(t) for t in load_split(self.run_dir / "data", "val")[:self.opts.eval_tokens]]
        rows = []
        for (name, spec), q in zip(specs.items(), quality(models, tokens, self.opts.seq, "full", None, False,
                                                          batch_size=8)):
            speed = measure_speed(spec, 1, 64, 48)
            rows.append({"name": name, "ppl": q["ppl"], "kl": q["kl"], "top1": q["top1"], "ppl_z": q["ppl_z"],
                         "size_bytes": size_on_disk(spec), "decode_tps": speed["decode_tps"],
                         "prefill_tps": speed["prefill_tps"], "peak_rss_bytes": speed["peak_rss_bytes"]})
        self.results["compress"] = rows
        return "; ".join(f"{r['name']} {r['size_bytes'] / 2**20:.1f} MiB, ppl {r['ppl']:.2f}, "
                         f"{r['decode_tps']:,.0f} tok/s" for r in rows)

    def generate(self) -> str:
        loaded = load_model(str(self.run_dir / "int4"))
        tok = loaded.tokenizer
        prompt = tok.encode(self.opts.prompt, add_bos=False)
        out = generate(loaded.model, prompt, SamplingConfig(max_new_tokens=60, temperature=0.8, seed=1))
        text = tok.decode(out.tokens, skip_special=True)  # the document separators it learnt to write
        self.results["generate"] = {"model": "int4", "prompt": self.opts.prompt, "text": text,
                                    "decode_tps": out.stats.decode_tps}
        return f"int4 model, {self.opts.prompt!r} → {' '.join(text.split())[:100]!r}"

    def report(self) -> str:
        from hardy.demo.report import write_report  # optional: the plots extra, only to draw

        self.results["wall_s"] = time.time() - self.results["started"]
        path = write_report(self.run_dir / "report.html", self.results)
        return str(path)


def live_recovery(live_dir: Path, kill_step: int) -> dict:
    """What the live run's metrics say about its kill: the survivor's stall (its next step's time beyond
    its median step), when the killed group healed, and the run's final loss."""
    survivor = read_events(live_dir / "replica_0")
    steps = {r["step"]: r for r in survivor if r["event"] == "step"}
    median = sorted(r["step_time_s"] for r in steps.values())[len(steps) // 2]
    after = steps.get(kill_step + 1)
    heals = [r for r in read_events(live_dir / "replica_1") if r["event"] == "live_heal"]
    end = next((r for r in reversed(survivor) if r["event"] == "end"), {})
    return {"kill_step": kill_step, "stall_s": max(0.0, after["step_time_s"] - median) if after else float("nan"),
            "step_s": median, "heal_s": heals[0]["time"] - steps[kill_step]["time"] if heals and kill_step in steps
            else None, "heal_step": heals[0]["step"] if heals else None, "final_loss": end.get("final_loss"),
            "steps": end.get("steps")}


def prepare_run_dir(run_dir: Path) -> None:
    """Start from an empty directory; replace only a previous demo's (never someone's other files)."""
    if run_dir.exists():
        if not run_dir.is_dir() or (any(run_dir.iterdir()) and not (run_dir / MARKER).is_file()):
            raise HardyError(f"{run_dir} exists and is not a previous demo's run directory; choose another --run-dir")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / MARKER, {})


def telemetry(train_dir: Path) -> dict[str, list[dict]]:
    """Every rank's telemetry samples: rank 0's from the metrics stream, the others' from their files."""
    out = {"0": [e for e in read_json_lines(train_dir / "metrics.jsonl") if e.get("event") == "telemetry"]}
    for f in sorted(train_dir.glob("telemetry_rank*.jsonl")):
        out[f.stem.removeprefix("telemetry_rank")] = read_json_lines(f)
    return out


def run_demo(opts: DemoOptions, say=print) -> dict:
    set_threads(None)
    return Demo(opts, say).run()
