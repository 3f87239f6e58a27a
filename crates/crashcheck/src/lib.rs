//! Crash-consistency checking for block devices, as a power-cut test needs it.
//!
//! The writer fills blocks that check themselves: each carries a magic, its own LBA,
//! the generation of the write that put it there, a filler derived from both, and a
//! CRC over all of it. A block made of pieces of two writes (torn) fails its CRC; a
//! block at the wrong place names another LBA.
//!
//! While it writes, the writer logs on its standard output what the device promised:
//! each completed write (and whether it was a FUA write, durable at once) and each
//! completed cache flush (every write completed before it is durable). Each line
//! carries its own CRC, so a line mangled on its way out (a console shared with the
//! kernel's messages) is dropped rather than misread: the log may promise less than
//! the device did, never more.
//!
//! After the cut, the checker reads every block and holds it against the log: a block
//! covered by a durable write must hold that write or a later one, never an older one
//! or nothing; no block may be torn or misplaced.

use std::collections::HashMap;

/// Marks a block the writer wrote.
pub const MAGIC: [u8; 8] = *b"NVPCRASH";
/// Bytes before the filler: magic, LBA, generation.
const HEADER: usize = 24;
/// The CRC at the end of a block.
const TRAILER: usize = 4;

/// Fills `block` as generation `generation` of block `lba`.
pub fn fill_block(block: &mut [u8], lba: u64, generation: u64) {
    let n = block.len();
    block[..8].copy_from_slice(&MAGIC);
    block[8..16].copy_from_slice(&lba.to_le_bytes());
    block[16..24].copy_from_slice(&generation.to_le_bytes());
    let mut x = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ generation) | 1;
    for chunk in block[HEADER..n - TRAILER].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let crc = crc32c::crc32c(&block[..n - TRAILER]);
    block[n - TRAILER..].copy_from_slice(&crc.to_le_bytes());
}

/// What a block read back holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Content {
    /// Zeroes: never written, or no write reached the medium.
    Zeroes,
    /// Whole: generation `generation` of block `lba`.
    Whole { lba: u64, generation: u64 },
    /// Neither: pieces of different writes, or damage.
    Torn,
}

/// Reads what a block holds.
pub fn decode_block(block: &[u8]) -> Content {
    if block.iter().all(|&b| b == 0) {
        return Content::Zeroes;
    }
    let n = block.len();
    let crc = u32::from_le_bytes(block[n - TRAILER..].try_into().expect("four bytes"));
    if block[..8] != MAGIC || crc32c::crc32c(&block[..n - TRAILER]) != crc {
        return Content::Torn;
    }
    let lba = u64::from_le_bytes(block[8..16].try_into().expect("eight bytes"));
    let generation = u64::from_le_bytes(block[16..24].try_into().expect("eight bytes"));
    Content::Whole { lba, generation }
}

/// One promise of the device, as logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A write of `count` blocks at `lba` completed; with `fua`, it is durable.
    Write { lba: u64, count: u32, generation: u64, fua: bool },
    /// A flush completed: every write up to `generation` is durable.
    Flush { generation: u64 },
}

/// The log line for an event: `crashcheck TAG EVENT... CRC`.
pub fn log_line(tag: &str, e: &Event) -> String {
    let body = match e {
        Event::Write { lba, count, generation, fua } => {
            format!("crashcheck {tag} W {lba} {count} {generation} {}", u8::from(*fua))
        }
        Event::Flush { generation } => format!("crashcheck {tag} F {generation}"),
    };
    format!("{body} {:08x}", crc32c::crc32c(body.as_bytes()))
}

/// Reads one log line of `tag`; anything else, or a line whose CRC does not match,
/// gives `None`.
pub fn parse_line(tag: &str, line: &str) -> Option<Event> {
    let line = line.trim_end();
    let (body, crc) = line.rsplit_once(' ')?;
    if u32::from_str_radix(crc, 16).ok()? != crc32c::crc32c(body.as_bytes()) {
        return None;
    }
    let words: Vec<&str> = body.split(' ').collect();
    match words.as_slice() {
        ["crashcheck", t, "W", lba, count, generation, fua] if *t == tag => Some(Event::Write {
            lba: lba.parse().ok()?,
            count: count.parse().ok()?,
            generation: generation.parse().ok()?,
            fua: *fua == "1",
        }),
        ["crashcheck", t, "F", generation] if *t == tag => Some(Event::Flush { generation: generation.parse().ok()? }),
        _ => None,
    }
}

/// What the log says each block must hold at least.
pub struct Promises {
    /// Per block: the newest durable generation.
    durable: HashMap<u64, u64>,
    /// Per logged write: the blocks it covered.
    writes: HashMap<u64, (u64, u32)>,
}

impl Promises {
    /// Works out the promises from the logs of runs, oldest first, each run ended by a
    /// power cut: a flush in one run makes durable only that run's writes.
    pub fn from_runs(runs: impl IntoIterator<Item = Vec<Event>>) -> Promises {
        let mut p = Promises { durable: HashMap::new(), writes: HashMap::new() };
        for run in runs {
            let mut unflushed: Vec<u64> = Vec::new();
            for e in run {
                match e {
                    Event::Write { lba, count, generation, fua } => {
                        p.writes.insert(generation, (lba, count));
                        if fua {
                            p.make_durable(generation);
                        } else {
                            unflushed.push(generation);
                        }
                    }
                    Event::Flush { generation } => {
                        for &g in unflushed.iter().filter(|&&g| g <= generation) {
                            p.make_durable(g);
                        }
                        unflushed.retain(|&g| g > generation);
                    }
                }
            }
        }
        p
    }

    fn make_durable(&mut self, generation: u64) {
        let (lba, count) = self.writes[&generation];
        for b in lba..lba + u64::from(count) {
            let d = self.durable.entry(b).or_insert(generation);
            *d = (*d).max(generation);
        }
    }

    /// Blocks with a durable write.
    pub fn durable_blocks(&self) -> usize {
        self.durable.len()
    }

    /// Writes logged.
    pub fn writes(&self) -> usize {
        self.writes.len()
    }

    /// Judges what block `lba` holds.
    pub fn judge(&self, lba: u64, content: Content) -> Verdict {
        let floor = self.durable.get(&lba).copied();
        match content {
            Content::Torn => Verdict::Torn,
            Content::Zeroes if floor.is_some() => Verdict::Lost,
            Content::Zeroes => Verdict::Good,
            Content::Whole { lba: at, .. } if at != lba => Verdict::Misplaced,
            Content::Whole { generation, .. } => {
                if floor.is_some_and(|f| generation < f) {
                    return Verdict::Stale;
                }
                match self.writes.get(&generation) {
                    Some(&(start, count)) if !(start..start + u64::from(count)).contains(&lba) => Verdict::Misplaced,
                    Some(_) => Verdict::Good,
                    // In flight at the cut, or its line was lost: newer than any
                    // promise, so nothing to hold it against.
                    None => Verdict::Unlogged,
                }
            }
        }
    }
}

/// How a block fared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// As the log allows.
    Good,
    /// Holds a write the log does not know (in flight at the cut, or its line lost).
    Unlogged,
    /// Made of pieces of different writes.
    Torn,
    /// Holds zeroes, though a write to it was durable.
    Lost,
    /// Holds a write older than one that was durable.
    Stale,
    /// Holds a write meant for another block.
    Misplaced,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_reads_back_whole_and_a_mix_of_two_is_torn() {
        for size in [512usize, 4096] {
            let (mut a, mut b) = (vec![0u8; size], vec![0u8; size]);
            fill_block(&mut a, 7, 1);
            fill_block(&mut b, 7, 2);
            assert_eq!(decode_block(&a), Content::Whole { lba: 7, generation: 1 });
            assert_eq!(decode_block(&vec![0u8; size]), Content::Zeroes);
            // Any sector of the other version, or a zeroed one, tears the block.
            for sector in 0..size / 512 {
                let mut mixed = a.clone();
                mixed[sector * 512..(sector + 1) * 512].copy_from_slice(&b[sector * 512..(sector + 1) * 512]);
                if size > 512 {
                    assert_eq!(decode_block(&mixed), Content::Torn, "sector {sector}");
                }
                let mut holed = a.clone();
                holed[sector * 512..(sector + 1) * 512].fill(0);
                if size > 512 {
                    assert_eq!(decode_block(&holed), Content::Torn, "sector {sector}");
                }
            }
        }
    }

    #[test]
    fn log_lines_round_trip_and_mangled_ones_are_dropped() {
        let e = Event::Write { lba: 12, count: 3, generation: 99, fua: true };
        let line = log_line("d0", &e);
        assert_eq!(parse_line("d0", &line), Some(e));
        assert_eq!(parse_line("d1", &line), None, "another writer's line");
        assert_eq!(parse_line("d0", &line.replace(" 99 ", " 9 ")), None, "a digit lost");
        assert_eq!(parse_line("d0", &line[..line.len() - 2]), None, "cut short");
        let f = Event::Flush { generation: 5 };
        assert_eq!(parse_line("d0", &format!("{}\r\n", log_line("d0", &f))), Some(f));
    }

    #[test]
    fn flushed_and_fua_writes_must_survive_and_others_may_not() {
        let p = Promises::from_runs([vec![
            Event::Write { lba: 0, count: 2, generation: 1, fua: false },
            Event::Flush { generation: 1 },
            Event::Write { lba: 1, count: 1, generation: 2, fua: false },
            Event::Write { lba: 4, count: 1, generation: 3, fua: true },
            Event::Write { lba: 5, count: 1, generation: 4, fua: false },
        ]]);
        assert_eq!(p.durable_blocks(), 3);
        let whole = |lba, generation| Content::Whole { lba, generation };
        assert_eq!(p.judge(0, whole(0, 1)), Verdict::Good);
        assert_eq!(p.judge(0, Content::Zeroes), Verdict::Lost);
        // Block 1: generation 1 is durable, 2 may or may not have landed.
        assert_eq!(p.judge(1, whole(1, 1)), Verdict::Good);
        assert_eq!(p.judge(1, whole(1, 2)), Verdict::Good);
        assert_eq!(p.judge(4, Content::Zeroes), Verdict::Lost, "a FUA write is durable at once");
        assert_eq!(p.judge(5, Content::Zeroes), Verdict::Good, "never flushed");
        assert_eq!(p.judge(5, whole(5, 4)), Verdict::Good);
        assert_eq!(p.judge(0, whole(1, 1)), Verdict::Misplaced);
        assert_eq!(p.judge(5, whole(5, 3)), Verdict::Misplaced, "generation 3 wrote block 4");
        assert_eq!(p.judge(6, whole(6, 50)), Verdict::Unlogged);
        assert_eq!(p.judge(3, Content::Torn), Verdict::Torn);
        let later = Promises::from_runs([vec![
            Event::Write { lba: 0, count: 1, generation: 1, fua: true },
            Event::Write { lba: 0, count: 1, generation: 2, fua: true },
        ]]);
        assert_eq!(later.judge(0, whole(0, 1)), Verdict::Stale);
        // A flush after a cut covers nothing written before the cut.
        let two_runs = Promises::from_runs([
            vec![Event::Write { lba: 0, count: 1, generation: 1, fua: false }],
            vec![Event::Write { lba: 1, count: 1, generation: 100, fua: false }, Event::Flush { generation: 100 }],
        ]);
        assert_eq!(two_runs.judge(0, Content::Zeroes), Verdict::Good);
        assert_eq!(two_runs.judge(1, Content::Zeroes), Verdict::Lost);
    }
}
