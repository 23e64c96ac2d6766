"""Load time alone, in alternating fresh processes: hardy's native load of a GGUF file against llama.cpp's
Llama() on the same file (llama-cpp-python on PYTHONPATH), 3 each; prints every run, the medians and
their ratio.

    PYTHONPATH=<llama-cpp-python> .venv/bin/python bench/gguf_load_time.py /tmp/big/llama3.1-8b.Q4_0.gguf
"""
import json, statistics, subprocess, sys
path = sys.argv[1]
H = ("import time,torch; torch.set_num_threads(2); t=time.perf_counter(); from hardy.loading.load import load_model; "
     f"m=load_model({path!r}, gguf='native'); print(time.perf_counter()-t)")
L = ("import time; t=time.perf_counter(); import llama_cpp; "
     f"l=llama_cpp.Llama(model_path={path!r}, n_threads=2, n_ctx=600, verbose=False); print(time.perf_counter()-t)")
out = {"hardy": [], "llama": []}
for _ in range(3):
    for k, code in (("hardy", H), ("llama", L)):
        out[k].append(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]))
print(json.dumps(out), {k: statistics.median(v) for k, v in out.items()},
      statistics.median(out["hardy"]) / statistics.median(out["llama"]))
