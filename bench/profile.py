#!/usr/bin/env python3
"""Where each target's CPU goes, per I/O, over the floor: the protocol-minimal responder,
nvpool's engine and SPDK's nvmf_tgt under the same load.

For each workload, each target (set up as in `bench/spdk.py`: CPU 0, a 512 MiB RAM
namespace, one reactor; nvpool also with its I/O kept to 2 MiB and on a null namespace,
see PROFILED) is driven by `nvpool bench` on CPU 1 while `perf record` samples CPU 0
and `perf stat` counts its system calls, io_uring completions and packets sent. The flat profile (self time per symbol) is sorted into categories by symbol
name, and each category's share of CPU 0 is turned into microseconds per I/O with the
I/O count of the same run. A polling target's idle spinning shows up as "polling and
waiting": at depth both targets are saturated and it is small.

Needs `perf` (Debian's linux-perf) and SPDK (`scripts/build-spdk`); run as root.
Writes bench/results/profile.{md,json}. Standard library only.
"""
import argparse, json, os, re, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spdk import RESULTS, SPDK, Target, nvpool_bench  # noqa: E402
from suite import hugepages, machine, own_network  # noqa: E402

WORKLOADS = [("randread", 4096, 1), ("randread", 4096, 32), ("randread", 4096, 128), ("randwrite", 4096, 32),
             ("read", 131072, 1), ("read", 131072, 32)]

# Symbol patterns, first match wins. "copies" is every byte moved between buffers, the
# kernel's socket copies included; the rest of the kernel's TCP/IP work is "network stack".
CATEGORIES = [
    # nvpool's memory backend copies with `rep movsb` inlined in its `start`.
    ("data copies", re.compile(r"copy_(from|to)_iter|copy_user|rep_mov|memcpy|memmove|copy_in|copy_out|"
                               r"copy_page|clear_page|backend::memory::Memory")),
    # The engine spins in `Reactor::run`, SPDK in its pollers (at QD1, SPDK's epoll_wait
    # calls with no timeout are its polling too, counted under syscalls).
    ("polling and waiting", re.compile(r"(Reactor::run$|^thread_poll$|"
                                       r"^(cpuidle|default_idle|pv_native_safe_halt|io_cqring_wait|schedule|"
                                       r"__schedule|clock_gettime|__vdso|read_tsc|ktime_get|poll_idle|"
                                       r"spdk_thread_poll|_sock_group_poll|posix_sock_group_impl_poll|"
                                       r"epoll_wait|ep_poll|do_epoll_wait|spdk_sock_group_poll|reactor_run|"
                                       r"_reactor_run|nvmf_poll_group_poll|nvmf_tcp_poll_group_poll|"
                                       r"spdk_get_ticks|rte_get_tsc|.*saturating_duration_since|.*Timespec))")),
    ("io_uring / epoll / syscalls", re.compile(r"^(io_|__io_|__do_sys_io_uring|do_syscall|entry_SYSCALL|"
                                               r"syscall|__x64_sys|__sys_|ep_|epoll|fget|fput|__fget|"
                                               r"__check_object_size|__virt_addr_valid|check_heap_object|"
                                               r"import_iovec|iovec_from_user|__import_iovec|sock_recvmsg|"
                                               r"sock_sendmsg|____sys|___sys|security_|apparmor|"
                                               r"syscall_exit|exit_to_user|__rseq|rseq|fdget|"
                                               r"llist_|task_work|tctx_task_work)")),
    ("network stack", re.compile(r"(tcp|ip_|ipv4|inet|skb|sk_|sock|net_|__netif|netif|napi|dev_|__dev|"
                                 r"loopback|nf_|bbr|cubic|__alloc_skb|kfree_skb|kmem_cache|__kmalloc|kfree|"
                                 r"page_frag|alloc_pages|free_pages|__free|get_page_from_freelist|"
                                 r"_raw_spin|queued_spin|__pv_queued|release_sock|lock_sock|"
                                 r"__local_bh|do_softirq|handle_softirqs|irq_exit|rmqueue|__rmqueue|"
                                 r"mod_timer|__mod_timer|sk_reset_timer|csum|__build_skb|memcg|"
                                 r"refill_stock|obj_cgroup|mem_cgroup)")),
]


def category(symbol, kernel):
    for name, pattern in CATEGORIES:
        if pattern.search(symbol):
            return name
    return "other kernel" if kernel else "target's own code"


def flat_profile(data):
    """(share %, symbol, kernel?) for each symbol's self time in `data`."""
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "sym", "--stdio", "-g", "none",
                          "--percent-limit", "0"], capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+\[(.)\]\s+(.+?)\s*$", line)
        if m:
            rows.append((float(m.group(1)), m.group(3), m.group(2) == "k"))
    return rows


# What is profiled, each alone on CPU 0: (label, target kind, namespace, span the
# client keeps to). The responder is the floor; nvpool's engine serves the RAM namespace
# as `bench/spdk.py` measures it, the same namespace with the I/O kept to its first
# 2 MiB (its data then stays in the CPU's caches, as the responder's one buffer does),
# and a null namespace (read data from one zeroed buffer, as the responder's); SPDK is
# the peer. The span and null rows split what the engine adds over the floor into what
# touching a namespace larger than the caches costs and what the engine itself costs.
PROFILED = [("responder", "responder", None, None), ("nvpool", "nvpool", "memory:512MiB", None),
            ("nvpool, 2 MiB span", "nvpool", "memory:512MiB", "2MiB"), ("nvpool, null", "nvpool", "null:512MiB", None),
            ("SPDK", "spdk", None, None)]
# Counted on CPU 0 beside the samples, per I/O: system calls, io_uring completions, and
# packets handed to the loopback device (a 128 KiB C2HData leaves in several).
EVENTS = [("system calls", "raw_syscalls:sys_enter"), ("io_uring completions", "io_uring:io_uring_complete"),
          ("packets sent", "net:net_dev_xmit")]


def profile(target, workload, bs, qd, span, args, work):
    """Runs the client while perf samples CPU 0 and counts its events; returns the I/O
    figures, the flat profile and the event counts."""
    data = os.path.join(work, f"{target.kind}-{workload}-{bs}-{qd}.data")
    client = subprocess.Popen([sys.executable, "-c", (
        "import json, sys; sys.path.insert(0, %r); from spdk import nvpool_bench\n"
        "class A: duration = %d\n"
        "print(json.dumps(nvpool_bench(%d, %r, %d, %d, A, span=%r)))") % (
        os.path.dirname(os.path.abspath(__file__)), args.duration, target.port, workload, bs, qd, span)],
        stdout=subprocess.PIPE, text=True)
    # The client warms up for a second; sample the middle of the measured time.
    time.sleep(1.5)
    seconds = str(max(1, args.duration - 1))
    counting = subprocess.Popen(["perf", "stat", "-x", ",", "-C", "0", "-e", ",".join(e for _, e in EVENTS), "--",
                                 "sleep", seconds], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    subprocess.run(["perf", "record", "-q", "-F", "2999", "-C", "0", "-o", data, "--", "sleep", seconds],
                   capture_output=True, check=True)
    counts = {}
    for line in counting.communicate(timeout=60)[1].splitlines():
        fields = line.split(",")
        for name, event in EVENTS:
            if len(fields) > 2 and fields[2] == event and fields[0].isdigit():
                counts[name] = int(fields[0]) / float(seconds)
    result = json.loads(client.communicate(timeout=120)[0])
    return result, flat_profile(data), counts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="runs per target and workload; the fastest is kept")
    p.add_argument("--top", type=int, default=8, help="symbols listed per target and workload")
    p.add_argument("--workload", action="append", metavar="NAME:BS:QD", help="e.g. read:131072:32 (default: all)")
    args = p.parse_args()
    if not os.path.exists(os.path.join(SPDK, "bin", "nvmf_tgt")):
        print("SPDK was not built: run scripts/build-spdk first")
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: perf -C and SPDK's hugepages need it")
    workloads = [(w, int(bs), int(qd)) for w, bs, qd in (x.split(":") for x in args.workload)] \
        if args.workload else WORKLOADS
    own_network()
    rows = []
    with hugepages(1024), tempfile.TemporaryDirectory() as work:
        for workload, bs, qd in workloads:
            row = {"workload": workload, "bs": bs, "qd": qd, "targets": {}}
            best = {}
            # The machine has spells in which everything runs slower: each target is
            # profiled in every round, and its fastest run is kept.
            for _ in range(args.rounds):
                for label, kind, namespace, span in PROFILED:
                    target = Target(kind, work, namespace) if namespace else Target(kind, work)
                    try:
                        run = profile(target, workload, bs, qd, span, args, work)
                    finally:
                        target.stop()
                    if label not in best or run[0]["iops"] > best[label][0]["iops"]:
                        best[label] = run
            for label, (result, flat, counts) in best.items():
                # CPU 0 is the target's alone and, at depth, busy all the time; at QD1
                # the polling share says how much of it was spinning.
                us_per_io = 1e6 / result["iops"]
                by_category = {}
                for share, symbol, kernel in flat:
                    name = category(symbol, kernel)
                    by_category[name] = by_category.get(name, 0.0) + share
                row["targets"][label] = {
                    "iops": result["iops"], "mean_us": result["mean_us"], "cpu0_us_per_io": us_per_io,
                    "categories": {k: {"share": v, "us_per_io": v / 100 * us_per_io} for k, v in by_category.items()},
                    "per_io": {name: n / result["iops"] for name, n in counts.items()},
                    "top": [{"share": s, "symbol": sym} for s, sym, _ in flat[:args.top]],
                }
            rows.append(row)
            print(json.dumps(row)[:400], flush=True)
    report(rows, args)


def report(rows, args):
    m = machine()
    names = [c for c, _ in CATEGORIES] + ["other kernel", "target's own code"]
    labels = [label for label, *_ in PROFILED]
    lines = ["# Where the targets' CPU goes", "",
             f"`bench/profile.py`: revision {m['revision']}, {m['date']}, {m['cpu']} ({m['cpus']} CPUs), kernel "
             f"{m['kernel']}. Each target alone on CPU 0 (set up as in `bench/spdk.py`), `nvpool bench` on CPU 1, "
             f"`perf record -C 0` and `perf stat -C 0` over {max(1, args.duration - 1)} s of a {args.duration} s "
             "run. CPU 0's time per I/O (1 / IOPS: the target's core is busy all the time at depth, and spins at "
             "QD1) split by the self time of the symbols in each category. Profiled: the protocol-minimal "
             "responder (the floor: no backend, read data from one zeroed buffer that stays in the caches); "
             "nvpool's engine on the 512 MiB RAM namespace; the same with the client's I/O kept to its first "
             "2 MiB, whose data stays in the caches as the responder's buffer does; the engine on a null "
             "namespace (read data from one zeroed buffer, as the responder's); and SPDK. The last column is "
             f"nvpool's RAM namespace over the responder. The fastest of {args.rounds} runs per target, taken in "
             "turns: the shares are steady, the absolute figures move with the machine's spells (see `spdk.md` for "
             "medians).", ""]
    for r in rows:
        t = r["targets"]
        present = [label for label in labels if label in t]
        lines += [f"## {r['workload']} {r['bs'] // 1024}K QD{r['qd']}", "",
                  "| | " + " | ".join(present) + " | nvpool − responder |",
                  "|---|" + "---:|" * (len(present) + 1)]
        over = lambda f: f(t["nvpool"]) - f(t["responder"])
        lines.append("| IOPS | " + " | ".join(f"{t[x]['iops']:,.0f}" for x in present) + " | |")
        lines.append("| CPU 0 us per I/O | " + " | ".join(f"{t[x]['cpu0_us_per_io']:.2f}" for x in present) +
                     f" | **{over(lambda v: v['cpu0_us_per_io']):+.2f}** |")
        for name in names:
            us = lambda v: v["categories"].get(name, {"us_per_io": 0})["us_per_io"]
            lines.append(f"| {name}, us | " + " | ".join(f"{us(t[x]):.2f}" for x in present) +
                         f" | {over(us):+.2f} |")
        for name, _ in EVENTS:
            per = lambda v: v["per_io"].get(name, 0.0)
            lines.append(f"| {name} per I/O | " + " | ".join(f"{per(t[x]):.2f}" for x in present) +
                         f" | {over(per):+.2f} |")
        for label in present:
            top = ", ".join(f"`{x['symbol']}` {x['share']:.1f}%" for x in t[label]["top"])
            lines += ["", f"Top symbols, {label}: {top}."]
        lines.append("")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "profile.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(RESULTS, "profile.json"), "w") as f:
        json.dump({"machine": m, "rows": rows}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
