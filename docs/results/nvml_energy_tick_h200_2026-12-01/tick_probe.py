"""Probe: how often the H200's NVML energy counter advances (while a GEMM loop keeps the GPU busy)."""
import json, os, sys, time, threading
import pynvml, torch
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
stop = False
def busy():
    while not stop:
        for _ in range(20): a @ a
        torch.cuda.synchronize()
t = threading.Thread(target=busy); t.start(); time.sleep(0.5)
vals, times = [], []
t0 = time.perf_counter()
last = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
while time.perf_counter() - t0 < 2.0:
    e = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    if e != last:
        vals.append(e - last); times.append(time.perf_counter()); last = e
stop = True; t.join()
gaps = [1e3 * (b - a_) for a_, b in zip(times, times[1:])]
import statistics
out = {"changes_in_2s": len(vals), "gap_ms_median": statistics.median(gaps) if gaps else None,
       "gap_ms_max": max(gaps) if gaps else None, "mj_per_change_median": statistics.median(vals) if vals else None}
print(json.dumps(out))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "tick_probe.json"), "w"))
