//! The load generator's memory of what every block should hold.
//!
//! # Concurrency: one request per block at a time
//!
//! A read racing a write to the same block has no single right answer (it
//! may see the old data, the new, or on a real device a mix), so the load
//! generator never lets them race: before it issues a request on block
//! `b` it **claims** `b` ([`Verifier::claim`], one compare-and-swap), and
//! the block stays claimed until the request's outcome is recorded
//! ([`Verifier::finish_write`], [`Verifier::finish_read`]), which releases
//! it. Connections, pollers and threads all claim through the same table,
//! so across the whole load generator at most one request per block is in
//! flight, and what a read returns must be exactly the last write that
//! completed. The claim is `Acquire`, the release `Release`, so the claim
//! holder sees the previous holder's record.
//!
//! # What a block holds
//!
//! Every write of block `b` carries a fresh **version** `v` (per block,
//! counting from 1; the zeroed device is version 0). Its data is a
//! pseudo-random stream seeded by (run seed, `b`, `v`), whose first 16
//! bytes are `b` and `v` themselves, so a mismatch can say what the block
//! returned instead ("a read of block 17 returned version 3 of block 17,
//! expected version 5"). The verifier keeps, per block, the version and a 64-bit checksum
//! of the data of the last write that **completed successfully**.
//!
//! # Failures
//!
//! A write that failed (an error reply, a failed or flushed transfer, a
//! connection that died) may have changed the block or not: the block
//! becomes **unknown**, reads of it are counted as unverifiable (not as
//! matches), until the next successful write makes it known again. A read
//! that failed verifies nothing. Failures are counted and reported, never
//! taken for success.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

/// At most this many mismatches are described in full.
const DESCRIBED: usize = 16;

/// Bytes of the header (block, version) at the start of written data.
pub const HEADER: usize = 16;

#[derive(Debug, Default)]
struct Block {
    busy: AtomicBool,
    /// The last version issued for this block (written only by the claim
    /// holder).
    issued: AtomicU64,
    /// The version of the last successful write (0: never written).
    version: AtomicU64,
    /// Checksum of that write's data.
    sum: AtomicU64,
    /// False after a failed write, until a successful one.
    known: AtomicBool,
}

/// Counters of the verifier (a snapshot).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyCounts {
    /// Writes whose completion was recorded as successful.
    pub writes_ok: u64,
    /// Writes that failed (their blocks became unknown).
    pub writes_failed: u64,
    /// Reads whose data matched the last completed write.
    pub reads_matched: u64,
    /// Reads whose data did not match: a data error.
    pub mismatches: u64,
    /// Successful reads of blocks left unknown by a failed write.
    pub reads_unverifiable: u64,
    /// Reads that failed (nothing verified).
    pub reads_failed: u64,
    /// Blocks never written (version 0) among the matched reads.
    pub matched_unwritten: u64,
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The data is the last completed write's (or zeros, never written).
    Matched,
    /// The data is not what was written.
    Mismatch(String),
    /// The block was left unknown by a failed write.
    Unverifiable,
    /// The read failed; nothing was checked.
    Failed,
}

/// Per-block expected contents and the counters of what was checked.
#[derive(Debug)]
pub struct Verifier {
    block_size: usize,
    seed: u64,
    zero_sum: u64,
    blocks: Vec<Block>,
    writes_ok: AtomicU64,
    writes_failed: AtomicU64,
    reads_matched: AtomicU64,
    mismatches: AtomicU64,
    reads_unverifiable: AtomicU64,
    reads_failed: AtomicU64,
    matched_unwritten: AtomicU64,
    described: Mutex<Vec<String>>,
}

/// splitmix64's finalizer: the pattern's seed mixer and the checksum's
/// final step.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A 64-bit checksum of `data` (length a multiple of 8 or not): four
/// lanes of 8-byte words, each keeping the sum of its words and the sum
/// of those running sums (Fletcher's construction, so a word's position
/// counts: moved, swapped or reordered words change it), hashed together
/// with the length. No multiply chain runs through the words: it goes at
/// a few bytes a cycle, and the load generator checks every block it
/// reads with it.
pub fn checksum(data: &[u8]) -> u64 {
    const LANES: usize = 4;
    let mut sum = [0u64; LANES];
    let mut runs = [0u64; LANES];
    let mut chunks = data.chunks_exact(8 * LANES);
    for c in &mut chunks {
        for (j, w) in c.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            sum[j] = sum[j].wrapping_add(u64::from_le_bytes(b) ^ GOLDEN);
            runs[j] = runs[j].wrapping_add(sum[j]);
        }
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ data.len() as u64;
    for j in 0..LANES {
        h = mix(h ^ sum[j]);
        h = mix(h ^ runs[j]);
    }
    for &b in chunks.remainder() {
        h = mix(h ^ u64::from(b));
    }
    h
}

impl Verifier {
    /// A verifier for `blocks` blocks of `block_size` bytes (at least
    /// [`HEADER`]), all zero at the start, with the pattern seed `seed`.
    pub fn new(blocks: u64, block_size: usize, seed: u64) -> Verifier {
        let zero_sum = checksum(&vec![0u8; block_size]);
        let blocks = (0..blocks)
            .map(|_| Block {
                sum: AtomicU64::new(zero_sum),
                known: AtomicBool::new(true),
                ..Block::default()
            })
            .collect();
        Verifier {
            block_size,
            seed,
            zero_sum,
            blocks,
            writes_ok: AtomicU64::new(0),
            writes_failed: AtomicU64::new(0),
            reads_matched: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
            reads_unverifiable: AtomicU64::new(0),
            reads_failed: AtomicU64::new(0),
            matched_unwritten: AtomicU64::new(0),
            described: Mutex::new(Vec::new()),
        }
    }

    /// Blocks tracked.
    pub fn blocks(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// The block size.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Claims `block` for one request; false when another request holds
    /// it (or it does not exist). A claim is released by `finish_*`.
    pub fn claim(&self, block: u64) -> bool {
        self.blocks.get(block as usize).is_some_and(|b| {
            b.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        })
    }

    /// Whether `block` is claimed now.
    pub fn is_claimed(&self, block: u64) -> bool {
        self.blocks
            .get(block as usize)
            .is_some_and(|b| b.busy.load(Ordering::Acquire))
    }

    /// For a claimed `block`: the next version, with its data written
    /// into `buf` (`block_size` bytes); returns (version, checksum).
    pub fn prepare_write(&self, block: u64, buf: &mut [u8]) -> (u64, u64) {
        let version = match self.blocks.get(block as usize) {
            Some(b) => {
                let v = b.issued.load(Ordering::Relaxed) + 1;
                b.issued.store(v, Ordering::Relaxed);
                v
            }
            None => 0,
        };
        self.pattern(block, version, buf);
        (version, checksum(buf))
    }

    /// The data of write `version` of `block`: a pseudo-random stream
    /// whose word `i` depends on the seed, `block`, `version` and `i` only
    /// (so it is made at a few bytes a cycle), its first [`HEADER`] bytes
    /// `block` and `version`.
    pub fn pattern(&self, block: u64, version: u64, buf: &mut [u8]) {
        let base = self.seed ^ mix(block) ^ mix(version.rotate_left(17));
        // Word i: a 32 × 32-bit product of the base's halves, each stepped
        // by i (no chain from word to word), with the base over it.
        let (lo, hi) = (base as u32, (base >> 32) as u32);
        let word = |i: usize| {
            let i = i as u32;
            let a = lo.wrapping_add(i.wrapping_mul(0x9e37_79b9));
            let b = hi ^ i.wrapping_mul(0x85eb_ca6b);
            (u64::from(a) * u64::from(b)) ^ base
        };
        let mut chunks = buf.chunks_exact_mut(8);
        let mut n = 0;
        for (i, chunk) in (&mut chunks).enumerate() {
            chunk.copy_from_slice(&word(i).to_le_bytes());
            n = i + 1;
        }
        let rest = chunks.into_remainder();
        let tail = word(n).to_le_bytes();
        let k = rest.len();
        rest.copy_from_slice(&tail[..k]);
        if buf.len() >= HEADER {
            buf[0..8].copy_from_slice(&block.to_le_bytes());
            buf[8..16].copy_from_slice(&version.to_le_bytes());
        }
    }

    /// The poison of `block` (see [`Verifier::poisoned`]): what a read's
    /// buffer holds before the read, so that a read whose data never
    /// arrives cannot match. Every 16 bytes are `block` and `u64::MAX`, a
    /// version no write has; a plain fill, as cheap as a `memset`.
    pub fn poison(&self, block: u64, buf: &mut [u8]) {
        let mut word = [0u8; HEADER];
        word[0..8].copy_from_slice(&block.to_le_bytes());
        word[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut chunks = buf.chunks_exact_mut(HEADER);
        for c in &mut chunks {
            c.copy_from_slice(&word);
        }
        let rest = chunks.into_remainder();
        let n = rest.len();
        rest.copy_from_slice(&word[..n]);
    }

    /// True if `data` is `block`'s poison (the read delivered nothing).
    pub fn poisoned(&self, block: u64, data: &[u8]) -> bool {
        let mut p = vec![0u8; data.len()];
        self.poison(block, &mut p);
        p == data
    }

    /// Records the outcome of a write of a claimed block and releases it.
    pub fn finish_write(&self, block: u64, version: u64, sum: u64, ok: bool) {
        let Some(b) = self.blocks.get(block as usize) else {
            return;
        };
        if ok {
            b.version.store(version, Ordering::Relaxed);
            b.sum.store(sum, Ordering::Relaxed);
            b.known.store(true, Ordering::Relaxed);
            self.writes_ok.fetch_add(1, Ordering::Relaxed);
        } else {
            b.known.store(false, Ordering::Relaxed);
            self.writes_failed.fetch_add(1, Ordering::Relaxed);
        }
        b.busy.store(false, Ordering::Release);
    }

    /// Checks what a read of a claimed block returned (`None`: the read
    /// failed) and releases the block.
    pub fn finish_read(&self, block: u64, data: Option<&[u8]>) -> ReadOutcome {
        let Some(b) = self.blocks.get(block as usize) else {
            return ReadOutcome::Failed;
        };
        let outcome = match data {
            None => {
                self.reads_failed.fetch_add(1, Ordering::Relaxed);
                ReadOutcome::Failed
            }
            Some(_) if !b.known.load(Ordering::Relaxed) => {
                self.reads_unverifiable.fetch_add(1, Ordering::Relaxed);
                ReadOutcome::Unverifiable
            }
            Some(data) => {
                let version = b.version.load(Ordering::Relaxed);
                let want = b.sum.load(Ordering::Relaxed);
                if data.len() == self.block_size && checksum(data) == want {
                    self.reads_matched.fetch_add(1, Ordering::Relaxed);
                    if version == 0 {
                        self.matched_unwritten.fetch_add(1, Ordering::Relaxed);
                    }
                    ReadOutcome::Matched
                } else {
                    let what = self.describe(block, version, data);
                    self.mismatches.fetch_add(1, Ordering::Relaxed);
                    let mut d = self.described.lock();
                    if d.len() < DESCRIBED {
                        d.push(what.clone());
                    }
                    tracing::error!(block, "{what}");
                    ReadOutcome::Mismatch(what)
                }
            }
        };
        b.busy.store(false, Ordering::Release);
        outcome
    }

    /// What a mismatching read returned, in words.
    fn describe(&self, block: u64, version: u64, data: &[u8]) -> String {
        let want = if version == 0 {
            "zeros (never written)".to_string()
        } else {
            format!("version {version}")
        };
        if data.len() != self.block_size {
            return format!(
                "a read of block {block} returned {} bytes, expected {} ({want})",
                data.len(),
                self.block_size
            );
        }
        if checksum(data) == self.zero_sum {
            return format!("a read of block {block} returned zeros, expected {want}");
        }
        let mut h = [0u8; 8];
        h.copy_from_slice(&data[0..8]);
        let b = u64::from_le_bytes(h);
        h.copy_from_slice(&data[8..16]);
        let v = u64::from_le_bytes(h);
        if self.poisoned(block, data) {
            return format!(
                "a read of block {block} delivered no data (its buffer still holds the poison written before the read), expected {want}"
            );
        }
        let mut expect = vec![0u8; self.block_size];
        self.pattern(b, v, &mut expect);
        if expect == data {
            format!("a read of block {block} returned version {v} of block {b}, expected {want}")
        } else {
            format!("a read of block {block} returned data that no write produced (torn or corrupt), expected {want}")
        }
    }

    /// The counters now.
    pub fn counts(&self) -> VerifyCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        VerifyCounts {
            writes_ok: l(&self.writes_ok),
            writes_failed: l(&self.writes_failed),
            reads_matched: l(&self.reads_matched),
            mismatches: l(&self.mismatches),
            reads_unverifiable: l(&self.reads_unverifiable),
            reads_failed: l(&self.reads_failed),
            matched_unwritten: l(&self.matched_unwritten),
        }
    }

    /// The first mismatches, described.
    pub fn mismatch_notes(&self) -> Vec<String> {
        self.described.lock().clone()
    }

    /// Blocks left unknown by a failed write (not rewritten since).
    pub fn unknown_blocks(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| !b.known.load(Ordering::Relaxed))
            .count() as u64
    }

    /// Blocks claimed now (requests in flight).
    pub fn claimed(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.busy.load(Ordering::Relaxed))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const BS: usize = 512;

    fn written(v: &Verifier, block: u64) -> (Vec<u8>, u64) {
        assert!(v.claim(block));
        let mut buf = vec![0u8; BS];
        let (version, sum) = v.prepare_write(block, &mut buf);
        v.finish_write(block, version, sum, true);
        (buf, version)
    }

    #[test]
    fn a_claim_is_exclusive_until_finished() {
        let v = Verifier::new(4, BS, 1);
        assert!(v.claim(2));
        assert!(!v.claim(2), "a second request on a claimed block");
        assert!(v.is_claimed(2));
        assert!(v.claim(3));
        assert_eq!(v.claimed(), 2);
        assert_eq!(v.finish_read(2, Some(&vec![0u8; BS])), ReadOutcome::Matched);
        assert!(v.claim(2));
        assert!(!v.claim(4), "no such block");
    }

    #[test]
    fn reads_match_the_last_completed_write_and_zeros_before_any() {
        let v = Verifier::new(8, BS, 7);
        assert!(v.claim(5));
        assert_eq!(v.finish_read(5, Some(&vec![0u8; BS])), ReadOutcome::Matched);
        let (first, v1) = written(&v, 5);
        let (second, v2) = written(&v, 5);
        assert_eq!((v1, v2), (1, 2));
        assert_ne!(first, second);
        assert!(v.claim(5));
        assert_eq!(v.finish_read(5, Some(&second)), ReadOutcome::Matched);
        let c = v.counts();
        assert_eq!(
            (c.writes_ok, c.reads_matched, c.matched_unwritten),
            (2, 2, 1)
        );
        assert_eq!(c.mismatches, 0);
    }

    #[test]
    fn stale_misdirected_and_corrupt_data_are_mismatches_that_say_what() {
        let v = Verifier::new(8, BS, 7);
        let (old, _) = written(&v, 1);
        let _ = written(&v, 1);
        let (other, _) = written(&v, 2);
        assert!(v.claim(1));
        match v.finish_read(1, Some(&old)) {
            ReadOutcome::Mismatch(m) => {
                assert!(
                    m.contains("returned version 1 of block 1, expected version 2"),
                    "{m}"
                )
            }
            o => panic!("stale data accepted: {o:?}"),
        }
        assert!(v.claim(1));
        match v.finish_read(1, Some(&other)) {
            ReadOutcome::Mismatch(m) => assert!(m.contains("of block 2"), "{m}"),
            o => panic!("another block's data accepted: {o:?}"),
        }
        let mut torn = old.clone();
        torn[BS / 2..].copy_from_slice(&other[BS / 2..]);
        assert!(v.claim(1));
        match v.finish_read(1, Some(&torn)) {
            ReadOutcome::Mismatch(m) => assert!(m.contains("torn or corrupt"), "{m}"),
            o => panic!("torn data accepted: {o:?}"),
        }
        assert!(v.claim(1));
        assert!(matches!(
            v.finish_read(1, Some(&vec![0u8; BS])),
            ReadOutcome::Mismatch(m) if m.contains("returned zeros")
        ));
        assert!(v.claim(1));
        assert!(matches!(
            v.finish_read(1, Some(&old[..100])),
            ReadOutcome::Mismatch(m) if m.contains("returned 100 bytes")
        ));
        assert_eq!(v.counts().mismatches, 5);
        assert_eq!(v.mismatch_notes().len(), 5);
    }

    #[test]
    fn a_failed_write_leaves_the_block_unknown_until_rewritten() {
        let v = Verifier::new(4, BS, 3);
        let (good, _) = written(&v, 0);
        assert!(v.claim(0));
        let mut buf = vec![0u8; BS];
        let (version, sum) = v.prepare_write(0, &mut buf);
        v.finish_write(0, version, sum, false);
        assert_eq!(v.unknown_blocks(), 1);
        // Either content is possible now: neither is a match, neither a
        // mismatch.
        for data in [&good, &buf] {
            assert!(v.claim(0));
            assert_eq!(v.finish_read(0, Some(data)), ReadOutcome::Unverifiable);
        }
        let (again, v3) = written(&v, 0);
        assert_eq!(v3, 3, "the failed write used version 2");
        assert_eq!(v.unknown_blocks(), 0);
        assert!(v.claim(0));
        assert_eq!(v.finish_read(0, Some(&again)), ReadOutcome::Matched);
        assert!(v.claim(0));
        assert_eq!(v.finish_read(0, None), ReadOutcome::Failed);
        let c = v.counts();
        assert_eq!(
            (
                c.writes_failed,
                c.reads_unverifiable,
                c.reads_failed,
                c.mismatches
            ),
            (1, 2, 1, 0)
        );
    }

    #[test]
    fn concurrent_claimers_never_share_a_block_and_every_read_matches() {
        // Four threads hammer eight blocks; each op on a block is
        // exclusive, so every read must see the last completed write.
        let v = Arc::new(Verifier::new(8, BS, 11));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let v = Arc::clone(&v);
                std::thread::spawn(move || {
                    let mut mine = std::collections::HashMap::new();
                    let mut buf = vec![0u8; BS];
                    let mut done = 0;
                    let mut x = t + 1;
                    while done < 5_000 {
                        x = mix(x);
                        let block = x % 8;
                        if !v.claim(block) {
                            continue;
                        }
                        if x & 1 == 0 {
                            let (version, sum) = v.prepare_write(block, &mut buf);
                            mine.insert(block, buf.clone());
                            v.finish_write(block, version, sum, true);
                        } else {
                            // The device: the data of the last write is the
                            // verifier's version, rebuilt from the pattern.
                            let version = v.blocks[block as usize].version.load(Ordering::Relaxed);
                            let mut data = vec![0u8; BS];
                            if version > 0 {
                                v.pattern(block, version, &mut data);
                            }
                            assert_eq!(v.finish_read(block, Some(&data)), ReadOutcome::Matched);
                        }
                        done += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let c = v.counts();
        assert_eq!(c.writes_ok + c.reads_matched, 20_000);
        assert_eq!(c.mismatches, 0);
        assert_eq!(v.claimed(), 0);
    }

    #[test]
    fn checksum_sees_order_and_length() {
        let a: Vec<u8> = (0..64).collect();
        let mut b = a.clone();
        b.swap(0, 8);
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&a[..63]), checksum(&a));
        assert_ne!(checksum(&[0u8; 8]), checksum(&[0u8; 16]));
    }
}
