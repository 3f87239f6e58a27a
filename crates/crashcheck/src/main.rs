//! crashcheck: the writer and the checker of a power-cut test (see the library).
//!
//! usage: crashcheck write DEVICE --tag T --block-size B --blocks N
//!                         [--flush-every K] [--fua-every M] [--seed S] [--first-generation G]
//!        crashcheck check DEVICE --tag T --block-size B --blocks N --log FILE...
//!                         [--expect-torn]
//!
//! `write` writes 1 to 8 blocks at a time at random within the first N blocks, one
//! write at a time, with O_DIRECT; every M-th write is a FUA write (O_DSYNC), and a
//! flush (fdatasync) follows every K-th; K or M of 0 means never. It logs every
//! completed write and flush on standard output and runs until it is killed. Writes
//! are numbered from G (default 1): a later run starts above an earlier one, so the
//! checker can take both logs at once.
//! `check` reads the N blocks and judges each against the logs' lines of tag T (one
//! log per run, each run ended by a power cut); it
//! fails on a torn, lost, stale or misplaced block, or with --expect-torn (a control
//! run on storage known to tear) when no block is torn.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::process::ExitCode;

use nvpool_crashcheck::{Event, Promises, Verdict, decode_block, fill_block, log_line, parse_line};

struct Args {
    command: String,
    device: String,
    tag: String,
    block_size: usize,
    blocks: u64,
    flush_every: u64,
    fua_every: u64,
    seed: u64,
    first_generation: u64,
    logs: Vec<String>,
    expect_torn: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("give a command: write or check")?;
    let device = it.next().ok_or("give a block device")?;
    let mut a = Args {
        command,
        device,
        tag: String::new(),
        block_size: 0,
        blocks: 0,
        flush_every: 20,
        fua_every: 7,
        seed: 1,
        first_generation: 1,
        logs: Vec::new(),
        expect_torn: false,
    };
    while let Some(flag) = it.next() {
        if flag == "--expect-torn" {
            a.expect_torn = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || value.parse::<u64>().map_err(|_| format!("{flag} takes a number, not {value:?}"));
        match flag.as_str() {
            "--tag" => a.tag = value.clone(),
            "--block-size" => a.block_size = number()? as usize,
            "--blocks" => a.blocks = number()?,
            "--flush-every" => a.flush_every = number()?,
            "--fua-every" => a.fua_every = number()?,
            "--seed" => a.seed = number()?,
            "--first-generation" => a.first_generation = number()?,
            "--log" => a.logs.push(value.clone()),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if a.tag.is_empty() || !a.block_size.is_power_of_two() || a.block_size < 512 || a.blocks == 0 {
        return Err("give --tag, --block-size (512, 4096, ...) and --blocks".into());
    }
    Ok(a)
}

/// A buffer of `len` bytes aligned for O_DIRECT, carved out of a larger vector.
fn aligned(storage: &mut Vec<u8>, len: usize) -> &mut [u8] {
    storage.resize(len + 4096, 0);
    let at = storage.as_ptr().align_offset(4096);
    &mut storage[at..at + len]
}

fn open(device: &str, extra_flags: i32) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | extra_flags)
        .open(device)
        .map_err(|e| format!("cannot open {device}: {e}"))
}

fn write(a: &Args) -> Result<(), String> {
    let plain = open(&a.device, 0)?;
    let fua = open(&a.device, libc::O_DSYNC)?;
    let mut storage = Vec::new();
    let mut x = a.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let out = std::io::stdout();
    let log = |e: &Event| {
        // One write(2) per line, so lines of writers sharing a console stay whole.
        let mut o = out.lock();
        let _ = o.write_all(format!("{}\n", log_line(&a.tag, e)).as_bytes());
        let _ = o.flush();
    };
    println!("crashcheck {} started: {} blocks of {} bytes on {}", a.tag, a.blocks, a.block_size, a.device);
    for generation in a.first_generation.. {
        let count = (1 + next() % 8).min(a.blocks);
        let lba = next() % (a.blocks - count + 1);
        let buf = aligned(&mut storage, count as usize * a.block_size);
        for (i, block) in buf.chunks_mut(a.block_size).enumerate() {
            fill_block(block, lba + i as u64, generation);
        }
        let is_fua = a.fua_every > 0 && generation % a.fua_every == 0;
        let file = if is_fua { &fua } else { &plain };
        file.write_all_at(buf, lba * a.block_size as u64)
            .map_err(|e| format!("write of {count} blocks at {lba} failed: {e}"))?;
        log(&Event::Write { lba, count: count as u32, generation, fua: is_fua });
        if a.flush_every > 0 && generation % a.flush_every == 0 {
            plain.sync_data().map_err(|e| format!("flush failed: {e}"))?;
            log(&Event::Flush { generation });
        }
    }
    Ok(())
}

fn check(a: &Args) -> Result<bool, String> {
    if a.logs.is_empty() {
        return Err("check needs --log FILE (once per run, oldest first)".into());
    }
    let mut runs = Vec::new();
    for path in &a.logs {
        let text = std::fs::read(path).map_err(|e| format!("cannot read the log {path}: {e}"))?;
        let text = String::from_utf8_lossy(&text);
        // Only whole lines: the last one may have been cut off with the power.
        let whole = text.rsplit_once('\n').map_or("", |(w, _)| w);
        runs.push(whole.lines().filter_map(|l| parse_line(&a.tag, l)).collect());
    }
    let promises = Promises::from_runs(runs);
    let device = open(&a.device, 0)?;
    let mut storage = Vec::new();
    let mut verdicts: BTreeMap<String, u64> = BTreeMap::new();
    let mut shown = 0;
    const CHUNK: u64 = 256;
    for first in (0..a.blocks).step_by(CHUNK as usize) {
        let n = CHUNK.min(a.blocks - first);
        let buf = aligned(&mut storage, n as usize * a.block_size);
        device
            .read_exact_at(buf, first * a.block_size as u64)
            .map_err(|e| format!("read of {n} blocks at {first} failed: {e}"))?;
        for (i, block) in buf.chunks(a.block_size).enumerate() {
            let lba = first + i as u64;
            let content = decode_block(block);
            let v = promises.judge(lba, content);
            *verdicts.entry(format!("{v:?}").to_lowercase()).or_default() += 1;
            if !matches!(v, Verdict::Good | Verdict::Unlogged) && shown < 10 {
                shown += 1;
                println!("crashcheck {} block {lba}: {v:?} ({content:?})", a.tag);
            }
        }
    }
    let count = |name: &str| verdicts.get(name).copied().unwrap_or(0);
    let summary: Vec<String> = verdicts.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "crashcheck {} checked {} blocks of {} bytes against {} logged writes ({} blocks durable): {}",
        a.tag,
        a.blocks,
        a.block_size,
        promises.writes(),
        promises.durable_blocks(),
        summary.join(" ")
    );
    let damaged = count("lost") + count("stale") + count("misplaced");
    Ok(if a.expect_torn { count("torn") > 0 } else { damaged + count("torn") == 0 })
}

fn main() -> ExitCode {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("crashcheck: {e}\n(see the usage at the top of crates/crashcheck/src/main.rs)");
            return ExitCode::from(2);
        }
    };
    let result = match a.command.as_str() {
        "write" => write(&a).map(|_| true),
        "check" => check(&a),
        other => Err(format!("unknown command {other:?}: use write or check")),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            println!("crashcheck {}: FAILED", a.tag);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("crashcheck {}: {e}", a.tag);
            ExitCode::from(2)
        }
    }
}
