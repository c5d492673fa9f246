#!/usr/bin/env python3
"""Holds `cachepick replay --clock virtual` to the wall-clock replay on the same cells.

For each workload it runs the wall-clock replay (real processes on loopback, `--via direct`) and the
virtual one (one seed, the same first requests) for cachepick's default, round robin and the oracle,
then prints one Markdown row per arm and workload: TTFT p50 and p90 in model milliseconds (the wall
replay's milliseconds times speedup ÷ load, its fleet's time scale) and the hit rate, side by side,
with the ratio and whether the cell agrees (TTFT within 10%, hit rate within 1 point). A wall cell
whose engines fell behind their clock (`lagged_s` > 0) is marked: its TTFTs are the machine's, not
the model's.

Usage: scripts/validate-virtual.py [--binary target/release/cachepick] [--out target/validate]
       [--workloads trace,burst,agents]
Keep the machine otherwise idle while it runs: the wall path measures in wall time.
"""

import argparse
import json
import pathlib
import subprocess
import sys

# (name, replay arguments, speedup, load). Speedups are the scenarios' own defaults halved, to give
# two cores room to keep the clock; the trace and agents are cut to their first requests.
CELLS = {
    "trace": (["--trace", "traces/mooncake-synthetic.jsonl", "--limit", "500"], 4.0, 1.0),
    "burst": (["--scenario", "burst"], 2.0, 1.0),
    "agents": (["--scenario", "agents", "--limit", "400"], 4.0, 1.0),
}
# The product's default policy is `time_floor_all` in the wall replay's names (durations in wall
# time) and `default` (the empty section) in virtual time, where wall time is model time.
WALL = ("round_robin,time_floor_all", {"round_robin": "round_robin", "time_floor_all": "default", "oracle": "oracle"})
VIRTUAL = "default,round_robin"


def run(command):
    print("$", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def within(a, b, share):
    return a is not None and b is not None and b > 0 and abs(a / b - 1) <= share


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="target/release/cachepick")
    parser.add_argument("--out", default="target/validate-virtual")
    parser.add_argument("--workloads", default="trace,burst,agents")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    rows = []
    for name in args.workloads.split(","):
        cell, speedup, load = CELLS[name]
        wall_dir, virtual_dir = out / name / "wall", out / name / "virtual"
        run([args.binary, "replay", *cell, "--speedup", str(speedup), "--load", str(load),
             "--policies", WALL[0], "--seed", "1", "--out", str(wall_dir)])
        run([args.binary, "replay", "--clock", "virtual", *cell, "--load", str(load),
             "--policies", VIRTUAL, "--seed", "1", "--seeds", "1", "--out", str(virtual_dir)])
        wall = json.loads((wall_dir / "report.json").read_text())
        virtual = json.loads((virtual_dir / "report.json").read_text())
        scale = speedup / load
        by_arm = {arm["arm"]: arm for arm in virtual["arms"]}
        for report in wall["policies"]:
            label = WALL[1].get(report["arm"])
            if label is None or label not in by_arm:
                continue
            run_figures = by_arm[label]["runs"][0]
            lag = (report.get("utilisation") or {}).get("lagged_s", 0.0)
            w50 = report["ttft_ms"]["p50"] and report["ttft_ms"]["p50"] * scale
            w90 = report["ttft_ms"]["p90"] and report["ttft_ms"]["p90"] * scale
            v50, v90 = run_figures["ttft_p50_ms"], run_figures["ttft_p90_ms"]
            wh, vh = report["hit_rate"], run_figures["hit_rate"]
            agrees = within(v50, w50, 0.10) and within(v90, w90, 0.10) and \
                wh is not None and vh is not None and abs(wh - vh) <= 0.01
            rows.append((name, label, w50, v50, w90, v90, wh, vh, lag, agrees))
    print("| workload | arm | wall p50 | virtual p50 | wall p90 | virtual p90 | wall hit % | virtual hit % | wall lag s | agrees |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|---|")
    fmt = lambda v, k=1.0, d=0: "–" if v is None else f"{v * k:.{d}f}"
    for name, label, w50, v50, w90, v90, wh, vh, lag, agrees in rows:
        print(f"| {name} | {label} | {fmt(w50)} | {fmt(v50)} | {fmt(w90)} | {fmt(v90)} | "
              f"{fmt(wh, 100, 1)} | {fmt(vh, 100, 1)} | {lag:.1f} | {'yes' if agrees else 'no'} |")


if __name__ == "__main__":
    main()
