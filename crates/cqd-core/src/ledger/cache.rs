//! The poller's side of the ledger: its table from (qp_num, side) to queue
//! account, and the accounting pass of each batch (step 2 of
//! `crate::account`).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use crate::account::{AtHead, CtxWord, Flags, QueueAccount, RetireHeld, SilentEntry};
use crate::completion::Completion;
use crate::ledger::WrLedger;
use crate::wr_id::{Side, WrId};

/// A multiply-rotate hash for the map's integer keys (SipHash would cost
/// more than the rest of a look-up).
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type KeyMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<KeyHasher>>;

fn cache_key(qp_num: u32, side: Side) -> u64 {
    u64::from(qp_num) << 1 | u64::from(side == Side::Recv)
}

/// Slots of the direct-mapped table at first, and at most.
const TABLE_MIN: usize = 64;
const TABLE_MAX: usize = 4096;

/// The poller's own table from (qp_num, side) to the queue's account,
/// filled from the CQ's [`WrLedger`] on a miss (a miss is remembered too,
/// so a queue nobody attached costs one look-up). Emptied whenever the
/// ledger's attachments change.
///
/// A completion's queue is found in a direct-mapped table indexed by its
/// key's low bits (QP numbers are handed out in sequence, so a CQ's queues
/// rarely share a slot); only a slot holding another key sends it to the
/// map. The table has at least twice as many slots as the cache has
/// queues, up to [`TABLE_MAX`].
pub(crate) struct AccountCache {
    epoch: u64,
    /// (qp_num, side) → index in `accounts`.
    map: KeyMap<u32>,
    /// The accounts `map` found (`None`: no queue attached under its key).
    accounts: Vec<Option<Arc<QueueAccount>>>,
    /// Slot `key & (len - 1)`: the last key looked up there and its index
    /// in `accounts` ([`DONE`] as the key of an empty slot).
    table: Vec<(u64, u32)>,
    /// Scratch: silently completed requests of the current batch (wr_id,
    /// context word).
    pub(crate) silent: Vec<SilentEntry>,
    /// The largest batch the poller polls (0: not known, for tests).
    batch: usize,
    /// The sum and the largest of the reserved depths of the send queues
    /// in `map`. One batch retires at most every outstanding request of the
    /// send queues it names, and names at most `batch` of them: `silent` is
    /// kept at least `min(sum, batch × deepest)` large, so that a CQ with
    /// many queues does not hold a scratch the size of all of them.
    send_depths: usize,
    deepest: usize,
    /// Scratch: closed accounts the batch drained, to detach.
    closed: Vec<(u32, Side, Arc<QueueAccount>)>,
    /// Scratch: each completion's account (its index in `accounts`) until
    /// it is retired; then [`DONE`] (also for a wr_id that is not cqd's,
    /// or a queue with no account), [`CLAIMED`] if it took its request's
    /// context word (then in `ctx` at the same index), or [`MISSED`].
    keys: Vec<u64>,
    /// Scratch: the context words the batch's claims took (R5 of
    /// `account::ring`), at their completions' indices.
    ctx: Vec<CtxWord>,
    /// The batch claimed a context word (dispatch looks at `keys` only
    /// then).
    any_ctx: bool,
    /// A completion of the batch matched no request in flight on its
    /// queue ([`MISSED`]; dispatch looks at `keys` then too).
    any_missed: bool,
    /// Scratch: the receive queues a batch consumed receives from (their
    /// QP, the last consumed wr_id), checked for running dry once the
    /// batch's handlers have reposted ([`check_dry`](Self::check_dry)).
    received: Vec<(u32, u64, Arc<QueueAccount>)>,
    /// Scratch: receive queues that were dry and held more than the
    /// low-water mark at a completion of the batch (see `Pass::retire`).
    undry: Vec<Arc<QueueAccount>>,
    /// The receive queues [`check_dry`](Self::check_dry) found newly dry:
    /// QP and the last wr_id consumed from it.
    pub(crate) dry: Vec<(u32, u64)>,
}

/// A completion of the batch that is already accounted (or not cqd's).
const DONE: u64 = u64::MAX;
/// A completion of the batch that retired its request and took its
/// context word (no account index reaches it: an index is 32 bits).
const CLAIMED: u64 = u64::MAX - 1;
/// A completion of an attached queue that retired nothing: no request in
/// flight there has its wr_id (the device wrote a completion twice, or
/// named one never posted there). Not delivered.
const MISSED: u64 = u64::MAX - 2;

impl Default for AccountCache {
    fn default() -> Self {
        AccountCache {
            epoch: 0,
            map: KeyMap::default(),
            accounts: Vec::new(),
            // No key is `DONE` (a key is 33 bits).
            table: vec![(DONE, 0); TABLE_MIN],
            silent: Vec::new(),
            batch: 0,
            send_depths: 0,
            deepest: 0,
            closed: Vec::new(),
            keys: Vec::new(),
            ctx: Vec::new(),
            any_ctx: false,
            any_missed: false,
            received: Vec::new(),
            undry: Vec::new(),
            dry: Vec::new(),
        }
    }
}

impl fmt::Debug for AccountCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccountCache")
            .field("queues", &self.map.len())
            .finish()
    }
}

impl AccountCache {
    /// A cache for a poller whose batches hold at most `batch`
    /// completions: the scratch a batch bounds (a key per completion, at
    /// most a receive queue per completion) is sized for the largest batch
    /// now, so that no batch in steady state grows it (a batch larger than
    /// every one before would otherwise allocate mid-run). `silent` is not
    /// bounded by the batch (one signaled send retires every unsignaled
    /// send before it): it is sized again each time the cache takes in a
    /// send queue, from its queues' reserved depths
    /// ([`QueueAccount::reserve`]; see `send_depths`), when the queue's
    /// first completion arrives, not in the middle of a run.
    pub(crate) fn new(batch: usize) -> Self {
        AccountCache {
            batch,
            silent: Vec::with_capacity(batch),
            keys: Vec::with_capacity(batch),
            ctx: vec![std::mem::MaybeUninit::uninit(); batch],
            received: Vec::with_capacity(batch),
            undry: Vec::with_capacity(batch),
            dry: Vec::with_capacity(batch),
            ..AccountCache::default()
        }
    }

    /// Step 2 of the module documentation for one batch: retires what each
    /// completion covers, gives the credits back (one subtraction for the
    /// batch: every account of a ledger takes its credits from the ledger's
    /// budget), and leaves the silently completed wr_ids in `self.silent`
    /// for the dispatcher.
    ///
    /// One pass, in batch order (a queue's completions come in its
    /// order, whatever other queues' come between): each completion's
    /// account is found in the table, and retired under the CQ's retiring
    /// lock, taken once for the batch. A miss reads the ledger's map,
    /// which is never read under a retiring lock (`WrLedger::open_queue`
    /// takes the retiring lock under the map's write lock): the lock is let
    /// go for it. The completions of queues with another retiring lock (an
    /// SRQ's) are retired after the pass, under that lock, taken once per
    /// run of them.
    pub(crate) fn account_batch(&mut self, ledger: &WrLedger, wcs: &[Completion], low_water: u32) {
        self.silent.clear();
        self.received.clear();
        self.any_ctx = false;
        self.any_missed = false;
        if self.ctx.len() < wcs.len() {
            self.ctx.resize(wcs.len(), std::mem::MaybeUninit::uninit());
        }
        let epoch = ledger.epoch();
        if epoch != self.epoch {
            self.map.clear();
            self.accounts.clear();
            self.table.clear();
            self.table.resize(TABLE_MIN, (DONE, 0));
            (self.send_depths, self.deepest) = (0, 0);
            self.epoch = epoch;
        }
        self.keys.clear();
        self.keys.resize(wcs.len(), DONE);
        let mut credits = 0;
        // The pass's scratch, borrowed beside `self.accounts` (an account
        // found there is borrowed while the pass writes the scratch).
        macro_rules! pass {
            () => {
                Pass {
                    silent: &mut self.silent,
                    keys: &mut self.keys,
                    ctx: &mut self.ctx,
                    any_ctx: &mut self.any_ctx,
                    any_missed: &mut self.any_missed,
                    received: &mut self.received,
                    undry: &mut self.undry,
                    closed: &mut self.closed,
                    low_water,
                    credits: &mut credits,
                }
            };
        }
        let mut others = false;
        let mut sent = false;
        let mut held: Option<RetireHeld<'_>> = None;
        for (i, wc) in wcs.iter().enumerate() {
            let Ok(id) = WrId::decode(wc.wr_id) else {
                continue;
            };
            let side = id.kind.side();
            sent |= side == Side::Send;
            let key = cache_key(wc.qp_num, side);
            let slot = self.table[key as usize & (self.table.len() - 1)];
            let index = if slot.0 == key {
                slot.1
            } else {
                held = None;
                self.find(ledger, key, wc.qp_num, side)
            };
            let Some(Some(account)) = self.accounts.get(index as usize) else {
                continue;
            };
            let held = match &mut held {
                Some(h) => h,
                None => held.insert(ledger.lock_retiring()),
            };
            let ok = wc.status.is_success();
            match account.retire_head(held, wc.wr_id, ok) {
                AtHead::OtherLock => {
                    others = true;
                    self.keys[i] = u64::from(index);
                    continue;
                }
                AtHead::Taken {
                    credit,
                    word,
                    left,
                    flags,
                } => {
                    credits += credit;
                    if let Some(w) = word {
                        self.ctx[i] = w;
                        self.any_ctx = true;
                        self.keys[i] = CLAIMED;
                    }
                    // A send queue, or a receive queue above the mark and
                    // not dry, that is not closed: nothing more to look at.
                    if !flags.closed
                        && (flags.in_order || left > u64::from(low_water) && !flags.dry)
                    {
                        continue;
                    }
                    let mut pass = pass!();
                    pass.after(wc, account, held, ok, Some(left), flags);
                    continue;
                }
                AtHead::Slow => {}
            }
            let mut pass = pass!();
            pass.retire(i, wc, account, held);
        }
        drop(held);
        // Posters waiting for room on a send queue (`account::room`,
        // poller steps 2-3: the heads are published).
        if sent {
            ledger.room_bell().after_retire();
        }
        // The rest, under their own locks (an SRQ's).
        if others {
            let mut held: Option<RetireHeld<'_>> = None;
            for (i, wc) in wcs.iter().enumerate() {
                let k = self.keys[i];
                let Some(Some(account)) = (k < MISSED)
                    .then(|| self.accounts.get(k as usize))
                    .flatten()
                else {
                    continue;
                };
                let held = match &mut held {
                    Some(h) if account.retires_under(h) => h,
                    _ => {
                        held = None;
                        held.insert(account.retire_lock().lock())
                    }
                };
                // (The SRQ's retirements take the general path: their
                // completions come out of order across its QPs.)
                let mut pass = pass!();
                pass.retire(i, wc, account, held);
            }
        }
        for account in self.undry.drain(..) {
            if !self.received.iter().any(|r| Arc::ptr_eq(&r.2, &account)) {
                account.went_dry(false);
            }
        }
        if let Some(b) = ledger.budget() {
            b.give_back(credits);
        }
        for (qp, side, account) in self.closed.drain(..) {
            ledger.detach(qp, side, &account);
        }
    }
}

/// The scratch of one accounting pass, borrowed from the cache beside its
/// accounts.
struct Pass<'s> {
    silent: &'s mut Vec<SilentEntry>,
    keys: &'s mut [u64],
    ctx: &'s mut [CtxWord],
    any_ctx: &'s mut bool,
    any_missed: &'s mut bool,
    received: &'s mut Vec<(u32, u64, Arc<QueueAccount>)>,
    undry: &'s mut Vec<Arc<QueueAccount>>,
    closed: &'s mut Vec<(u32, Side, Arc<QueueAccount>)>,
    low_water: u32,
    /// Credits retired, given back once the pass is over.
    credits: &'s mut u64,
}

impl Pass<'_> {
    /// Retires what completion `i` (`wc`) covers in `account`, whose
    /// retiring lock is `held`, by the general path (out of the common
    /// case of `QueueAccount::retire_head`), settles its key, and looks at
    /// the queue as it left it ([`after`](Self::after)).
    #[inline(never)]
    fn retire(
        &mut self,
        i: usize,
        wc: &Completion,
        account: &Arc<QueueAccount>,
        held: &mut RetireHeld<'_>,
    ) {
        let ok = wc.status.is_success();
        let mut got = None;
        // The requests the queue holds after this completion, at most
        // (unknown with a predecessor).
        let (c, found, left) = if account.has_prev() {
            let (c, found) = account.retire_chained(held, wc.wr_id, ok, self.silent, &mut got);
            (c, found, None)
        } else {
            let mut ring = account.retiring_under(held);
            let (c, found) = ring.retire(wc.wr_id, ok, self.silent, &mut got);
            (c, found, Some(ring.left()))
        };
        *self.credits += c;
        self.keys[i] = match got {
            Some(w) => {
                self.ctx[i] = w;
                *self.any_ctx = true;
                CLAIMED
            }
            None if found => DONE,
            None => {
                *self.any_missed = true;
                MISSED
            }
        };
        let flags = account.flags();
        self.after(wc, account, held, ok && found, left, flags);
    }

    /// What the pass looks at after retiring a completion (`wc`) of
    /// `account` (`consumed`: a success that retired its request; `left`:
    /// the requests the queue holds now, at most, if known; `flags`: the
    /// account's flags as the retirement found them).
    #[inline(never)]
    fn after(
        &mut self,
        wc: &Completion,
        account: &Arc<QueueAccount>,
        held: &mut RetireHeld<'_>,
        consumed: bool,
        left: Option<u64>,
        flags: Flags,
    ) {
        // A receive queue with more left than the low-water mark cannot be
        // dry after the handlers (reposts only add): only the others are
        // checked again after them, once per queue and batch, with its last
        // receive consumed. (What a queue holds only falls during the pass,
        // so its last completion decides: one that was dry and is above the
        // mark at some completion is noted, and found no longer dry after
        // the pass unless a later completion took it to the mark.)
        if consumed && !flags.in_order {
            match left {
                Some(left) if left > u64::from(self.low_water) => {
                    if flags.dry && !self.undry.iter().any(|u| Arc::ptr_eq(u, account)) {
                        self.undry.push(Arc::clone(account));
                    }
                }
                _ => match self
                    .received
                    .iter_mut()
                    .find(|r| r.0 == wc.qp_num && Arc::ptr_eq(&r.2, account))
                {
                    Some(r) => r.1 = wc.wr_id,
                    None => self
                        .received
                        .push((wc.qp_num, wc.wr_id, Arc::clone(account))),
                },
            }
        }
        // Drained and closed, seen under the retiring lock that `close`
        // sets the flag under (with the posting lock, so no post is in
        // flight then): requests posted after the last retirement here and
        // before the close keep the account attached.
        if flags.closed && !account.has_prev() && account.retiring_under(held).drained() {
            let side = account.queue().side();
            if !self
                .closed
                .iter()
                .any(|c| c.0 == wc.qp_num && c.1 == side && Arc::ptr_eq(&c.2, account))
            {
                self.closed.push((wc.qp_num, side, Arc::clone(account)));
            }
        }
    }
}

impl AccountCache {
    /// The context word the last batch's accounting took for completion
    /// `i` (R5 of `account::ring`: its claim owns it), if it took one. A
    /// completion that retired nothing (a stale or foreign wr_id, a
    /// request already taken) has none.
    #[inline(always)]
    pub(crate) fn ctx_of(&self, i: usize) -> Option<CtxWord> {
        (self.keys.get(i) == Some(&CLAIMED)).then(|| self.ctx[i])
    }

    /// True when the last batch's accounting took a context word.
    #[inline(always)]
    pub(crate) fn claimed_ctx(&self) -> bool {
        self.any_ctx
    }

    /// True when completion `i` of the last batch matched no request in
    /// flight on its attached queue ([`MISSED`]): it must not be delivered.
    #[inline(always)]
    pub(crate) fn missed(&self, i: usize) -> bool {
        self.keys.get(i) == Some(&MISSED)
    }

    /// True when the last batch had a completion that matched nothing.
    #[inline(always)]
    pub(crate) fn missed_any(&self) -> bool {
        self.any_missed
    }

    /// The index in `accounts` of the queue under `key`, looked up in the
    /// map, or in the ledger on a miss (and remembered, found or not), and
    /// put in the table's slot for it.
    #[inline(never)]
    fn find(&mut self, ledger: &WrLedger, key: u64, qp: u32, side: Side) -> u32 {
        if let Some(&index) = self.map.get(&key) {
            let slots = self.table.len();
            self.table[key as usize & (slots - 1)] = (key, index);
            return index;
        }
        let found = ledger.lookup(qp, side);
        if let (Some(a), Side::Send) = (&found, side) {
            let depth = a.depth() as usize;
            self.send_depths += depth;
            self.deepest = self.deepest.max(depth);
            let bound = self.send_depths.min(self.batch * self.deepest);
            self.silent.reserve(bound.saturating_sub(self.silent.len()));
        }
        let index = self.accounts.len() as u32;
        self.accounts.push(found);
        self.map.insert(key, index);
        if self.accounts.len() * 2 > self.table.len() && self.table.len() < TABLE_MAX {
            // Twice as many slots as queues: the table again, from the map.
            let slots = (self.table.len() * 2).min(TABLE_MAX);
            self.table.clear();
            self.table.resize(slots, (DONE, 0));
            for (&k, &i) in &self.map {
                self.table[k as usize & (slots - 1)] = (k, i);
            }
        }
        let slots = self.table.len();
        self.table[key as usize & (slots - 1)] = (key, index);
        index
    }

    /// After a batch's handlers ran (and reposted what they repost): each
    /// receive queue the batch consumed from that now holds `low_water`
    /// receives or fewer, and did not at the last check, goes into
    /// `self.dry`. A queue the peer empties while its handler reposts is
    /// never dry here; a handler that forgot to repost leaves it dry. Only
    /// successful receives count: a flush empties a queue on purpose.
    pub(crate) fn check_dry(&mut self, low_water: u32) {
        self.dry.clear();
        for (qp, wr_id, account) in self.received.drain(..) {
            if account.went_dry(account.ahead() <= u64::from(low_water)) {
                self.dry.push((qp, wr_id));
            }
        }
    }

    /// True when the last batch consumed receives (a dry check is due).
    #[inline]
    pub(crate) fn received_any(&self) -> bool {
        !self.received.is_empty()
    }
}

/// The wr_ids of silent entries (the tests' view of `silent`).
#[cfg(test)]
fn ids(silent: &[SilentEntry]) -> Vec<u64> {
    silent.iter().map(|s| s.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::account::{DrainMarker, Queue};
    use crate::budget::BudgetOptions;
    use crate::budget::CqBudget;
    use crate::wr_id::OpKind;
    use proptest::prelude::*;
    use std::time::Instant;

    /// Posts `ids` (wr_id, signaled) on `q` as the posting call does,
    /// taking a credit each if the CQ has credits.
    fn push(q: &QueueAccount, ids: &[(u64, bool)]) {
        let mut p = q.posting();
        p.take_credits(ids.len() as u32).unwrap();
        for &(id, signaled) in ids {
            p.write(id, Instant::now(), signaled);
        }
        p.publish();
        p.commit();
    }

    fn budget() -> CqBudget {
        let opts = BudgetOptions {
            admission: false,
            credits: Some(100),
        };
        CqBudget::new("cq", 100, opts)
    }

    #[test]
    fn send_queue_retires_in_order_receive_queue_by_id() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let sq = ledger.open_queue(1, Queue::Send);
        let rq = ledger.open_queue(1, Queue::Recv);
        // 10 and 11 are unsignaled sends.
        push(&sq, &[(10, false), (11, false), (12, true), (13, true)]);
        assert_eq!(b.credits_in_use(), 4);
        // The receive queue's post: the backend takes only the first two.
        let mut p = rq.posting();
        p.take_credits(4).unwrap();
        for id in [20, 21, 22, 23] {
            p.write(id, Instant::now(), true);
        }
        p.publish();
        let mut back = Vec::new();
        p.settle(2, |i, taken_back| back.push((i, taken_back)));
        assert_eq!(back, [(2, true), (3, true)]);
        assert_eq!(b.credits_in_use(), 6, "8 taken, 2 given back");
        let mut silent = Vec::new();
        let mut ring = sq.retiring();
        assert_eq!(ring.retire(12, true, &mut silent, &mut None), (3, true));
        assert_eq!(ids(&silent), [10, 11], "the unsignaled ones before it");
        assert_eq!(
            ring.retire(99, true, &mut silent, &mut None),
            (0, false),
            "not held"
        );
        ring.give_back(3);
        drop(ring);
        let mut ring = rq.retiring();
        assert_eq!(
            ring.retire(22, true, &mut silent, &mut None),
            (0, false),
            "not posted"
        );
        assert_eq!(ring.retire(21, true, &mut silent, &mut None), (1, true));
        assert_eq!(silent.len(), 2, "receives retire only themselves");
        drop(ring);
        assert_eq!((sq.outstanding(), rq.outstanding()), (1, 1));
        assert_eq!(
            b.credits_in_use(),
            3,
            "6 in use, 3 given back (21's not given back yet)"
        );
    }

    /// A cache made for batches of `n` takes a first batch of `n`
    /// completions, from a send and a receive queue, without growing its
    /// scratch: a steady state allocates nothing even when its largest
    /// batch comes late (a CI run once saw a batch of 24, larger than any
    /// of its warm-up, grow `keys` inside the allocation test's window).
    #[test]
    fn the_largest_batch_does_not_grow_the_scratch() {
        let n = 32;
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(1, Queue::Send);
        let rq = ledger.open_queue(1, Queue::Recv);
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let mut wcs = Vec::new();
        for t in 0..n / 2 {
            let s = key.wr_id(OpKind::Send, t as u32).unwrap();
            let r = key.wr_id(OpKind::Recv, t as u32).unwrap();
            push(&sq, &[(s, true)]);
            push(&rq, &[(r, true)]);
            wcs.push(Completion::success(r, crate::completion::Opcode::Recv, 1));
            wcs.push(Completion::success(s, crate::completion::Opcode::Send, 1));
        }
        let mut cache = AccountCache::new(n);
        let scratch = |c: &AccountCache| {
            (
                c.keys.as_ptr(),
                c.keys.capacity(),
                c.received.capacity(),
                c.silent.capacity(),
                c.dry.capacity(),
            )
        };
        let before = scratch(&cache);
        cache.account_batch(&ledger, &wcs, u32::MAX);
        cache.check_dry(u32::MAX);
        assert_eq!((sq.outstanding(), rq.outstanding()), (0, 0));
        assert_eq!(scratch(&cache), before, "the scratch grew");
    }

    /// One signaled send retires every unsignaled send before it, a run
    /// that may be far longer than a batch: the silent scratch is sized for
    /// the send queue's reserved depth when the queue's first completion
    /// arrives, so that a later long run grows nothing.
    #[test]
    fn a_long_unsignaled_run_does_not_grow_the_scratch() {
        let depth = 200;
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(1, Queue::Send);
        sq.reserve(depth);
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |t: u32| key.wr_id(OpKind::Send, t).unwrap();
        let send = |t: u32| Completion::success(id(t), crate::completion::Opcode::Send, 1);
        let mut cache = AccountCache::new(8);
        push(&sq, &[(id(0), true)]);
        cache.account_batch(&ledger, &[send(0)], u32::MAX);
        let sized = (cache.silent.as_ptr(), cache.silent.capacity());
        assert!(sized.1 >= depth as usize, "sized for {}", sized.1);
        let run: Vec<(u64, bool)> = (1..depth).map(|t| (id(t), t == depth - 1)).collect();
        push(&sq, &run);
        cache.account_batch(&ledger, &[send(depth - 1)], u32::MAX);
        assert_eq!(cache.silent.len(), depth as usize - 2);
        assert_eq!(sq.outstanding(), 0);
        assert_eq!(
            (cache.silent.as_ptr(), cache.silent.capacity()),
            sized,
            "the silent scratch grew"
        );
    }

    /// Batches that name more queues than the two the cache keeps at
    /// hand, in turns, with a queue nobody attached among them: each
    /// completion retires its own queue's entry, once. QP 0's send queue,
    /// whose key is 0, is among them.
    #[test]
    fn queues_taking_turns_past_the_recent_two_are_each_accounted() {
        let ledger = WrLedger::new();
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |t: u32| key.wr_id(OpKind::Send, t).unwrap();
        let sqs: Vec<_> = (0..3)
            .map(|qp| ledger.open_queue(qp, Queue::Send))
            .collect();
        let rounds = 4u32;
        for (qp, sq) in (0..3u32).zip(&sqs) {
            let ids: Vec<(u64, bool)> = (0..rounds).map(|r| (id(qp * 100 + r), true)).collect();
            push(sq, &ids);
        }
        let mut cache = AccountCache::default();
        let wc = |qp: u32, r: u32| {
            let t = if qp == 9 { 900 + r } else { qp * 100 + r };
            Completion::success(id(t), crate::completion::Opcode::Send, qp)
        };
        for r in 0..rounds {
            // Even rounds 0, 1, 9 (not attached), 2; odd rounds the other
            // way round: the cache's two are hit in either place, and
            // missed.
            let mut order = [0u32, 1, 9, 2];
            if r % 2 == 1 {
                order.reverse();
            }
            let wcs: Vec<Completion> = order.iter().map(|&qp| wc(qp, r)).collect();
            cache.account_batch(&ledger, &wcs, u32::MAX);
            for sq in &sqs {
                assert_eq!(sq.outstanding(), (rounds - r - 1) as usize);
            }
            // QP 9's queue is not attached: its completion is not
            // accounted, so it is not unmatched either.
            assert!(!cache.missed_any() && (0..4).all(|i| !cache.missed(i)));
        }
        // A completion naming an entry already retired retires nothing,
        // not even the one posted after it, and is marked unmatched (not
        // delivered); the later one's own completion retires it.
        push(&sqs[1], &[(id(1000), true)]);
        let again = Completion::success(id(101), crate::completion::Opcode::Send, 1);
        cache.account_batch(&ledger, &[again], u32::MAX);
        assert_eq!(sqs[1].outstanding(), 1);
        assert!(cache.missed_any() && cache.missed(0));
        let last = Completion::success(id(1000), crate::completion::Opcode::Send, 1);
        cache.account_batch(&ledger, &[last], u32::MAX);
        assert!(sqs.iter().all(|q| q.outstanding() == 0));
        assert!(!cache.missed_any() && !cache.missed(0));
    }

    /// A completion the device wrote twice, in the batch of the original
    /// and in a later one, on a send queue (behind an unsignaled send) and
    /// on a receive queue: the copy retires nothing, gives back no credit,
    /// runs nothing silently and is marked unmatched; the original is not.
    #[test]
    fn a_completion_written_twice_is_unmatched_the_second_time() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let sq = ledger.open_queue(1, Queue::Send);
        let rq = ledger.open_queue(1, Queue::Recv);
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let s = |t: u32| key.wr_id(OpKind::Send, t).unwrap();
        let r = |t: u32| key.wr_id(OpKind::Recv, t).unwrap();
        use crate::completion::Opcode;
        push(&sq, &[(s(1), false), (s(2), true), (s(3), true)]);
        push(&rq, &[(r(1), true), (r(2), true)]);
        let mut cache = AccountCache::new(8);
        // The same batch: send 2 (with 1 silently), its copy, receive 1,
        // its copy.
        let wcs = [
            Completion::success(s(2), Opcode::Send, 1),
            Completion::success(s(2), Opcode::Send, 1),
            Completion::success(r(1), Opcode::Recv, 1),
            Completion::success(r(1), Opcode::Recv, 1),
        ];
        cache.account_batch(&ledger, &wcs, u32::MAX);
        assert_eq!(
            ids(&cache.silent),
            [s(1)],
            "only the original ran one silently"
        );
        assert_eq!((sq.outstanding(), rq.outstanding()), (1, 1));
        assert_eq!(b.credits_in_use(), 2, "the copies gave back no credit");
        let marked: Vec<bool> = (0..4).map(|i| cache.missed(i)).collect();
        assert_eq!(marked, [false, true, false, true]);
        // A later batch: copies again, then the originals of what is left.
        let wcs = [
            Completion::success(s(2), Opcode::Send, 1),
            Completion::success(r(1), Opcode::Recv, 1),
            Completion::success(s(3), Opcode::Send, 1),
            Completion::success(r(2), Opcode::Recv, 1),
        ];
        cache.account_batch(&ledger, &wcs, u32::MAX);
        assert!(cache.silent.is_empty());
        assert_eq!((sq.outstanding(), rq.outstanding()), (0, 0));
        assert_eq!(b.credits_in_use(), 0);
        let marked: Vec<bool> = (0..4).map(|i| cache.missed(i)).collect();
        assert_eq!(marked, [true, true, false, false]);
        assert!(cache.missed_any());
    }

    /// Many send queues on one CQ: the silent scratch holds what one batch
    /// can retire (a batch names at most `batch` queues), not the sum of
    /// every queue's depth.
    #[test]
    fn many_queues_reserve_what_one_batch_can_retire() {
        let (depth, queues, batch) = (100u32, 20u32, 4usize);
        let ledger = WrLedger::new();
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |t: u32| key.wr_id(OpKind::Send, t).unwrap();
        let sqs: Vec<_> = (0..queues)
            .map(|qp| {
                let sq = ledger.open_queue(qp, Queue::Send);
                sq.reserve(depth);
                push(&sq, &[(id(qp), true)]);
                sq
            })
            .collect();
        let mut cache = AccountCache::new(batch);
        for (qp, sq) in (0..queues).zip(&sqs) {
            let wc = Completion::success(id(qp), crate::completion::Opcode::Send, qp);
            cache.account_batch(&ledger, &[wc], u32::MAX);
            assert_eq!(sq.outstanding(), 0);
        }
        let cap = cache.silent.capacity();
        assert!(cap >= batch * depth as usize, "{cap}");
        assert!(
            cap < (queues * depth) as usize,
            "{cap}: the sum of every depth"
        );
    }

    #[test]
    fn a_closed_queue_leaves_its_ledger_once_drained() {
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(7, Queue::Send);
        push(&sq, &[(1, false)]);
        sq.close();
        assert!(ledger.lookup(7, Side::Send).is_some(), "still outstanding");
        let mut cache = AccountCache::default();
        let mut wc = Completion::success(0, crate::completion::Opcode::Send, 7);
        wc.wr_id = 1;
        cache.account_batch(&ledger, &[wc], 0);
        assert_eq!(sq.outstanding(), 1, "wr_id 1 is foreign: not retired");
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = key.wr_id(crate::wr_id::OpKind::Send, 1).unwrap();
        push(&sq, &[(id, true)]);
        wc.wr_id = id;
        cache.account_batch(&ledger, &[wc], 0);
        assert_eq!(
            ids(&cache.silent),
            [1],
            "the foreign entry before it, silently"
        );
        assert!(ledger.lookup(7, Side::Send).is_none(), "detached");
    }

    #[test]
    fn a_drain_marker_follows_a_silent_tail_only_and_retires_it() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |tag| key.wr_id(OpKind::Write, tag).unwrap();
        let sq = ledger.open_queue(3, Queue::Send);
        let rq = ledger.open_queue(3, Queue::Recv);
        let push = |tag, signaled| push(&sq, &[(id(tag), signaled)]);
        let never = |_| -> Result<(), ()> { panic!("no marker is needed") };
        assert_eq!(sq.post_drain_marker(never), DrainMarker::NotNeeded, "empty");
        push(1, true);
        assert_eq!(
            sq.post_drain_marker(never),
            DrainMarker::NotNeeded,
            "signaled last"
        );
        assert_eq!(
            rq.post_drain_marker(never),
            DrainMarker::NotNeeded,
            "a receive queue"
        );
        push(2, false);
        push(3, false);
        // The backend's post fails: nothing is left behind.
        assert_eq!(sq.post_drain_marker(|_| Err(7)), DrainMarker::Failed(7));
        assert_eq!((sq.outstanding(), b.credits_in_use()), (3, 3));
        let mut marker = None;
        let posted = sq.post_drain_marker(|wr_id| -> Result<(), ()> {
            marker = Some(wr_id);
            Ok(())
        });
        assert_eq!(posted, DrainMarker::Posted);
        assert_eq!(
            (sq.outstanding(), b.credits_in_use()),
            (4, 4),
            "the marker holds a credit"
        );
        let marker = marker.unwrap();
        assert_eq!(WrId::decode(marker).unwrap().kind, OpKind::Internal);
        // The completions: the signaled write, then the marker's flush,
        // which retires the silent ones before it.
        let mut cache = AccountCache::default();
        let done = Completion::success(id(1), crate::completion::Opcode::RdmaWrite, 3);
        let flush = Completion::error(marker, crate::completion::Status::WrFlush, 3);
        cache.account_batch(&ledger, &[done, flush], 0);
        assert_eq!(ids(&cache.silent), [id(2), id(3)]);
        assert_eq!((sq.outstanding(), b.credits_in_use()), (0, 0));
    }

    #[test]
    fn a_success_names_the_signaled_entry_of_a_wr_id_posted_twice() {
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(1, Queue::Send);
        // The write, unsignaled, and the final request, signaled.
        push(&sq, &[(5, false), (5, true)]);
        let mut silent = Vec::new();
        assert_eq!(
            sq.retiring().retire(5, true, &mut silent, &mut None),
            (0, true)
        );
        assert_eq!(ids(&silent), [5], "the unsignaled one ran silently");
        assert_eq!(sq.outstanding(), 0, "both retired by the one success");
        // An error names the oldest entry, signaled or not.
        push(&sq, &[(6, false), (6, true)]);
        silent.clear();
        assert_eq!(
            sq.retiring().retire(6, false, &mut silent, &mut None),
            (0, true)
        );
        assert!(silent.is_empty());
        assert_eq!(sq.outstanding(), 1, "the flush of the second is to come");
    }

    #[test]
    fn a_reused_queue_number_retires_the_old_queue_first_then_ends_it() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |tag| key.wr_id(crate::wr_id::OpKind::Send, tag).unwrap();
        let old = ledger.open_queue(7, Queue::Send);
        // The unsignaled ones carry contexts (their tags as words): each
        // comes back once, with its silent retirement.
        for (tag, signaled) in [(1, true), (2, false), (3, true), (4, false)] {
            let mut p = old.posting();
            p.take_credits(1).unwrap();
            if signaled {
                p.write(id(tag), Instant::now(), true);
            } else {
                let at = crate::account::stamp_now();
                p.write_ctx(id(tag), at, false, std::mem::MaybeUninit::new(tag.into()));
            }
            p.publish();
            p.commit();
        }
        old.close();
        let words = |silent: &[SilentEntry]| -> Vec<(u64, Option<u64>)> {
            let word = |c: crate::account::CtxWord| {
                // SAFETY: every word this queue holds was written whole,
                // as a u64, by `write_ctx` above.
                unsafe { c.assume_init() }
            };
            silent.iter().map(|&(w, c)| (w, c.map(word))).collect()
        };
        // Queue 7 is made again before the old one drained.
        let new = ledger.open_queue(7, Queue::Send);
        push(&new, &[(id(3), true)]); // the same wr_id as an old entry
        assert_eq!(b.credits_in_use(), 5);
        let wc = |tag| Completion::success(id(tag), crate::completion::Opcode::Send, 7);
        let mut cache = AccountCache::default();
        // The old queue's completions come first and retire the old entries.
        cache.account_batch(&ledger, &[wc(1), wc(3)], 0);
        assert_eq!(words(&cache.silent), [(id(2), Some(2))]);
        assert_eq!((old.outstanding(), new.outstanding()), (1, 1));
        // The new queue's first completion ends the old one: 4 ran silently.
        cache.account_batch(&ledger, &[wc(3)], 0);
        assert_eq!(words(&cache.silent), [(id(4), Some(4))], "take_all's word");
        assert_eq!((old.outstanding(), new.outstanding()), (0, 0));
        assert_eq!(b.credits_in_use(), 0, "every credit came back");
    }

    proptest! {
        /// However signaled and unsignaled sends interleave, in-order
        /// completions of the signaled ones (and a final flush of the rest)
        /// retire each entry exactly once and return every credit.
        #[test]
        fn every_entry_retires_once(signaled in proptest::collection::vec(any::<bool>(), 1..64)) {
            let b = budget();
            let ledger = WrLedger::with_budget(b.clone());
            let sq = ledger.open_queue(1, Queue::Send);
            for (i, s) in signaled.iter().enumerate() {
                push(&sq, &[(i as u64, *s)]);
            }
            let (mut retired, mut credits) = (0usize, 0u64);
            let mut silent = Vec::new();
            for (i, s) in signaled.iter().enumerate() {
                if *s {
                    let (c, found) = sq.retiring().retire(i as u64, true, &mut silent, &mut None);
                    prop_assert!(found);
                    credits += c;
                    retired += 1;
                }
            }
            // A QP in error flushes what is left, each with its own completion.
            let rest: Vec<u64> = sq.retiring().live().map(|(_, e)| e.wr_id).collect();
            for id in rest {
                let (c, found) = sq.retiring().retire(id, false, &mut silent, &mut None);
                prop_assert!(found);
                credits += c;
                retired += 1;
            }
            prop_assert_eq!(retired + silent.len(), signaled.len());
            prop_assert_eq!(credits, signaled.len() as u64);
            prop_assert_eq!(sq.outstanding(), 0);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_close {
    use super::*;
    use crate::account::Queue;
    use crate::completion::Opcode;
    use crate::wr_id::{HandlerKey, OpKind};
    use std::time::Instant;

    fn post(q: &QueueAccount, ids: &[(u64, bool)]) {
        let mut p = q.posting();
        for &(id, signaled) in ids {
            p.write(id, Instant::now(), signaled);
        }
        p.publish();
        p.commit();
    }

    /// A queue's last requests posted (an unsignaled send, then a signaled
    /// one) and the queue closed, while the poller retires the request
    /// before them: whatever the interleaving, the account stays attached
    /// until the signaled one's completion retires both, then leaves the
    /// ledger. (Deciding "drained" under the lock and "closed" after it
    /// let the poller detach an account the poster had just refilled: the
    /// next completion then found no account, and the unsignaled send was
    /// never counted completed.)
    #[test]
    fn a_close_after_a_refill_never_detaches_a_live_account() {
        loom::model(|| {
            let key = HandlerKey::new(0, 0).unwrap();
            let id = move |tag| key.wr_id(OpKind::Send, tag).unwrap();
            let ledger = WrLedger::new();
            let sq = ledger.open_queue(7, Queue::Send);
            post(&sq, &[(id(1), true)]);
            let poster = Arc::clone(&sq);
            let t = loom::thread::spawn(move || {
                post(&poster, &[(id(2), false), (id(3), true)]);
                poster.close();
            });
            let mut cache = AccountCache::default();
            cache.account_batch(&ledger, &[Completion::success(id(1), Opcode::Send, 7)], 0);
            t.join().unwrap();
            assert!(
                ledger.lookup(7, Side::Send).is_some(),
                "detached with two requests outstanding"
            );
            cache.account_batch(&ledger, &[Completion::success(id(3), Opcode::Send, 7)], 0);
            assert_eq!(ids(&cache.silent), [id(2)], "the unsignaled send, silently");
            assert_eq!(sq.outstanding(), 0);
            assert!(
                ledger.lookup(7, Side::Send).is_none(),
                "detached once drained"
            );
        });
    }
}

/// Loom models of the posting protocol (R1–R8 of `account::ring`): a
/// completion that arrives inside the post, and a post refused part-way at
/// `bad_wr`, each with the poller retiring concurrently, and each with a
/// mutation of the protocol that loom must catch.
///
/// The provider is a one-entry CQ (an atomic wr_id) that the poster's
/// "post" writes with Release and the poller reads with Acquire, as a
/// device's completion write and a poll would order them.
#[cfg(all(test, loom))]
mod loom_post {
    use super::*;
    use crate::account::Queue;
    use crate::budget::BudgetOptions;
    use crate::budget::CqBudget;
    use crate::completion::Opcode;
    use crate::sync::{AtomicU64, Ordering};
    use crate::wr_id::{HandlerKey, OpKind};
    use std::time::Instant;

    fn id(tag: u32) -> u64 {
        HandlerKey::new(0, 0)
            .unwrap()
            .wr_id(OpKind::Send, tag)
            .unwrap()
    }

    fn rig() -> (CqBudget, WrLedger, Arc<QueueAccount>) {
        let b = CqBudget::new(
            "loom",
            8,
            BudgetOptions {
                admission: false,
                credits: Some(8),
            },
        );
        let ledger = WrLedger::with_budget(b.clone());
        let sq = ledger.open_queue(7, Queue::Send);
        (b, ledger, sq)
    }

    /// The poller: waits for the fake CQ's entries, then accounts them as
    /// one batch.
    fn poll(ledger: &WrLedger, cq: &[AtomicU64]) -> Vec<u64> {
        let mut wcs = Vec::new();
        for slot in cq {
            let wr_id = loop {
                match slot.load(Ordering::Acquire) {
                    0 => loom::thread::yield_now(),
                    w => break w,
                }
            };
            wcs.push(Completion::success(wr_id, Opcode::Send, 7));
        }
        let mut cache = AccountCache::default();
        cache.account_batch(ledger, &wcs, 0);
        ids(&cache.silent)
    }

    /// The poller of the `bad_wr` models: waits for the fake CQ's two
    /// entries, the completion of the first request (a flush: unsignaled
    /// requests complete only in error) and the foreign copy of the
    /// second's wr_id (a success).
    fn flush_then_foreign(cq: &[AtomicU64]) -> [Completion; 2] {
        loop {
            let (a, c) = (cq[0].load(Ordering::Acquire), cq[1].load(Ordering::Acquire));
            if a != 0 && c != 0 {
                return [
                    Completion::error(a, crate::completion::Status::WrFlush, 7),
                    Completion::success(c, Opcode::Send, 7),
                ];
            }
            loom::thread::yield_now();
        }
    }

    /// The completion of a request arrives while its post is still in the
    /// provider (softverbs, an inline NIC): it finds the entry published
    /// (R2 before R3), and retires it once, credit included.
    fn inside_the_post(publish_first: bool) {
        loom::model(move || {
            let (b, ledger, sq) = rig();
            let cq = Arc::new([AtomicU64::new(0)]);
            let (q, device) = (Arc::clone(&sq), Arc::clone(&cq));
            let poster = loom::thread::spawn(move || {
                let mut p = q.posting();
                p.take_credits(1).unwrap();
                p.write(id(1), Instant::now(), true);
                if publish_first {
                    p.publish();
                }
                // R3: the device completes the request inside the post.
                device[0].store(id(1), Ordering::Release);
                if !publish_first {
                    p.publish();
                }
                p.commit();
            });
            poll(&ledger, &cq[..]);
            poster.join().unwrap();
            assert_eq!(sq.outstanding(), 0, "the completion found no entry");
            assert_eq!(b.credits_in_use(), 0, "its credit came back");
        });
    }

    #[test]
    fn a_completion_inside_the_post_finds_its_entry() {
        inside_the_post(true);
    }

    /// Mutation: publishing after the provider's post lets the poller
    /// look before the entry exists.
    #[test]
    #[should_panic(expected = "the completion found no entry")]
    fn publishing_after_the_post_loses_the_completion() {
        inside_the_post(false);
    }

    /// The provider takes the first of two requests and refuses the second
    /// (`bad_wr` at 1). The first completes inside the post; a foreign
    /// completion that happens to carry the second's wr_id arrives too
    /// (the worst case: it may retire that entry before the tombstone).
    /// One credit is held by someone else. Both requests carry contexts
    /// (R1). Whatever the interleaving, each entry is decided once: the
    /// credits in use end at exactly 1, the first request's context
    /// reaches its completion, and the second's has exactly one owner —
    /// the poster (its tombstone won: the value goes back to its caller)
    /// or the foreign completion (its claim won, R5).
    fn refused_at_bad_wr(cas: bool, head_bound_is_tail: bool) {
        loom::model(move || {
            crate::account::HEAD_BOUND_IS_TAIL.with(|m| m.set(head_bound_is_tail));
            let (b, ledger, sq) = rig();
            b.try_take(1).unwrap();
            let cq = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
            let (q, device) = (Arc::clone(&sq), Arc::clone(&cq));
            let poster = loom::thread::spawn(move || {
                let mut p = q.posting();
                p.take_credits(2).unwrap();
                let at = crate::account::stamp(Instant::now());
                p.write_ctx(id(1), at, false, word(1));
                p.write_ctx(id(2), at, true, word(2));
                p.publish();
                device[0].store(id(1), Ordering::Release);
                device[1].store(id(2), Ordering::Release); // foreign
                let mut back = 0;
                if cas {
                    p.settle(1, |_, taken_back| back += u32::from(taken_back));
                } else {
                    // The poster believes its store tombstoned the entry.
                    p.settle_without_cas(1);
                    back = 1;
                }
                back
            });
            let wcs = flush_then_foreign(&cq[..]);
            let mut cache = AccountCache::new(2);
            cache.account_batch(&ledger, &wcs, 0);
            let got = words(&cache, 2);
            let back = poster.join().unwrap();
            assert_eq!(b.credits_in_use(), 1, "an entry was decided twice");
            assert_eq!(sq.outstanding(), 0, "nothing is left");
            assert_eq!(got[0], Some(1), "the posted request's context");
            let claimed = u32::from(got[1] == Some(2));
            assert_eq!(claimed + back, 1, "a context owned twice or by nobody");
        });
    }

    #[test]
    fn a_refused_tail_is_decided_once() {
        refused_at_bad_wr(true, false);
    }

    /// Mutation of R5's common case: the poller's take at `head` bounded
    /// by the `tail` it loaded instead of `committed`, so that it takes
    /// with a plain move of `head` an entry a poster may still tombstone
    /// (R4): both win.
    #[test]
    #[should_panic(expected = "decided twice")]
    fn a_head_taken_above_committed_decides_twice() {
        refused_at_bad_wr(true, true);
    }

    /// Mutation: tombstoning with a plain store lets a poster take back an
    /// entry (and its context) the poller has just retired.
    #[test]
    #[should_panic(expected = "decided twice")]
    fn tombstoning_without_cas_decides_twice() {
        refused_at_bad_wr(false, false);
    }

    fn word(v: u64) -> CtxWord {
        std::mem::MaybeUninit::new(v)
    }

    /// The context words the batch's accounting took, by completion.
    fn words(cache: &AccountCache, n: usize) -> Vec<Option<u64>> {
        (0..n)
            // SAFETY: the models write whole `u64`s.
            .map(|i| cache.ctx_of(i).map(|w| unsafe { w.assume_init() }))
            .collect()
    }

    /// R1 and R5 for a context: a request's context word, written with its
    /// entry before the publish, reaches its completion when that arrives
    /// inside the post (the claim owns the word; loom checks that the
    /// poster's write and the poller's read never race).
    fn ctx_inside_the_post(word_first: bool) {
        loom::model(move || {
            let (b, ledger, sq) = rig();
            let cq = Arc::new([AtomicU64::new(0)]);
            let (q, device) = (Arc::clone(&sq), Arc::clone(&cq));
            let poster = loom::thread::spawn(move || {
                let mut p = q.posting();
                p.take_credits(1).unwrap();
                let pos = p.next_pos();
                if word_first {
                    p.write_ctx(id(1), crate::account::stamp(Instant::now()), true, word(42));
                } else {
                    p.write_flagged(id(1), Instant::now(), true);
                }
                p.publish();
                // R3: the device completes the request inside the post.
                device[0].store(id(1), Ordering::Release);
                if !word_first {
                    p.write_word_late(pos, word(42));
                }
                p.commit();
            });
            let slot = loop {
                match cq[0].load(Ordering::Acquire) {
                    0 => loom::thread::yield_now(),
                    w => break w,
                }
            };
            let mut cache = AccountCache::new(1);
            cache.account_batch(&ledger, &[Completion::success(slot, Opcode::Send, 7)], 0);
            let got = words(&cache, 1);
            poster.join().unwrap();
            assert_eq!(got, [Some(42)], "the completion lost its context");
            assert_eq!(sq.outstanding(), 0);
            assert_eq!(b.credits_in_use(), 0);
        });
    }

    #[test]
    fn a_context_inside_the_post_reaches_its_completion() {
        ctx_inside_the_post(true);
    }

    /// Mutation: the word written after the provider's post, which the
    /// completion may already have claimed: loom sees the poller's read
    /// race the poster's write (or the read find the word not written).
    #[test]
    #[should_panic(expected = "Causality violation")]
    fn a_context_written_after_the_post_races_its_completion() {
        ctx_inside_the_post(false);
    }
}
