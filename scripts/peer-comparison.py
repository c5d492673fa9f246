#!/usr/bin/env python3
"""The peer comparison in BENCHMARKS.md: cachepick (gate + floor, gate, affinity; through a real Envoy)
against smg (cache_aware, round_robin) and vllm-router (cache_aware), on the Mooncake trace and the burst
scenario, at two loads, over several seeds. Every run is one `cachepick replay`; this script only runs
them and puts their report.json files side by side (mean over seeds, with the range).

    scripts/peer-comparison.py --cachepick target/release/cachepick --out target/peer-comparison

The routers come from `scripts/provision-peers` (pinned versions). Re-aggregate without running:
`--summarise-only`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fronts(bin_dir):
    # Loopback ports only: the peers' metrics listeners default to 0.0.0.0:29000.
    common = ("--worker-urls {workers} --host {host} --port {port} "
              "--prometheus-host {host} --prometheus-port {metrics_port}")
    smg = os.path.join(bin_dir, "smg")
    vllm = os.path.join(bin_dir, "vllm-router")
    return [
        f"{smg} launch {common} --policy cache_aware --log-level warn",
        f"{smg} launch {common} --policy round_robin --log-level warn",
        f"{vllm} {common} --policy cache_aware --log-level warning",
    ]


def run(args, scenario, load, seed, bin_dir):
    out = os.path.join(args.out, f"{scenario['name']}-load{load}-seed{seed}")
    report = os.path.join(out, "report.json")
    if os.path.exists(report) and not args.again:
        return out
    command = [args.cachepick, "replay", *scenario["args"], "--via", "envoy",
               "--policies", "gate_floor,gate,affinity", "--load", str(load), "--seed", str(seed),
               "--out", out]
    for front in fronts(bin_dir):
        command += ["--front", front]
    print("$", " ".join(command[:12]), "… (3 fronts)", flush=True)
    subprocess.run(command, check=True)
    return out


def rerun_front(args, out, prefix, bin_dir):
    """Measures one front again in an existing run (same scenario, load and seed, a fresh fleet) and puts
    its arm in place of the old one in the run's report.json, marked `rerun`."""
    report_path = os.path.join(out, "report.json")
    with open(report_path) as f:
        report = json.load(f)
    template = next(t for t in fronts(bin_dir) if os.path.basename(t.split()[0]) == prefix)
    again = os.path.join(out, f"rerun-{prefix}")
    scenario_args = (["--scenario", "burst"] if report["scenario"] == "burst"
                     else ["--trace", report["scenario"], "--limit", str(report["requests"])])
    command = [args.cachepick, "replay", *scenario_args, "--policies", "none",
               "--load", str(report["fleet"]["load"]), "--seed", str(report["fleet"]["seed"]),
               "--out", again, "--front", template]
    print("$", " ".join(command[:11]), "… (1 front)", flush=True)
    subprocess.run(command, check=True)
    with open(os.path.join(again, "report.json")) as f:
        fresh = json.load(f)["policies"][0]
    fresh["rerun"] = True
    report["policies"] = [fresh if arm["arm"] == fresh["arm"] else arm for arm in report["policies"]]
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)


def figures(arm):
    u = arm.get("utilisation") or {}
    return {
        "hit": arm["hit_rate"] * 100 if arm["hit_rate"] is not None else None,
        "ttft_p50": arm["ttft_ms"]["p50"],
        "ttft_p99": arm["ttft_ms"]["p99"],
        "e2e_p50": arm["e2e_ms"]["p50"],
        "share": arm["worker_share"],
        "slots": u.get("slots", 0) * 100,
        "queued": u.get("queued", 0) * 100,
        "failed": arm["errors"] + arm["rejections"] + arm["dropped"],
    }


def cell(values, digits):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def summarise(args, scenarios):
    lines = []
    data = {}
    for scenario in scenarios:
        for load in args.loads:
            runs = []
            for seed in args.seeds:
                path = os.path.join(args.out, f"{scenario['name']}-load{load}-seed{seed}", "report.json")
                if os.path.exists(path):
                    with open(path) as f:
                        runs.append(json.load(f))
            if not runs:
                continue
            arms = [arm["arm"] for arm in runs[0]["policies"]]
            lines.append(f"\n#### {scenario['title']}, load {load} "
                         f"({len(runs)} seed{'s' if len(runs) > 1 else ''}: "
                         f"{', '.join(str(r['fleet']['seed']) for r in runs)})\n")
            lines.append("| router | prefix hit % | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | worker share "
                         "| slots busy % | queued % | failed |")
            lines.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
            key = f"{scenario['name']}-load{load}"
            data[key] = {}
            for name in arms:
                per_seed = [figures(next(a for a in r["policies"] if a["arm"] == name)) for r in runs]
                data[key][name] = per_seed
                col = lambda k, d: cell([f[k] for f in per_seed], d)
                label = {"gate_floor": "cachepick gate + floor", "gate": "cachepick gate",
                         "affinity": "cachepick affinity"}.get(name, name)
                lines.append(f"| {label} | {col('hit', 1)} | {col('ttft_p50', 0)} | {col('ttft_p99', 0)} "
                             f"| {col('e2e_p50', 0)} | {col('share', 2)} | {col('slots', 0)} "
                             f"| {col('queued', 0)} | {sum(f['failed'] for f in per_seed)} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cachepick", default=os.path.join(ROOT, "target/release/cachepick"))
    parser.add_argument("--trace", default=os.path.join(ROOT, "../shared/traces/mooncake-synthetic.jsonl"))
    parser.add_argument("--limit", type=int, default=1000, help="requests of the trace")
    parser.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0],
                        help="loads for the trace (default 1,2: about a third of the slots busy, and queues)")
    parser.add_argument("--burst-loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0],
                        help="loads for the burst scenario (default 0.5,1: the burst within capacity, and beyond it)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--scenarios", default="trace,burst")
    parser.add_argument("--out", default=os.path.join(ROOT, "target/peer-comparison"))
    parser.add_argument("--again", action="store_true", help="re-run runs whose report exists")
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--rerun-front", metavar="PROGRAM",
                        help="measure only this router's arm again in every existing run (smg, vllm-router)")
    args = parser.parse_args()
    wanted = args.scenarios.split(",")
    scenarios = []
    if "trace" in wanted:
        scenarios.append({"name": "mooncake", "title": f"Mooncake trace, first {args.limit} requests",
                          "args": ["--trace", args.trace, "--limit", str(args.limit)], "loads": args.loads})
    if "burst" in wanted:
        scenarios.append({"name": "burst", "title": "Burst scenario", "args": ["--scenario", "burst"],
                          "loads": args.burst_loads})
    os.makedirs(args.out, exist_ok=True)
    if not args.summarise_only:
        bin_dir = subprocess.run([os.path.join(ROOT, "scripts/provision-peers")], check=True,
                                 stdout=subprocess.PIPE, text=True).stdout.strip()
        for scenario in scenarios:
            for load in scenario["loads"]:
                for seed in args.seeds:
                    out = run(args, scenario, load, seed, bin_dir)
                    if args.rerun_front:
                        rerun_front(args, out, args.rerun_front, bin_dir)
    # One table per scenario and load that has runs.
    args.loads = sorted({load for scenario in scenarios for load in scenario["loads"]})
    summarise(args, scenarios)


if __name__ == "__main__":
    sys.exit(main())
