#!/usr/bin/env python3
"""Remote namespaces with their own queues to the owner against sharing one: a proxy
engine serves K namespaces of one owner subsystem (`remote_queues = "per-namespace"`:
K controllers on the owner, K queues per proxy reactor; `"per-owner"`: one of each),
side by side in one run with the host reaching the owner directly.

    bench/remote_queues.py [--namespaces 4] [--rounds 3] [--duration 3] [--out bench/results/remote-queues.md]

The owner serves K memory namespaces; two proxies serve them as `remote:`, one per
mode (one reactor each, all engines on --target-core). For each workload, K `nvpool
bench` processes (one per namespace, on --bench-core) run at once against the owner,
then each proxy. IOPS are summed over the K runs, latency is the median of their
p50s, CPU per I/O is each engine process's CPU time over all I/Os of the run (polling
included). The owner's connections from each proxy are counted through its
management API. Run as root, it moves into a network namespace of its own. Timings
are reported, never asserted. Standard library only.
"""
import argparse, json, os, signal, socket, statistics, subprocess, tempfile

from suite import BIN, NQN, cpu_seconds, own_network, start_engine

WORKLOADS = [("randread", 4096, 1), ("randwrite", 4096, 1), ("randread", 4096, 8), ("randwrite", 4096, 8)]


def connections(sock):
    """The engine's open NVMe/TCP connections, from its management API."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)
        s.sendall(b'{"method": "engine_info", "params": {}}\n')
        reply = b""
        while not reply.endswith(b"\n"):
            reply += s.recv(65536)
    return json.loads(reply)["result"]["connections"]


def bench_all(port, k, workload, bs, qd, args):
    """K generators at once, one per namespace; returns their JSON reports."""
    procs = []
    for nsid in range(1, k + 1):
        cmd = [BIN, "bench", "--target", f"127.0.0.1:{port}", "--nqn", NQN, "--nsid", str(nsid),
               "--workload", workload, "--bs", str(bs), "--qd", str(qd), "--duration", str(args.duration),
               "--warmup", str(args.warmup), "--core", str(args.bench_core), "--json"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"bench failed: {err}")
        reports.append(json.loads(out))
    return reports


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namespaces", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--target-core", type=int, default=0, help="the engines' core")
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--busy-poll-us", type=int, default=0,
                    help="the engines' polling (0: none, for fewer cores than busy threads)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    own_network()
    k = args.namespaces
    tmp = tempfile.mkdtemp(prefix="nvpool-remote-queues-")
    owner, owner_port, owner_sock = start_engine(["memory:256MiB"] * k, args.target_core, tmp, args.busy_poll_us)
    remote = [f"remote:127.0.0.1:{owner_port}/{NQN}/{n}" for n in range(1, k + 1)]
    proxies = {}
    for mode in ("per-namespace", "per-owner"):
        before = connections(owner_sock)
        proxies[mode] = start_engine(remote, args.target_core, tmp, args.busy_poll_us, mode)
        # One request per namespace opens the queues; count what the proxy keeps.
        bench_all(proxies[mode][1], k, "randread", 4096, 1, argparse.Namespace(
            duration=0.2, warmup=0.1, bench_core=args.bench_core))
        proxies[mode] += (connections(owner_sock) - before,)
    lines = [f"| workload ({k} namespaces) | owner IOPS | per-namespace IOPS | per-owner IOPS | owner p50 us "
             f"| per-namespace p50 us | per-owner p50 us | proxy CPU us/IO per-namespace | proxy CPU us/IO per-owner "
             f"| owner CPU us/IO via per-namespace | via per-owner |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    errors = 0
    try:
        for (w, bs, qd) in WORKLOADS:
            rows = []
            for _ in range(args.rounds):
                row = {}
                for name, port, pid in [("owner", owner_port, None)] + [
                        (m, proxies[m][1], proxies[m][0].pid) for m in proxies]:
                    cpu = (cpu_seconds(owner.pid), cpu_seconds(pid) if pid else 0.0)
                    reports = bench_all(port, k, w, bs, qd, args)
                    cpu = (cpu_seconds(owner.pid) - cpu[0], (cpu_seconds(pid) - cpu[1]) if pid else 0.0)
                    ios = sum(r["ios"] for r in reports) * (args.duration + args.warmup) / args.duration
                    errors += sum(r["errors"] for r in reports)
                    row[name] = {"iops": sum(r["iops"] for r in reports),
                                 "p50": statistics.median(r["latency"]["p50_us"] for r in reports),
                                 "proxy_cpu": cpu[1] / ios * 1e6, "owner_cpu": cpu[0] / ios * 1e6}
                rows.append(row)
            med = lambda who, key: statistics.median(r[who][key] for r in rows)
            line = (f"| {w} {bs // 1024}K QD{qd} each | {med('owner', 'iops'):,.0f} | "
                    f"{med('per-namespace', 'iops'):,.0f} | {med('per-owner', 'iops'):,.0f} | "
                    f"{med('owner', 'p50'):.1f} | {med('per-namespace', 'p50'):.1f} | {med('per-owner', 'p50'):.1f} | "
                    f"{med('per-namespace', 'proxy_cpu'):.2f} | {med('per-owner', 'proxy_cpu'):.2f} | "
                    f"{med('per-namespace', 'owner_cpu'):.2f} | {med('per-owner', 'owner_cpu'):.2f} |")
            lines.append(line)
            print(line, flush=True)
    finally:
        for p in [owner] + [proxies[m][0] for m in proxies]:
            p.send_signal(signal.SIGINT)
            p.wait(10)
    counts = (f"Connections the owner keeps for each proxy (one reactor): per-namespace "
              f"{proxies['per-namespace'][3]}, per-owner {proxies['per-owner'][3]} (an admin and an I/O queue "
              f"per controller). I/O errors: {errors}.")
    print(counts)
    if args.out:
        header = (f"# Remote namespaces: a queue set per namespace or one per owner subsystem\n\n"
                  f"`bench/remote_queues.py --namespaces {k} --rounds {args.rounds} --duration {args.duration}`: "
                  f"owner ({k} × memory:256MiB) and the two proxies on core {args.target_core}, one reactor each, "
                  f"busy polling {args.busy_poll_us} µs; {k} `nvpool bench` processes (one per namespace) on core "
                  f"{args.bench_core}; medians of {args.rounds} rounds.\n\n")
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n\n" + counts + "\n")


if __name__ == "__main__":
    main()
