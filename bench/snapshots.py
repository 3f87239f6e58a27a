#!/usr/bin/env python3
"""What a snapshot costs the writes after it: 4 KiB random writes on a pool volume with
no snapshot, right after a snapshot (nearly every write is the first to its 4 KiB
granule since the snapshot, so it takes the path that records the granule held), and
once every granule was written again (the layer holds the whole volume), side by side
in one run; how long the snapshot held the volume's I/O; and how fast a clone of the
whole volume inflates, beside a plain copy of as many bytes on the same file system
(read and write 1 MiB at a time, then fsync: what the machine allows a copy).

    bench/snapshots.py [--rounds 3] [--duration 1.0] [--out bench/results/snapshots.md]

One engine with one reactor on --target-core; `nvpool bench` on --bench-core; the pool
is a file in --dir (default /dev/shm, so that the figures are the engine's and not a
disk's). The volume is thick (1 GiB, every cluster allocated): the baseline is a plain
write to an allocated cluster. Each round takes a new snapshot before each "right
after" run, so those runs start with nothing held. The goal: the first 4 KiB write to
a shared cluster costs at most 1.5 times a plain thin write. Figures are medians over
rounds; timings are reported, never asserted. Standard library only.
"""
import argparse, os, signal, statistics, tempfile, time

from suite import NQN, bench, cli, engine_json, own_network, start_engine

SIZE = 1 << 30


def plain_copy(directory, size):
    """Seconds to copy `size` bytes from one file to another in `directory`, over bytes
    the destination already has (as the pool's clusters are: a first touch of memory
    costs this machine several times a copy)."""
    chunk = b"\xa5" * (1 << 20)
    src, dst = os.path.join(directory, "copy-src"), os.path.join(directory, "copy-dst")
    for path in (src, dst):
        with open(path, "wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
    began = time.monotonic()
    with open(src, "rb") as i, open(dst, "r+b") as o:
        while block := i.read(1 << 20):
            o.write(block)
        o.flush()
        os.fsync(o.fileno())
    took = time.monotonic() - began
    os.unlink(src)
    os.unlink(dst)
    return took


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=1.0,
                    help="seconds per run: short, so that writes right after a snapshot are mostly first ones")
    ap.add_argument("--warmup", type=float, default=0.0)
    ap.add_argument("--dir", default=os.environ.get("NVPOOL_BENCH_DIR", "/dev/shm"), help="where the pool goes")
    ap.add_argument("--target-core", type=int, default=0)
    ap.add_argument("--bench-core", type=int, default=1)
    ap.add_argument("--busy-poll-us", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args()
    own_network()
    tmp = tempfile.mkdtemp(prefix="nvpool-snapshots-")
    data_dir = tempfile.mkdtemp(prefix="nvpool-snapshots-", dir=args.dir)
    proc, port, sock = start_engine(["null:1MiB"], args.target_core, tmp, args.busy_poll_us)
    workloads = [("randwrite", 4096, 1), ("randwrite", 4096, 32)]
    rows = {w: {"plain": [], "after": [], "rewritten": []} for w in workloads}
    pauses = []
    inflations, copies = [], []
    try:
        cli(sock, "namespace", "remove", NQN, "1")
        disk = f"{data_dir}/pool.img"
        # Each layer a round writes may take the whole volume's size again.
        with open(disk, "wb") as f:
            f.truncate((len(workloads) + 3) * SIZE)
        cli(sock, "pool", "create", "p", disk)
        taken = 0
        for r in range(args.rounds):
            # A volume of its own per round, and its snapshots deleted after it.
            cli(sock, "volume", "create", "p", "v", str(SIZE))
            cli(sock, "namespace", "add", NQN, "volume:p/v", "--nsid", "1")
            snapshots = []
            for w in workloads:
                rows[w]["plain"].append(bench(port, *w, args))
            for w in workloads:
                taken += 1
                snap = engine_json(sock, "volume", "snapshot", "p", "v", f"s{r}-{taken}")
                pauses.append(snap["pause_us"])
                snapshots.append(f"s{r}-{taken}")
                rows[w]["after"].append(bench(port, *w, args))
            # Every granule written again: the layer holds the whole volume.
            fill = argparse.Namespace(**{**vars(args), "duration": 8.0})
            bench(port, "write", 131072, 32, fill)
            for w in workloads:
                rows[w]["rewritten"].append(bench(port, *w, args))
            # A clone of the whole volume (the layer holds all of it), inflated.
            engine_json(sock, "volume", "snapshot", "p", "v", f"full{r}")
            snapshots.append(f"full{r}")
            cli(sock, "volume", "clone", "p", f"full{r}", f"c{r}")
            began = time.monotonic()
            inflated = engine_json(sock, "volume", "inflate", "p", f"c{r}", "--wait")
            inflations.append(time.monotonic() - began)
            assert inflated["parent"] == "" and inflated["allocated_bytes"] == SIZE, inflated
            copies.append(plain_copy(data_dir, SIZE))
            cli(sock, "namespace", "remove", NQN, "1")
            for name in [f"c{r}", "v", *reversed(snapshots)]:
                cli(sock, "volume", "delete", "p", name)
        errors = sum(x["errors"] for w in workloads for k in rows[w] for x in rows[w][k])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
        for f in os.listdir(data_dir):
            os.unlink(os.path.join(data_dir, f))
        os.rmdir(data_dir)
    med = lambda runs, key: statistics.median(x[key] if key == "iops" else x["latency"]["p50_us"] for x in runs)
    lines = ["| workload | no snapshot: IOPS | p50 us | right after a snapshot: IOPS | p50 us | vs no snapshot "
             "(p50) | every granule rewritten: IOPS | p50 us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in workloads:
        p, a, rw = rows[w]["plain"], rows[w]["after"], rows[w]["rewritten"]
        lines.append(f"| {w[0]} {w[1] // 1024}K QD{w[2]} | {med(p, 'iops'):,.0f} | {med(p, 'p50'):.1f} | "
                     f"{med(a, 'iops'):,.0f} | {med(a, 'p50'):.1f} | {med(a, 'p50') / med(p, 'p50'):.2f}x | "
                     f"{med(rw, 'iops'):,.0f} | {med(rw, 'p50'):.1f} |")
    lines.append("")
    lines.append(f"Snapshot pause (the volume's exports holding new commands, a host connected and idle): "
                 f"median {statistics.median(pauses) / 1000:.2f} ms, longest {max(pauses) / 1000:.2f} ms over "
                 f"{len(pauses)} snapshots. I/O errors: {errors}.")
    lines.append("")
    rate = lambda secs: SIZE / statistics.median(secs) / (1 << 20)
    lines.append(f"Inflating a clone of the whole 1 GiB volume: {rate(inflations):,.0f} MiB/s (median of "
                 f"{len(inflations)}, `volume inflate --wait`, writes at rest); a plain copy of 1 GiB over an "
                 f"existing file on the same file system: {rate(copies):,.0f} MiB/s "
                 f"({rate(inflations) / rate(copies):.2f} of it).")
    table = "\n".join(lines)
    print(table)
    if args.out:
        header = (f"# Snapshots: what the writes after one cost\n\n"
                  f"`bench/snapshots.py --rounds {args.rounds} --duration {args.duration}`: a thick 1 GiB pool volume "
                  f"(pool on {args.dir}), one engine with one reactor on core {args.target_core} (busy polling "
                  f"{args.busy_poll_us} us), `nvpool bench` on core {args.bench_core}; medians over rounds. \"Right "
                  f"after a snapshot\" runs start on a new snapshot each; \"rewritten\" runs follow 128 KiB writes "
                  f"over the whole volume. The goal: the first 4 KiB write over a snapshot costs at most 1.5x a "
                  f"plain write.\n\n")
        with open(args.out, "w") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
