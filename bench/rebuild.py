#!/usr/bin/env python3
"""What a rebuild costs the host, and how fast it goes: a 2-replica volume (the
serving engine's pool volume and another engine's replica, over NVMe/TCP) written at
4 KiB QD32 while the other replica is rebuilt in full, side by side in one run with
the same writes while both replicas are in sync (the same two copies of every write,
no rebuild).

    bench/rebuild.py [--rounds 3] [--duration 4] [--size 1GiB] [--out bench/results/rebuild.md]

Each round measures the host's IOPS with both replicas in sync, then rebuilds the
replica at the default rate (the controller's --rebuild-rate, 100 MiB/s) and without
a limit, measuring the host's IOPS while each runs and the rebuild's own speed
(bytes copied over the time it took). Both engines have one reactor on --target-core;
`nvpool bench` runs on --bench-core; the pools are files in --dir (default /dev/shm,
so that the figures are the engines' and not a disk's). Figures are medians over
rounds. The goal: the host keeps at least 80% of its IOPS during a rebuild at the
default rate. Timings are reported, never asserted. Standard library only.
"""
import argparse, os, signal, statistics, tempfile, threading, time

from suite import NQN, bench, cli, engine_json, own_network, start_engine

DEFAULT_RATE = 100 << 20


def parse_size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[:-len(u)]) * m)
    return int(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--size", default="1GiB", help="the volume's size (a full rebuild copies all of it)")
    ap.add_argument("--dir", default=os.environ.get("NVPOOL_BENCH_DIR", "/dev/shm"), help="where the pools go")
    ap.add_argument("--target-core", type=int, default=0, help="both engines' core")
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--busy-poll-us", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    size = parse_size(args.size)
    own_network()
    tmp = tempfile.mkdtemp(prefix="nvpool-rebuild-")
    data_dir = tempfile.mkdtemp(prefix="nvpool-rebuild-", dir=args.dir)
    procs = []
    try:
        nodes = {}
        for name in ("serving", "replica"):
            # The engine starts with a placeholder namespace (its subsystem needs one),
            # which the replica takes the place of.
            proc, port, sock = start_engine(["null:1MiB"], args.target_core, tmp, args.busy_poll_us)
            procs.append(proc)
            cli(sock, "namespace", "remove", NQN, "1")
            disk = f"{data_dir}/{name}.img"
            with open(disk, "wb") as f:
                f.truncate(size + (size >> 2) + (64 << 20))
            cli(sock, "pool", "create", "p", disk)
            nodes[name] = (port, sock)
        (s_port, s_sock), (r_port, r_sock) = nodes["serving"], nodes["replica"]
        # The serving volume is thick: every cluster holds data, and a full rebuild
        # copies all of it.
        v = engine_json(s_sock, "volume", "create", "p", "v", str(size))
        cli(r_sock, "volume", "create", "p", "v", str(size), "--thin", "--uuid", v["uuid"], "--nguid", v["nguid"])
        cli(r_sock, "namespace", "add", NQN, "replica:p/v", "--nsid", "1")
        leg = f"remote:127.0.0.1:{r_port}/{NQN}/1"
        generation = [0]

        def serve(*legs):
            generation[0] += 1
            spec = " ".join([f"mirror:generation={generation[0]}", "volume:p/v", *legs])
            if generation[0] == 1:
                cli(s_sock, "namespace", "add", NQN, spec, "--nsid", "1")
            else:
                cli(s_sock, "namespace", "swap", NQN, "1", spec)

        def rebuild_under_writes(rate):
            """Rebuilds the replica in full at `rate` (None: no limit) while the host
            writes; returns the host's IOPS and the rebuild's bytes per second."""
            serve()
            argv = ["namespace", "rebuild", NQN, "1", leg] + (["--rate", str(rate)] if rate else [])
            started = time.time()
            cli(s_sock, *argv)
            result = {}
            writer = threading.Thread(target=lambda: result.update(bench(s_port, "randwrite", 4096, 32, args)))
            writer.start()
            while True:
                info = engine_json(s_sock, "namespace", "rebuilding", NQN, "1")
                if info["state"] != "copying":
                    break
                time.sleep(0.05)
            took = time.time() - started
            writer.join()
            if info["state"] != "done":
                raise SystemExit(f"the rebuild did not finish: {info}")
            # The replica is in sync again: a mirror where it is a full leg.
            serve(leg)
            return result["iops"], info["total_bytes"] / took, took, result["errors"]

        serve(leg)
        lines = ["| round | in sync: host IOPS | rebuild at 100 MiB/s: host IOPS (share) | its MiB/s | "
                 "rebuild, no limit: host IOPS (share) | its MiB/s |",
                 "|---:|---:|---:|---:|---:|---:|"]
        print("\n".join(lines), flush=True)
        rows = []
        for r in range(args.rounds):
            base = bench(s_port, "randwrite", 4096, 32, args)
            limited = rebuild_under_writes(DEFAULT_RATE)
            unlimited = rebuild_under_writes(None)
            errors = base["errors"] + limited[3] + unlimited[3]
            row = (base["iops"], limited[0], limited[1], unlimited[0], unlimited[1], errors)
            rows.append(row)
            line = (f"| {r + 1} | {row[0]:,.0f} | {row[1]:,.0f} ({row[1] / row[0]:.0%}) | {row[2] / 2**20:.0f} | "
                    f"{row[3]:,.0f} ({row[3] / row[0]:.0%}) | {row[4] / 2**20:.0f} |"
                    + (" (errors!)" if errors else ""))
            lines.append(line)
            print(line, flush=True)
        med = [statistics.median(r[i] for r in rows) for i in range(5)]
        line = (f"| median | {med[0]:,.0f} | {med[1]:,.0f} ({med[1] / med[0]:.0%}) | {med[2] / 2**20:.0f} | "
                f"{med[3]:,.0f} ({med[3] / med[0]:.0%}) | {med[4] / 2**20:.0f} |")
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
        header = (f"# Rebuilds: how fast, and what they cost the host\n\n"
                  f"`bench/rebuild.py --rounds {args.rounds} --duration {args.duration} --size {args.size}`: a "
                  f"2-replica volume (a thick pool volume on the serving engine, a thin one on the replica's; pools "
                  f"on {args.dir}); the host writes 4 KiB at QD32 with `nvpool bench` on core {args.bench_core}, both "
                  f"engines have one reactor on core {args.target_core} (busy polling {args.busy_poll_us} us). "
                  f"\"in sync\": both replicas take every write, no rebuild; then the replica is rebuilt in full "
                  f"while the host writes the same way. The goal: the host keeps at least 80% of its IOPS during a "
                  f"rebuild at the default rate (100 MiB/s).\n\n")
        with open(args.out, "w") as f:
            f.write(header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
