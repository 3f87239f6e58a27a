#!/usr/bin/env python3
"""nvpool's engine and SPDK's nvmf_tgt side by side, on the same CPUs, in one run.

Each target runs on CPU 0 with a 512 MiB RAM namespace (nvpool: `memory:`, 4 KiB blocks;
SPDK: a malloc bdev, 4 KiB blocks), one reactor each; the client runs on CPU 1. Both
targets are driven by both clients: SPDK's `spdk_nvme_perf` and `nvpool bench`. Both
targets stay up for the whole run; SPDK busy-polls its core, so it is frozen (SIGSTOP)
whenever it is not the one measured. This machine has spells, minutes or seconds long,
in which everything runs at half speed, so the two targets are measured moments apart:
each run on one target is followed at once by the same run on the other (the order
alternates), and each ratio is taken within such a pair, then the median over pairs
with its spread (lowest to highest). The protocol-minimal responder (`nvpool responder`)
is measured beside them under both clients: it is the floor, what any NVMe/TCP target
costs on this machine (the best ratio to SPDK a target could show), and it shows which
pairs fell in a slow spell. The CPU time each target used per million I/Os is recorded
too (SPDK polls, so its figure is about one core-second per second whatever the load).

SPDK comes from `scripts/build-spdk` (target/spdk); without it this says so and exits.
Writes bench/results/spdk.{md,json}. Run as root (hugepages). Standard library only.
"""
import argparse, json, os, signal, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import BIN, REPO, cpu_seconds, free_port, hugepages, machine, own_network, wait_port  # noqa: E402

SPDK = os.path.join(REPO, "target", "spdk")
NQN = "nqn.2024-01.io.nvpool:peer"
FLOW_CONTROL_ON = "nvpool bench, SQ flow control on"
# The clients under which the protocol-minimal responder is measured too.
FLOOR_CLIENTS = ("spdk_nvme_perf", "nvpool bench")
RESULTS = os.path.join(REPO, "bench", "results")


def spdk_env():
    return dict(os.environ, LD_LIBRARY_PATH=os.path.join(SPDK, "lib"))


class Target:
    """One target process on CPU 0: `spdk`, `nvpool` or `responder`; nvpool's engine
    serves `namespace` (the 512 MiB RAM namespace unless told otherwise)."""

    def __init__(self, kind, workdir, namespace="memory:512MiB"):
        self.kind, self.port = kind, free_port()
        if kind == "spdk":
            config = {"subsystems": [
                {"subsystem": "bdev", "config": [
                    {"method": "bdev_malloc_create",
                     "params": {"name": "Malloc0", "num_blocks": 131072, "block_size": 4096}}]},
                {"subsystem": "nvmf", "config": [
                    {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
                    {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": True}},
                    {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}}},
                    {"method": "nvmf_subsystem_add_listener", "params": {
                        "nqn": NQN, "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                                                       "trsvcid": str(self.port)}}}]}]}
            path = os.path.join(workdir, "spdk.json")
            with open(path, "w") as f:
                json.dump(config, f)
            cmd = [os.path.join(SPDK, "bin", "nvmf_tgt"), "-m", "0x1", "-s", "1024", "-u",
                   "-r", os.path.join(workdir, f"spdk-{self.port}.rpc"), "-c", path]
            self.proc = subprocess.Popen(cmd, env=spdk_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elif kind == "responder":
            # It pretends to serve one namespace and naps when idle.
            cmd = [BIN, "responder", "--listen", f"127.0.0.1:{self.port}", "--core", "0"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            cmd = [BIN, "engine", "--listen", f"127.0.0.1:{self.port}", "--subsystem", NQN,
                   "--namespace", namespace, "--block-size", "4096", "--cores", "0", "--discovery-port", "0",
                   "--mgmt-socket", os.path.join(workdir, f"engine-{self.port}.sock")]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout=30)

    def freeze(self):
        """SPDK polls even when idle: stopped, it leaves CPU 0 to the target measured."""
        if self.kind == "spdk":
            self.proc.send_signal(signal.SIGSTOP)

    def thaw(self):
        if self.kind == "spdk":
            self.proc.send_signal(signal.SIGCONT)

    def stop(self):
        self.thaw()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spdk_perf(port, workload, bs, qd, args):
    """spdk_nvme_perf's `Total` line: IOPS and mean latency (us)."""
    trid = f"trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{NQN} ns:1"
    cmd = [os.path.join(SPDK, "bin", "spdk_nvme_perf"), "-c", "0x2", "-q", str(qd), "-o", str(bs), "-w", workload,
           "-t", str(args.duration), "-r", trid]
    out = subprocess.run(cmd, env=spdk_env(), capture_output=True, text=True, timeout=120)
    total = [line for line in out.stdout.splitlines() if line.strip().startswith("Total")]
    if out.returncode != 0 or not total:
        raise SystemExit(f"spdk_nvme_perf failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    fields = total[-1].split(":", 1)[1].split()
    return {"iops": float(fields[0]), "mean_us": float(fields[2]), "loaded_s": args.duration}


def nvpool_bench(port, workload, bs, qd, args, sq_flow_control=False, span=None):
    """`nvpool bench`; by default it disables SQ flow control, so both targets answer a
    read with one PDU. With it on (as the Linux host and spdk_nvme_perf keep it), nvpool
    sends the data and a response capsule, two PDUs, where SPDK still sends one. With
    `span` (e.g. "2MiB"), the I/O keeps to the namespace's first bytes."""
    cmd = [BIN, "bench", "--target", f"127.0.0.1:{port}", "--nqn", NQN, "--workload", workload, "--bs", str(bs),
           "--qd", str(qd), "--duration", str(args.duration), "--warmup", "1", "--core", "1", "--json"]
    cmd += ["--sq-flow-control"] if sq_flow_control else []
    cmd += ["--span", span] if span else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"nvpool bench failed: {' '.join(cmd)}\n{out.stderr}")
    r = json.loads(out.stdout)
    return {"iops": r["iops"], "mean_us": r["latency"]["mean_us"], "loaded_s": args.duration + 1}


def spread(values):
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=4)
    p.add_argument("--all", action="store_true", help="also 4 KiB random writes and 128 KiB reads")
    p.add_argument("--replot", action="store_true", help="only write spdk.md again from spdk.json")
    args = p.parse_args()
    if args.replot:
        saved = json.load(open(os.path.join(RESULTS, "spdk.json")))
        args.rounds, args.duration = saved["rounds"], saved["duration"]
        return report(saved["rows"], args, saved["machine"])
    if not os.path.exists(os.path.join(SPDK, "bin", "nvmf_tgt")):
        print("SPDK was not built: run scripts/build-spdk for the SPDK columns")
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: SPDK needs hugepages")
    own_network()
    configs = [("randread", 4096, qd) for qd in (1, 32, 128)]
    if args.all:
        configs += [("randwrite", 4096, qd) for qd in (1, 32, 128)] + [("read", 131072, qd) for qd in (1, 32)]
    clients = {"spdk_nvme_perf": spdk_perf, "nvpool bench": nvpool_bench,
               FLOW_CONTROL_ON: lambda *a: nvpool_bench(*a, sq_flow_control=True)}
    rows = []
    # SPDK's memory (-s 1024) and either target's 512 MiB namespace.
    with hugepages(1024):
        with tempfile.TemporaryDirectory() as work:
            targets = {}
            try:
                for kind in ("spdk", "nvpool", "responder"):
                    targets[kind] = Target(kind, work)
                    targets[kind].freeze()
                for workload, bs, qd in configs:
                    rows.append(measure(targets, clients, workload, bs, qd, args))
                    print(json.dumps(rows[-1]))
            finally:
                for target in targets.values():
                    target.stop()
    report(rows, args)


def measure(targets, clients, workload, bs, qd, args):
    """One workload: `args.rounds` rounds; in each, every client drives the targets one
    right after the other, the order alternating from pair to pair."""
    samples, cpu = {}, {}
    pair = 0
    for _ in range(args.rounds):
        for client, run in clients.items():
            # The responder is the floor only where it answers as both targets do: it
            # always ends a read with one PDU, as SPDK does but nvpool (keeping to the
            # spec) does not when the host keeps SQ flow control on.
            kinds = ["spdk", "nvpool"] + (["responder"] if client in FLOOR_CLIENTS else [])
            for kind in kinds if pair % 2 == 0 else reversed(kinds):
                target = targets[kind]
                target.thaw()
                try:
                    c0 = cpu_seconds(target.proc.pid)
                    r = run(target.port, workload, bs, qd, args)
                    used = cpu_seconds(target.proc.pid) - c0
                finally:
                    target.freeze()
                samples.setdefault((kind, client), []).append(r)
                # Per million I/Os, counting the client's warm-up.
                cpu.setdefault((kind, client), []).append(used / (r["iops"] * r["loaded_s"]) * 1e6)
            pair += 1
    row = {"workload": workload, "bs": bs, "qd": qd, "figures": {}, "cpu_s_per_million": {},
           "second_pdu": {}}
    for (kind, client), rs in samples.items():
        row["figures"][f"{kind} / {client}"] = {"iops": spread([r["iops"] for r in rs]),
                                                "mean_us": spread([r["mean_us"] for r in rs])}
        row["cpu_s_per_million"][f"{kind} / {client}"] = statistics.median(cpu[(kind, client)])
    # nvpool over SPDK pair by pair: the two ran one right after the other.
    row["ratios"] = {client: {
        "iops": spread([n["iops"] / p["iops"] for p, n in zip(samples[("spdk", client)], samples[("nvpool", client)])]),
        "mean_us": spread([n["mean_us"] / p["mean_us"] for p, n in zip(samples[("spdk", client)], samples[("nvpool", client)])]),
    } for client in clients}
    # Each target against the floor, within the same triple of runs: the share of the
    # responder's IOPS, and the mean latency added to the responder's.
    row["floor"] = {}
    for client in FLOOR_CLIENTS:
        floor = samples[("responder", client)]
        row["floor"][client] = {kind: {
            "iops_share": spread([t["iops"] / f["iops"] for t, f in zip(samples[(kind, client)], floor)]),
            "mean_us_added": spread([t["mean_us"] - f["mean_us"] for t, f in zip(samples[(kind, client)], floor)]),
            "mean_us_ratio": spread([t["mean_us"] / f["mean_us"] for t, f in zip(samples[(kind, client)], floor)]),
        } for kind in ("spdk", "nvpool")}
        # The floor over SPDK: the best ratios any target could show. A goal beyond
        # them asks for a target faster than one that does nothing.
        row["floor"][client]["latency_over_spdk"] = spread(
            [f["mean_us"] / t["mean_us"] for t, f in zip(samples[("spdk", client)], floor)])
        row["floor"][client]["iops_over_spdk"] = spread(
            [f["iops"] / t["iops"] for t, f in zip(samples[("spdk", client)], floor)])
    # What the response capsule after a read's data costs nvpool: the same
    # target instance, runs moments apart, taken round by round.
    one, two = samples[("nvpool", "nvpool bench")], samples[("nvpool", FLOW_CONTROL_ON)]
    c1, c2 = cpu[("nvpool", "nvpool bench")], cpu[("nvpool", FLOW_CONTROL_ON)]
    row["second_pdu"] = {
        "iops_ratio": spread([b["iops"] / a["iops"] for a, b in zip(one, two)]),
        "mean_us_added": spread([b["mean_us"] - a["mean_us"] for a, b in zip(one, two)]),
        "target_cpu_ratio": spread([b / a for a, b in zip(c1, c2)]),
    }
    return row


# Issue 22's goals, nvpool over SPDK: (client, IOPS at least this at QD32 and QD128,
# mean latency at most this at QD1).
GOALS = [("nvpool bench", 1.5, 0.8), ("spdk_nvme_perf", 1.1, 0.9)]


def goal_lines(rows):
    """The goals, each as its median per-pair ratio with the pairs' range; a goal is
    met when the median meets it, and the lead is clear when no pair crosses parity."""
    lines = ["| workload | client | measure | goal | nvpool / SPDK, per pair | met | lead clear of the spread | "
             "the floor: responder / SPDK |",
             "|---|---|---|---:|---:|---|---|---:|"]
    for r in rows:
        for client, iops_goal, latency_goal in GOALS:
            if "ratios" not in r:
                continue
            if r["qd"] == 1:
                measure, goal, x = "mean latency", latency_goal, r["ratios"][client]["mean_us"]
                floor = r["floor"][client]["latency_over_spdk"]
                met, clear = x["median"] <= goal, x["high"] < 1
                sign = "≤"
            else:
                measure, goal, x = "IOPS", iops_goal, r["ratios"][client]["iops"]
                floor = r["floor"][client]["iops_over_spdk"]
                met, clear = x["median"] >= goal, x["low"] > 1
                sign = "≥"
            lines.append(f"| {r['workload']} {r['bs'] // 1024}K QD{r['qd']} | {client} | {measure} | {sign} {goal}x | "
                         f"**{x['median']:.2f}x** [{x['low']:.2f}-{x['high']:.2f}] | {'yes' if met else 'no'} | "
                         f"{'yes' if clear else 'no'} | {floor['median']:.2f}x [{floor['low']:.2f}-{floor['high']:.2f}] |")
    return lines


def report(rows, args, m=None):
    m = m or machine()
    lines = [
        "# nvpool's engine and SPDK side by side", "",
        f"`bench/spdk.py`: revision {m['revision']}, {m['date']}, {m['cpu']} ({m['cpus']} CPUs), kernel "
        f"{m['kernel']}. Each target on CPU 0 with a 512 MiB RAM namespace (4 KiB blocks; SPDK frozen while "
        f"the other runs), the client on CPU 1; {args.rounds} rounds of {args.duration} s, each run on one target "
        "followed at once by the same run on the other, the order alternating. Medians, with the lowest and "
        "highest run in brackets. Ratios are nvpool over SPDK (IOPS: above 1 is better; latency: below 1 is "
        "better); the goals table takes them pair by pair.", "",
        "| workload | client | SPDK IOPS | nvpool IOPS | IOPS ratio | SPDK mean us | nvpool mean us | latency ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda s, d=0: f"{s['median']:,.{d}f} [{s['low']:,.{d}f}-{s['high']:,.{d}f}]"
    for r in rows:
        for client in ("spdk_nvme_perf", "nvpool bench", FLOW_CONTROL_ON):
            s, n = r["figures"][f"spdk / {client}"], r["figures"][f"nvpool / {client}"]
            lines.append(
                f"| {r['workload']} {r['bs'] // 1024}K QD{r['qd']} | {client} | {fmt(s['iops'])} | {fmt(n['iops'])} | "
                f"**{n['iops']['median'] / s['iops']['median']:.2f}x** | {fmt(s['mean_us'], 1)} | "
                f"{fmt(n['mean_us'], 1)} | **{n['mean_us']['median'] / s['mean_us']['median']:.2f}x** |")
    lines += ["", "The goals (issue 22), as ratios taken pair by pair:", ""] + goal_lines(rows)
    lines += ["", "Against the floor: the protocol-minimal responder (`nvpool responder`: no backend, read data "
              "from one zeroed buffer, nothing checked that need not be), driven by the same client in the same "
              "rounds. Each target's share of the responder's IOPS and the mean latency it adds to the "
              "responder's, run by run. The goals table above gives the responder's own ratios to SPDK: a goal "
              "beyond them asks for a target faster than one that does nothing.", "",
              "| workload | client | responder IOPS | responder mean us | SPDK share | "
              "nvpool share | SPDK adds us | nvpool adds us |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for client in FLOOR_CLIENTS:
            f, fl = r["figures"][f"responder / {client}"], r["floor"][client]
            lines.append(f"| {r['workload']} {r['bs'] // 1024}K QD{r['qd']} | {client} | {fmt(f['iops'])} | "
                         f"{fmt(f['mean_us'], 1)} | "
                         f"{fmt(fl['spdk']['iops_share'], 2)} | {fmt(fl['nvpool']['iops_share'], 2)} | "
                         f"{fmt(fl['spdk']['mean_us_added'], 1)} | {fmt(fl['nvpool']['mean_us_added'], 1)} |")
    lines += ["", "CPU time per million I/Os (target process, median over its runs), under each client:", "",
              "| workload | client | SPDK s | nvpool s |", "|---|---|---:|---:|"]
    for r in rows:
        c = r["cpu_s_per_million"]
        for client in ("spdk_nvme_perf", "nvpool bench", FLOW_CONTROL_ON):
            lines.append(f"| {r['workload']} {r['bs'] // 1024}K QD{r['qd']} | {client} | "
                         f"{c[f'spdk / {client}']:.2f} | {c[f'nvpool / {client}']:.2f} |")
    lines += ["", "The second PDU: nvpool's engine under `nvpool bench` with SQ flow control on (a read is "
              "answered with C2HData and a response capsule) over off (C2HData with SUCCESS alone); per-round "
              "ratios, medians [lowest-highest]. Writes have a response capsule either way.", "",
              "| workload | IOPS ratio | mean latency added us | target CPU per I/O ratio |", "|---|---:|---:|---:|"]
    for r in rows:
        d = r["second_pdu"]
        lines.append(f"| {r['workload']} {r['bs'] // 1024}K QD{r['qd']} | {fmt(d['iops_ratio'], 2)} | "
                     f"{fmt(d['mean_us_added'], 1)} | {fmt(d['target_cpu_ratio'], 2)} |")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "spdk.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, "spdk.json"), "w") as f:
        json.dump({"machine": m, "rounds": args.rounds, "duration": args.duration, "rows": rows}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
