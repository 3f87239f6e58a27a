#!/usr/bin/env python3
"""What replicas cost the host: one namespace served from a file with 1, 2 and 3
replicas (`mirror:` legs: the file, then 1 or 2 other engines' namespaces over
NVMe/TCP), side by side in one run with the bare request/response loop of the same
sizes (one loopback round trip: what the machine allows).

    bench/replication.py [--rounds 3] [--duration 3] [--out bench/results/replication.md]

The serving engine's own replica is a file in --dir (default /dev/shm, so that the
figures are the engines' and not a disk's); the other replicas are memory namespaces
of engines of their own. Every engine has one reactor on --target-core; `nvpool bench`
runs on --bench-core. Each round measures the bare loop, then each replica count, in
turn; figures are medians over rounds. "added" is the p50 latency over the same
workload with one replica, taken within each round. The goal for QD1 writes with two
replicas is one replica + one loopback round trip (the bare loop's p50) + 10 us.
Timings are reported, never asserted. Standard library only.
"""
import argparse, os, signal, statistics, subprocess, tempfile

from suite import BIN, NQN, bench, free_port, own_network, start_engine, wait_port

WORKLOADS = [("randwrite", 4096, 1), ("randwrite", 4096, 32), ("randread", 4096, 1), ("randread", 4096, 32),
             ("write", 131072, 8)]
REPLICAS = (1, 2, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--dir", default=os.environ.get("NVPOOL_BENCH_DIR", "/dev/shm"),
                    help="where the serving engine's replica file goes")
    ap.add_argument("--target-core", type=int, default=0, help="every engine's core")
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--busy-poll-us", type=int, default=0,
                    help="the engines' polling (0, the default here: four engines share one core)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    own_network()
    tmp = tempfile.mkdtemp(prefix="nvpool-replication-")
    data_dir = tempfile.mkdtemp(prefix="nvpool-replication-", dir=args.dir)
    procs = []

    def engine(namespace):
        proc, port, _ = start_engine([namespace], args.target_core, tmp, args.busy_poll_us)
        procs.append(proc)
        return port

    others = [engine("memory:1GiB") for _ in range(2)]
    remote = [f"remote:127.0.0.1:{p}/{NQN}/1" for p in others]
    ports = {}
    for n in REPLICAS:
        legs = [f"file:{data_dir}/replica-{n}:1GiB"] + remote[:n - 1]
        ports[n] = engine("mirror:" + " ".join(legs))
    bare_port = free_port()
    procs.append(subprocess.Popen([BIN, "responder", "--listen", f"127.0.0.1:{bare_port}", "--core",
                                   str(args.target_core), "--bare"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL))
    wait_port(bare_port)
    lines = ["| workload | bare loop p50 us | " + " | ".join(f"{n} IOPS" for n in REPLICAS) + " | "
             + " | ".join(f"{n} p50 us" for n in REPLICAS) + " | added p50 us (2 / 3) | 2 vs goal |",
             "|---|---:|" + "---:|" * (2 * len(REPLICAS)) + "---:|---|"]
    print("\n".join(lines), flush=True)
    try:
        for (w, bs, qd) in WORKLOADS:
            rows = []
            for _ in range(args.rounds):
                bare = bench(bare_port, "randread", bs, qd, args, bare=True)
                runs = {n: bench(ports[n], w, bs, qd, args) for n in REPLICAS}
                row = {"bare": bare["latency"]["p50_us"], "errors": sum(r["errors"] for r in runs.values())}
                for n, r in runs.items():
                    row[f"iops{n}"] = r["iops"]
                    row[f"p50_{n}"] = r["latency"]["p50_us"]
                    row[f"added{n}"] = r["latency"]["p50_us"] - runs[1]["latency"]["p50_us"]
                rows.append(row)
            med = lambda k: statistics.median(r[k] for r in rows)
            goal = med("p50_1") + med("bare") + 10
            verdict = f"{'met' if med('p50_2') <= goal else 'missed'} ({goal:.1f})" if qd == 1 and "write" in w else "-"
            line = (f"| {w} {bs // 1024}K QD{qd} | {med('bare'):.1f} | "
                    + " | ".join(f"{med(f'iops{n}'):,.0f}" for n in REPLICAS) + " | "
                    + " | ".join(f"{med(f'p50_{n}'):.1f}" for n in REPLICAS)
                    + f" | {med('added2'):+.1f} / {med('added3'):+.1f} | {verdict} |")
            if any(r["errors"] for r in rows):
                line += " (errors!)"
            lines.append(line)
            print(line, flush=True)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(10)
        for f in os.listdir(data_dir):
            os.unlink(os.path.join(data_dir, f))
        os.rmdir(data_dir)
    if args.out:
        header = (f"# Replicas: what each one costs the host\n\n"
                  f"`bench/replication.py --rounds {args.rounds} --duration {args.duration}`: the serving engine's "
                  f"replica is a file on {args.dir}, the others are memory namespaces of their own engines; every "
                  f"engine has one reactor on core {args.target_core} (busy polling {args.busy_poll_us} us), "
                  f"`nvpool bench` is on core {args.bench_core}; medians of {args.rounds} rounds. The bare loop is "
                  f"one loopback request/response of the same size. The goal for QD1 writes with 2 replicas: "
                  f"1 replica + the bare loop + 10 us.\n\n")
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
