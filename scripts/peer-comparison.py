#!/usr/bin/env python3
"""The peer comparison in BENCHMARKS.md, on the simulator's step model: cachepick (gate + floor, gate,
affinity, the prefill-time unit's time + floor; through a real Envoy; gate + floor and time + floor also
with the engines' KV events, at one and three picker replicas, the three with and without `replica_sync`) against smg (cache_aware, round_robin),
vllm-router (cache_aware, kv_aware on the KV events) and the re-implemented llm-d and Dynamo rules (at one
and three router replicas, `--peer`), beside the oracle (the routing limit), on the Mooncake trace, the burst scenario and the prefill-heavy
agents scenario, at a load below the knee, at the knee and above it, over several seeds. Every run is two
`cachepick replay`s (the main arms, then the events arms); this script only runs them and puts their
report.json files side by side (mean over seeds, with the range).

    scripts/peer-comparison.py --cachepick target/release/cachepick --out target/peer-comparison

The routers come from `scripts/provision-peers` (pinned versions). Re-aggregate without running:
`--summarise-only`. TTFTs are given in the modelled GPU's time: the client's wall time divided by the
fleet's time scale.
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
    events = ("--kv-event-block-size 16 --kv-event-model {model} {kv_events:--kv-event-source} "
              "{kv_events_replay:--kv-event-replay-source}")
    return [
        f"{smg} launch {common} --policy cache_aware --log-level warn",
        f"{smg} launch {common} --policy round_robin --log-level warn",
        f"{vllm} {common} --policy cache_aware --log-level warning",
        f"{vllm} {common} --policy kv_aware {events} --log-level warning",
    ]


def replay(args, scenario, load, seed, out, extra):
    report = os.path.join(out, "report.json")
    if os.path.exists(report) and not args.again:
        return
    command = [args.cachepick, "replay", *scenario["args"], "--via", "envoy", "--load", str(load),
               "--seed", str(seed), "--out", out, *extra]
    print("$", " ".join(command[:14]), "…", flush=True)
    subprocess.run(command, check=True)


def run(args, scenario, load, seed, bin_dir):
    out = os.path.join(args.out, f"{scenario['name']}-load{load}-seed{seed}")
    main = ["--policies", args.policies]
    for front in fronts(bin_dir):
        main += ["--front", front]
    replay(args, scenario, load, seed, out, main)
    # The KV event arms: gate + floor and time + floor on the engines' events, one picker and three
    # behind one Envoy; the re-implemented peers at one and three router replicas beside them.
    replay(args, scenario, load, seed, os.path.join(out, "events"),
           ["--policies", args.events_policies, "--index", "events", "--replicas", "1,3",
            "--replica-sync", "--peer", "llm-d,dynamo", "--no-oracle"])
    return out


def rerun_front(args, out, prefix, bin_dir):
    """Measures one front again in an existing run (same scenario, load and seed, a fresh fleet) and puts
    its arm in place of the old one in the run's report.json, marked `rerun`."""
    report_path = os.path.join(out, "report.json")
    with open(report_path) as f:
        report = json.load(f)
    again = os.path.join(out, f"rerun-{prefix}")
    scenario_args = (["--scenario", report["scenario"]] if report["scenario"] in ("burst", "agents")
                     else ["--trace", report["scenario"], "--limit", str(report["requests"])])
    for template in fronts(bin_dir):
        if os.path.basename(template.split()[0]) != prefix:
            continue
        command = [args.cachepick, "replay", *scenario_args, "--policies", "none", "--no-oracle",
                   "--load", str(report["fleet"]["load"]), "--seed", str(report["fleet"]["seed"]),
                   "--out", again, "--front", template]
        print("$", " ".join(command[:12]), "… (1 front)", flush=True)
        subprocess.run(command, check=True)
        with open(os.path.join(again, "report.json")) as f:
            fresh = json.load(f)["policies"][0]
        fresh["rerun"] = True
        report["policies"] = [fresh if arm["arm"] == fresh["arm"] else arm
                              for arm in report["policies"]]
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)


def figures(arm, scale):
    u = arm.get("utilisation") or {}
    model = lambda ms: None if ms is None else ms / scale
    return {
        "hit": arm["hit_rate"] * 100 if arm["hit_rate"] is not None else None,
        "ttft_p50": model(arm["ttft_ms"]["p50"]),
        "ttft_p90": model(arm["ttft_ms"]["p90"]),
        "ttft_p99": model(arm["ttft_ms"]["p99"]),
        "e2e_p50": model(arm["e2e_ms"]["p50"]),
        "share": arm["worker_share"],
        "busy": (u.get("busy") if u.get("busy") is not None else u.get("slots", 0)) * 100,
        "queued": u.get("queued", 0) * 100,
        "lagged": u.get("lagged_s", 0),
        "failed": arm["errors"] + arm.get("refusals", arm.get("rejections", 0)) + arm["dropped"],
    }


def cell(values, digits):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


LABELS = {
    "gate_floor": "cachepick gate + floor",
    "gate": "cachepick gate",
    "affinity": "cachepick affinity",
    "gate_floor/events/x1": "cachepick gate + floor, events ×1",
    "gate_floor/events/x3": "cachepick gate + floor, events ×3",
    "time_floor": "cachepick time + floor",
    "time_floor_all": "cachepick time + floor, misses to the whole fleet",
    "time_floor/events/x1": "cachepick time + floor, events ×1",
    "time_floor/events/x3": "cachepick time + floor, events ×3",
    "time_floor_all/events/x1": "cachepick time + floor, misses to the whole fleet, events ×1",
    "time_floor_all/events/x3": "cachepick time + floor, misses to the whole fleet, events ×3",
    "gate_floor/events/x3+sync": "cachepick gate + floor, events ×3, replica sync",
    "time_floor/events/x3+sync": "cachepick time + floor, events ×3, replica sync",
    "time_floor_all/events/x3+sync": "cachepick time + floor, misses to the whole fleet, events ×3, replica sync",
    "llm-d/sticky (re-impl)/x1": "llm-d sticky (re-impl) ×1",
    "llm-d/sticky (re-impl)/x3": "llm-d sticky (re-impl) ×3",
    "dynamo/kv (re-impl)/x1": "Dynamo KV (re-impl) ×1",
    "dynamo/kv (re-impl)/x3": "Dynamo KV (re-impl) ×3",
}


def arms_of(run_dir):
    """Every arm of one run (the main replay and the events replay), in table order, with the time
    scale of its fleet."""
    arms = []
    scale = None
    for path in (os.path.join(run_dir, "report.json"), os.path.join(run_dir, "events", "report.json")):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            report = json.load(f)
        scale = report["fleet"]["time_scale"]
        arms += report["policies"]
    # cachepick's rows first, the events rows right after gate + floor, the oracle last.
    order = ["gate_floor", "gate_floor/events/x1", "gate_floor/events/x3", "gate", "affinity",
             "time_floor", "time_floor/events/x1", "time_floor/events/x3", "time_floor_all",
             "time_floor_all/events/x1", "time_floor_all/events/x3"]
    arms.sort(key=lambda a: (a["arm"] == "oracle",
                             order.index(a["arm"]) if a["arm"] in order else len(order)))
    return arms, scale


def ranking(data, name):
    """cachepick gate + floor against every other router on TTFT p90: the ratio of the means, and
    whether the seeds' ranges overlap (noise)."""
    ours = data.get("gate_floor")
    if not ours:
        return []
    lines = []
    mine = [f["ttft_p90"] for f in ours if f["ttft_p90"] is not None]
    for other, per_seed in data.items():
        if other in ("gate_floor", "oracle"):
            continue
        theirs = [f["ttft_p90"] for f in per_seed if f["ttft_p90"] is not None]
        if not mine or not theirs:
            continue
        ratio = statistics.fmean(theirs) / statistics.fmean(mine)
        overlap = max(min(mine), min(theirs)) <= min(max(mine), max(theirs))
        verdict = ("within noise" if overlap else "cachepick better" if ratio > 1 else "cachepick worse")
        lines.append(f"{LABELS.get(other, other)} {ratio:.2f}× cachepick's TTFT p90 ({verdict})")
    return lines


def ranking_table(data, scenarios):
    """One line per workload and load: every other row's TTFT p90 as a multiple of cachepick gate +
    floor's (above 1: cachepick better), marked where the seeds' ranges do not overlap."""
    keys = [f"{s['name']}-load{load}" for s in scenarios for load in s["loads"]]
    keys = [k for k in keys if k in data and data[k].get("gate_floor")]
    if not keys:
        return []
    others = [name for name in data[keys[0]] if name != "gate_floor"]
    lines = ["\n#### Ranking: each row's TTFT p90 ÷ cachepick gate + floor's (mean over seeds)\n",
             "**bold**: cachepick better, ranges over seeds apart; *italic*: cachepick worse, ranges apart; "
             "plain: within noise.\n",
             "| workload, load | " + " | ".join(LABELS.get(o, o) for o in others) + " |",
             "|---|" + "--:|" * len(others)]
    for key in keys:
        mine = [f["ttft_p90"] for f in data[key]["gate_floor"] if f["ttft_p90"] is not None]
        cells = []
        for other in others:
            theirs = [f["ttft_p90"] for f in data[key].get(other, []) if f["ttft_p90"] is not None]
            if not mine or not theirs:
                cells.append("-")
                continue
            ratio = statistics.fmean(theirs) / statistics.fmean(mine)
            apart = max(min(mine), min(theirs)) > min(max(mine), max(theirs))
            text = f"{ratio:.2f}"
            cells.append(text if not apart else f"**{text}**" if ratio > 1 else f"*{text}*")
        lines.append(f"| {key.replace('-load', ', ')} | " + " | ".join(cells) + " |")
    return lines


def summarise(args, scenarios):
    lines = []
    data = {}
    for scenario in scenarios:
        for load in scenario["loads"]:
            runs = []
            for seed in args.seeds:
                run_dir = os.path.join(args.out, f"{scenario['name']}-load{load}-seed{seed}")
                arms, scale = arms_of(run_dir)
                if arms:
                    runs.append((seed, arms, scale))
            if not runs:
                continue
            names = [arm["arm"] for arm in runs[0][1]]
            scales = sorted({scale for _, _, scale in runs})
            lines.append(f"\n#### {scenario['title']}, load {load} ({len(runs)} seed"
                         f"{'s' if len(runs) > 1 else ''}: {', '.join(str(s) for s, _, _ in runs)}; "
                         f"time scale {', '.join(str(s) for s in scales)})\n")
            lines.append("| router | prefix hit % | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms "
                         "| worker share | busy % | queued % | failed | TTFT p90 ÷ oracle |")
            lines.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
            key = f"{scenario['name']}-load{load}"
            data[key] = {}
            for name in names:
                per_seed = []
                for _, arms, scale in runs:
                    arm = next((a for a in arms if a["arm"] == name), None)
                    if arm is not None:
                        per_seed.append(figures(arm, scale))
                data[key][name] = per_seed
            oracle = [f["ttft_p90"] for f in data[key].get("oracle", []) if f["ttft_p90"]]
            for name in names:
                per_seed = data[key][name]
                col = lambda k, d: cell([f[k] for f in per_seed], d)
                ratio = "-"
                if oracle:
                    ratios = [f["ttft_p90"] / o for f, o in zip(per_seed, oracle) if f["ttft_p90"]]
                    ratio = cell(ratios, 2)
                failed = sum(f["failed"] for f in per_seed)
                lagged = max((f["lagged"] for f in per_seed), default=0)
                note = f" (sim lag {lagged:.1f} s)" if lagged > 0.5 else ""
                lines.append(f"| {LABELS.get(name, name)} | {col('hit', 1)} | {col('ttft_p50', 0)} "
                             f"| {col('ttft_p90', 0)} | {col('ttft_p99', 0)} | {col('e2e_p50', 0)} "
                             f"| {col('share', 2)} | {col('busy', 0)} | {col('queued', 0)} "
                             f"| {failed}{note} | {ratio} |")
            ranks = ranking(data[key], key)
            if ranks:
                lines.append("\nTTFT p90 against cachepick gate + floor: " + "; ".join(ranks) + ".")
    lines += ranking_table(data, scenarios)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "comparison.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(text)


def floats(text):
    return [float(x) for x in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cachepick", default=os.path.join(ROOT, "target/release/cachepick"))
    parser.add_argument("--trace", default=os.path.join(ROOT, "../shared/traces/mooncake-synthetic.jsonl"))
    parser.add_argument("--limit", type=int, default=1000, help="requests of the trace")
    # The knees were found by a scan of round robin's TTFT p90 over loads (BENCHMARKS.md).
    parser.add_argument("--loads", type=floats, default=[0.5, 1.0, 1.5],
                        help="loads for the trace: below the knee, at it, above")
    parser.add_argument("--burst-loads", type=floats, default=[2.0, 4.0, 8.0],
                        help="loads for the burst scenario: below the knee, at it, above")
    parser.add_argument("--agents-loads", type=floats, default=[1.0, 2.0, 3.0],
                        help="loads for the agents scenario: below the knee, at it, above")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    parser.add_argument("--scenarios", default="trace,burst,agents")
    parser.add_argument("--out", default=os.path.join(ROOT, "target/peer-comparison"))
    parser.add_argument("--again", action="store_true", help="re-run runs whose report exists")
    parser.add_argument("--policies", default="gate_floor,gate,affinity,time_floor",
                        help="cachepick's arms in the main replay, beside the fronts and the oracle")
    parser.add_argument("--events-policies", default="gate_floor,time_floor",
                        help="cachepick's arms on the KV events, at one and three replicas")
    parser.add_argument("--summarise-only", action="store_true")
    parser.add_argument("--rerun-front", metavar="PROGRAM",
                        help="measure only this router's arms again in every existing run (smg, vllm-router)")
    args = parser.parse_args()
    wanted = args.scenarios.split(",")
    scenarios = []
    if "trace" in wanted:
        scenarios.append({"name": "mooncake", "title": f"Mooncake trace, first {args.limit} requests",
                          "args": ["--trace", args.trace, "--limit", str(args.limit)], "loads": args.loads})
    if "burst" in wanted:
        scenarios.append({"name": "burst", "title": "Burst scenario", "args": ["--scenario", "burst"],
                          "loads": args.burst_loads})
    if "agents" in wanted:
        scenarios.append({"name": "agents", "title": "Agents scenario (prefill-heavy)",
                          "args": ["--scenario", "agents"], "loads": args.agents_loads})
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
    summarise(args, scenarios)


if __name__ == "__main__":
    sys.exit(main())
