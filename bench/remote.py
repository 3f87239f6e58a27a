#!/usr/bin/env python3
"""The remote backend's cost: a host reaching a namespace through a proxy engine
(host -> proxy -> owner) against reaching the owner directly, side by side in one run.

    bench/remote.py [--rounds 3] [--duration 3] [--out bench/results/remote.md]

The owner serves a memory namespace; the proxy serves it as `remote:` (one reactor
each, both on --target-core; `nvpool bench` runs on --bench-core). Each round measures
the bare request/response loop of the same sizes (what the machine allows), the owner,
then the proxy; figures are medians over rounds. Added latency is the proxy's median
latency minus the owner's, taken within each round. CPU per I/O is each engine
process's CPU time over the I/Os of the run, polling included. Run as root, it moves
into a network namespace of its own, as the suite does. Timings are reported, never
asserted. Standard library only.
"""
import argparse, os, signal, statistics, subprocess, tempfile

from suite import BIN, NQN, bench, cpu_seconds, free_port, own_network, start_engine, wait_port

WORKLOADS = [("randread", 4096, 1), ("randwrite", 4096, 1), ("randread", 4096, 32), ("randwrite", 4096, 32),
             ("read", 131072, 8), ("write", 131072, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--target-core", type=int, default=0, help="the owner's core")
    ap.add_argument("--proxy-core", type=int, default=None, help="the proxy's core (default: the owner's)")
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--busy-poll-us", type=int, default=None,
                    help="the engines' polling (0: none, for fewer cores than busy threads)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    own_network()
    tmp = tempfile.mkdtemp(prefix="nvpool-remote-")
    proxy_core = args.target_core if args.proxy_core is None else args.proxy_core
    owner, owner_port, _ = start_engine(["memory:1GiB"], args.target_core, tmp, args.busy_poll_us)
    proxy, proxy_port, _ = start_engine([f"remote:127.0.0.1:{owner_port}/{NQN}/1"], proxy_core, tmp, args.busy_poll_us)
    bare_port = free_port()
    bare = subprocess.Popen([BIN, "responder", "--listen", f"127.0.0.1:{bare_port}", "--core", str(args.target_core),
                             "--bare"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(bare_port)
    lines = ["| workload | bare loop IOPS | owner IOPS | via proxy IOPS | proxy/owner | owner p50 us | proxy p50 us "
             "| added p50 us | owner CPU us/IO | proxy CPU us/IO |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    try:
        for (w, bs, qd) in WORKLOADS:
            rows = []
            for _ in range(args.rounds):
                bare_run = bench(bare_port, w, bs, qd, args, bare=True) if w in ("randread", "read") else None
                direct_cpu = cpu_seconds(owner.pid)
                direct = bench(owner_port, w, bs, qd, args)
                direct_cpu = cpu_seconds(owner.pid) - direct_cpu
                before = (cpu_seconds(owner.pid), cpu_seconds(proxy.pid))
                via = bench(proxy_port, w, bs, qd, args)
                after = (cpu_seconds(owner.pid), cpu_seconds(proxy.pid))
                # The runs' CPU over their I/Os, warm-up included on both sides of the ratio.
                total = lambda r: r["ios"] * (args.duration + args.warmup) / args.duration
                rows.append({
                    "bare": bare_run["iops"] if bare_run else None,
                    "owner": direct["iops"], "proxy": via["iops"],
                    "owner_p50": direct["latency"]["p50_us"], "proxy_p50": via["latency"]["p50_us"],
                    "added": via["latency"]["p50_us"] - direct["latency"]["p50_us"],
                    "owner_cpu": direct_cpu / total(direct) * 1e6,
                    "proxy_cpu": (after[1] - before[1]) / total(via) * 1e6,
                    "errors": direct["errors"] + via["errors"],
                })
            med = lambda k: statistics.median(r[k] for r in rows)
            bare_iops = f"{statistics.median(r['bare'] for r in rows):,.0f}" if rows[0]["bare"] else "-"
            line = (f"| {w} {bs // 1024}K QD{qd} | {bare_iops} | {med('owner'):,.0f} | {med('proxy'):,.0f} | "
                    f"{med('proxy') / med('owner'):.1%} | {med('owner_p50'):.1f} | {med('proxy_p50'):.1f} | "
                    f"{med('added'):+.1f} | {med('owner_cpu'):.2f} | {med('proxy_cpu'):.2f} |")
            if any(r["errors"] for r in rows):
                line += " (errors!)"
            lines.append(line)
            print(line, flush=True)
    finally:
        for p in (owner, proxy, bare):
            p.send_signal(signal.SIGINT)
            p.wait(10)
    if args.out:
        header = (f"# The remote backend: host -> proxy engine -> owner engine\n\n"
                  f"`bench/remote.py --rounds {args.rounds} --duration {args.duration}`: owner (memory:1GiB) on "
                  f"core {args.target_core}, proxy on core {proxy_core}, one reactor each, `nvpool bench` on core "
                  f"{args.bench_core}; busy polling {'default' if args.busy_poll_us is None else str(args.busy_poll_us) + ' us'}; "
                  f"medians of {args.rounds} rounds. The bare loop is the same message sizes with no protocol "
                  f"(reads only). CPU per I/O includes the reactors' polling.\n\n")
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
