//! The dispatch of a polled batch: the per-batch queue accounting, then
//! per completion the wr_id decode, the generation-checked slab lookup and
//! the typed callback; registrations applied between batches; retirement of
//! drained handlers. Everything here runs on the poller thread, no lock on
//! the common path (a success for a live handler stays inline; every other
//! case is out of line).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::{Command, CqOptions, CqShared};
use crate::account::{CtxWord, SilentEntry};
use crate::completion::Completion;
use crate::handler::{Failed, Outbox, RecvDone, SendDone};
use crate::ledger::AccountCache;
use crate::ledger::WrLedger;
use crate::metrics::{bump, key_word};
use crate::sink::Routed;
use crate::slab::{Entry, Slab};
use crate::sync::Ordering;
use crate::wr_id::{HandlerKey, OpKind, Side, WrId, SLOT_MASK, SLOT_SHIFT};

/// Applies every pending command. Registration doorbell protocol step 2
/// (in `handle`): the flag is cleared first, then the queue is drained to
/// empty, so a command pushed after the clear rings again and one pushed
/// before it is popped here. A retiring handler that cannot be closed yet
/// (a poster entering its slot) is pushed back, and applied at the next
/// poll, not in this drain.
pub(super) fn apply_commands<W>(shared: &CqShared<W>, slab: &mut Slab<W>) {
    shared.commands_rung.swap(false, Ordering::AcqRel);
    let mut retry = Vec::new();
    while let Some(cmd) = shared.commands.pop() {
        match cmd {
            Command::Register { key, entry } => slab.install(key, entry),
            Command::Unregister { key } => {
                if let Some(e) = slab.get_mut(key) {
                    e.retiring = true;
                    if e.ledger.outstanding_raw() == 0 && !retire(shared, slab, key) {
                        retry.push(key);
                    }
                }
            }
            Command::Recheck { key } => {
                if slab
                    .get_mut(key)
                    .is_some_and(|e| e.retiring && e.ledger.outstanding_raw() == 0)
                    && !retire(shared, slab, key)
                {
                    retry.push(key);
                }
            }
        }
    }
    for key in retry {
        super::handle::push_command(shared, Command::Unregister { key });
    }
    // A resize is made by the poller's own pass (`resize`, step 2), which
    // this one may not be: the next poll looks again.
    shared.resizes.after_pass(&shared.commands_rung);
}

/// Releases a drained, retiring handler: closes its ledger (see
/// [`SlotLedger`](crate::slab::SlotLedger)), drops it and frees its slot.
/// False if the ledger could not be closed (a poster is entering it, or it
/// posted again): the handler stays.
fn retire<W>(shared: &CqShared<W>, slab: &mut Slab<W>, key: HandlerKey) -> bool {
    let Some(e) = slab.get_mut(key) else {
        return true;
    };
    if !e.ledger.close() {
        return false;
    }
    if let Some(entry) = slab.remove(key) {
        shared.table().release(key);
        let m = &shared.metrics.0;
        m.handlers_live.fetch_sub(1, Ordering::Relaxed);
        m.unregistrations.fetch_add(1, Ordering::Relaxed);
        drop(entry);
        shared.retired(Some(key));
    }
    true
}

/// The slot bits of a wr_id, whatever the rest holds (for a prefetch only:
/// dispatch decodes and checks the whole wr_id).
#[inline(always)]
fn slot_of(wr_id: u64) -> u32 {
    ((wr_id >> SLOT_SHIFT) & SLOT_MASK) as u32
}

/// Routes a batch. One `catch_unwind` covers the batch: the cursor moves
/// past a completion before its handler runs, so after a panic dispatch
/// resumes at the next completion and none is delivered twice or skipped.
#[inline]
pub(super) fn dispatch_batch<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    accounts: &mut AccountCache,
    options: &CqOptions,
    wcs: &[Completion],
    out: &mut VecDeque<Routed<W>>,
    probe: &mut u32,
) {
    // Every polled entry has left the CQ, whatever its dispatch finds
    // (stale included): retire what it covers in its queue's account and
    // return those credits first, in one pass that a CQ without queue
    // accounts skips (a ledger whose epoch is still 0 never had a queue:
    // opening one moves it before the queue can post).
    let ledger = shared.ledger.get().filter(|l| l.epoch() != 0);
    if let Some(ledger) = ledger {
        account_hooks(
            shared,
            slab,
            accounts,
            ledger,
            wcs,
            out,
            options.recv_low_water,
        );
    }
    // With more handlers than the cache holds, the batch's lines are
    // asked for before they are needed, so that the misses of cold
    // handlers overlap instead of following one another: every entry,
    // then (once the entries are on their way) each handler's counters
    // and state. A small slab stays in the cache and skips both passes.
    if slab.is_large() {
        for wc in wcs {
            slab.prefetch_slot(slot_of(wc.wr_id));
        }
        for wc in wcs {
            slab.prefetch_handler(slot_of(wc.wr_id));
        }
    }
    // The context words the accounting took, by completion, and the
    // completions that matched no request in flight (none without a
    // ledger: no request of this CQ was posted with one; none either when
    // the batch claimed no word and matched every completion, the plain
    // handlers' case).
    let words = ledger
        .map(|_| &*accounts)
        .filter(|a| a.claimed_ctx() || a.missed_any());
    let mut next = 0;
    while next < wcs.len() {
        // Two loops, so that a batch without context words (every batch of
        // plain handlers) runs one that carries none: a look-up per
        // completion in the same loop cost the plain path 1.5 ns (the
        // loop's values no longer fitted in registers).
        let result = catch_unwind(AssertUnwindSafe(|| match words {
            None => {
                while let Some(wc) = wcs.get(next) {
                    next += 1;
                    one(shared, slab, options, wc, out, probe, None);
                }
            }
            Some(words) => {
                while let Some(wc) = wcs.get(next) {
                    let i = next;
                    next += 1;
                    if words.missed(i) {
                        unmatched(shared, slab, wc);
                        continue;
                    }
                    one(shared, slab, options, wc, out, probe, words.ctx_of(i));
                }
            }
        }));
        if result.is_err() {
            handler_panicked(shared, &wcs[next - 1]);
        }
    }
    if accounts.received_any() {
        dry_check(shared, accounts, options);
    }
}

/// One completion of the batch: dispatched, or timed after a slow batch.
#[inline(always)]
fn one<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    options: &CqOptions,
    wc: &Completion,
    out: &mut VecDeque<Routed<W>>,
    probe: &mut u32,
    ctx: Option<CtxWord>,
) {
    if *probe == 0 {
        dispatch(shared, slab, options, wc, out, ctx);
    } else {
        *probe -= 1;
        timed(shared, slab, options, wc, out, ctx);
    }
}

/// Out of line: one completion dispatched under a clock, after a slow
/// batch ([`CqOptions::slow_batch`]); a call over the threshold during
/// which the thread blocked names its handler.
#[cold]
#[inline(never)]
fn timed<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    options: &CqOptions,
    wc: &Completion,
    out: &mut VecDeque<Routed<W>>,
    ctx: Option<CtxWord>,
) {
    bump(&shared.metrics.0.probed_calls, 1);
    let switches = crate::sys::voluntary_switches();
    let start = std::time::Instant::now();
    dispatch(shared, slab, options, wc, out, ctx);
    let took = start.elapsed();
    let Some(threshold) = options.slow_batch else {
        return;
    };
    // Slow and off its CPU of its own accord: it blocked (a sleep, a lock,
    // I/O). A call that was only preempted, or that computed for long,
    // did not.
    if took <= threshold || crate::sys::voluntary_switches() == switches {
        return;
    }
    let m = &shared.metrics.0;
    bump(&m.slow_handler_calls, 1);
    let key = note_key(&m.last_slow_key, wc.wr_id);
    let ns = took.as_nanos() as u64;
    m.last_slow_ns.store(ns, Ordering::Relaxed);
    m.max_slow_ns.fetch_max(ns, Ordering::Relaxed);
    tracing::warn!(cq = %shared.name, handler = %key.map_or_else(|| "?".to_string(), |k| k.to_string()),
        qp = wc.qp_num, ?took, ?threshold,
        "slow handler: one callback held the poller; hand blocking work to a pool");
}

/// Records the handler `wr_id` names in one of the CQ's `last_*` words
/// (the findings name it); returns it.
fn note_key(cell: &crate::sync::AtomicU64, wr_id: u64) -> Option<HandlerKey> {
    let key = WrId::decode(wr_id).ok().map(|id| id.key);
    if let Some(k) = key {
        cell.store(key_word(k), Ordering::Relaxed);
    }
    key
}

/// After the batch's handlers (and their reposts): the receive queues the
/// batch left dry, counted and named (see `AccountCache::check_dry`).
#[inline(never)]
fn dry_check<W>(shared: &CqShared<W>, accounts: &mut AccountCache, options: &CqOptions) {
    accounts.check_dry(options.recv_low_water);
    for &(qp, wr_id) in &accounts.dry {
        let m = &shared.metrics.0;
        bump(&m.recv_queues_dry, 1);
        m.last_dry_qp.store(u64::from(qp) + 1, Ordering::Relaxed);
        let key = note_key(&m.last_dry_key, wr_id);
        tracing::warn!(cq = %shared.name, qp, handler = %key.map_or_else(|| "?".to_string(), |k| k.to_string()),
            low_water = options.recv_low_water,
            "receive queue ran dry: its peer's next SEND finds no receive (RNR); repost receives from on_recv");
    }
}

/// Routes one completion. Cannot fail part-way: once the wr_id names a live
/// handler, the completion counts as completed for it before any callback
/// runs. The common case (a success for a live handler) stays inline; every
/// other case is out of line.
#[inline(always)]
fn dispatch<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    options: &CqOptions,
    wc: &Completion,
    out: &mut VecDeque<Routed<W>>,
    ctx: Option<CtxWord>,
) {
    if options.trace_completions {
        trace_completion(&shared.name, wc);
    }
    let Ok(id) = WrId::decode(wc.wr_id) else {
        return foreign(shared, wc);
    };
    if matches!(id.kind, OpKind::Internal) {
        return internal(shared, wc);
    }
    let Some(entry) = slab.get_mut(id.key) else {
        return miss(shared, slab, wc, id, out, ctx);
    };
    complete(shared, entry, id, wc, out, ctx);
    if entry.retiring {
        retire_if_drained(shared, slab, id.key);
    }
}

/// Delivers a completion to the live handler it names: counts it completed
/// first, then calls the typed callback (successes inline, everything else
/// out of line).
#[inline(always)]
fn complete<W: 'static>(
    shared: &CqShared<W>,
    entry: &mut Entry<W>,
    id: WrId,
    wc: &Completion,
    out: &mut VecDeque<Routed<W>>,
    ctx: Option<CtxWord>,
) {
    entry.ledger.add_completed(id.kind);
    if wc.status.is_success() && wc.opcode.is_known() {
        let mut outbox = Outbox::new(out, entry.route);
        match id.kind.side() {
            Side::Send => entry.handler.on_send(
                &SendDone {
                    kind: id.kind,
                    tag: id.tag,
                    key: id.key,
                    wc,
                    ctx,
                },
                &mut outbox,
            ),
            Side::Recv => entry.handler.on_recv(
                &RecvDone {
                    tag: id.tag,
                    key: id.key,
                    wc,
                    ctx,
                },
                &mut outbox,
            ),
        }
    } else {
        not_success(shared, entry, id, wc, out, ctx);
    }
}

/// The accounting pass of one batch (see [`crate::account`]): retires
/// queue-account entries and returns their credits, then counts each
/// unsignaled request retired by a later completion as completed for its
/// own handler and tells the handler ([`Handler::on_silent`]), before the
/// batch's own callbacks (its requests came first on their queue).
#[inline(never)]
fn account_hooks<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    accounts: &mut AccountCache,
    ledger: &WrLedger,
    wcs: &[Completion],
    out: &mut VecDeque<Routed<W>>,
    low_water: u32,
) {
    accounts.account_batch(ledger, wcs, low_water);
    if accounts.silent.is_empty() {
        return;
    }
    silent_hooks(shared, slab, &accounts.silent, out);
}

/// Out of line: the unsignaled requests a batch retired.
#[cold]
#[inline(never)]
fn silent_hooks<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    silent: &[SilentEntry],
    out: &mut VecDeque<Routed<W>>,
) {
    for &(wr_id, ctx) in silent {
        let Ok(id) = WrId::decode(wr_id) else {
            continue;
        };
        if matches!(id.kind, OpKind::Internal) {
            continue;
        }
        if slab.get_mut(id.key).is_none() && !shared.commands.is_empty() {
            apply_commands(shared, slab);
        }
        if let Some(entry) = slab.get_mut(id.key) {
            entry.ledger.add_completed(id.kind);
            let s = crate::handler::Silent {
                kind: id.kind,
                tag: id.tag,
                key: id.key,
                ctx,
            };
            let mut outbox = Outbox::new(out, entry.route);
            // A panic here is caught as in the batch's dispatch: counted,
            // and the request stays counted completed.
            let handler = &mut entry.handler;
            if catch_unwind(AssertUnwindSafe(|| handler.on_silent(&s, &mut outbox))).is_err() {
                silent_panicked(shared, wr_id);
            }
            if entry.retiring {
                retire_if_drained(shared, slab, id.key);
            }
        }
    }
}

#[cold]
#[inline(never)]
fn trace_completion(name: &str, wc: &Completion) {
    tracing::trace!(cq = %name, wr_id = format_args!("{:#x}", wc.wr_id),
        status = %wc.status, opcode = %wc.opcode, qp = wc.qp_num, "completion");
}

#[cold]
#[inline(never)]
fn foreign<W>(shared: &CqShared<W>, wc: &Completion) {
    bump(&shared.metrics.0.foreign_wr_ids, 1);
    let m = &shared.metrics.0;
    m.last_foreign_qp
        .store(u64::from(wc.qp_num) + 1, Ordering::Relaxed);
    let why = WrId::decode(wc.wr_id).err();
    tracing::warn!(cq = %shared.name, wr_id = format_args!("{:#x}", wc.wr_id),
        status = %wc.status, qp = wc.qp_num, why = ?why, "completion not dispatched: foreign wr_id");
}

/// A request cqd posted for itself (a drain marker, see
/// [`QueueAccount::post_drain_marker`](crate::ledger::QueueAccount::post_drain_marker)):
/// the accounting pass has retired what it covers; no handler is called
/// and no handler's ledger counted it.
#[cold]
#[inline(never)]
fn internal<W>(shared: &CqShared<W>, wc: &Completion) {
    tracing::debug!(cq = %shared.name, qp = wc.qp_num, status = %wc.status,
        "drain marker completed: the queue's silent requests before it are retired");
}

/// A completion of an attached queue whose accounting matched no request
/// in flight there (a completion the device wrote twice, or one naming a
/// request never posted on that queue): counted and named, never
/// delivered, so that no handler sees a request complete twice and no
/// handler's ledger counts more completions than posts. One that names a
/// handler no longer registered is counted stale, as the dispatch of an
/// accounted one would.
#[cold]
#[inline(never)]
fn unmatched<W>(shared: &CqShared<W>, slab: &mut Slab<W>, wc: &Completion) {
    if let Ok(id) = WrId::decode(wc.wr_id) {
        let gone = !matches!(id.kind, OpKind::Internal)
            && shared.commands.is_empty()
            && slab.get_mut(id.key).is_none();
        if gone {
            return stale(shared, wc, id);
        }
    }
    let m = &shared.metrics.0;
    bump(&m.unmatched_wr_ids, 1);
    m.last_unmatched_qp
        .store(u64::from(wc.qp_num) + 1, Ordering::Relaxed);
    let key = note_key(&m.last_unmatched_key, wc.wr_id);
    tracing::warn!(cq = %shared.name, qp = wc.qp_num, wr_id = format_args!("{:#x}", wc.wr_id),
        handler = %key.map_or_else(|| "?".to_string(), |k| k.to_string()), status = %wc.status,
        "a completion matched no request in flight on its queue (written twice by the device?): not delivered");
}

/// The slot is empty or has another generation: maybe a registration not
/// yet applied (posted right after `register` returned), else stale.
#[cold]
#[inline(never)]
fn miss<W: 'static>(
    shared: &CqShared<W>,
    slab: &mut Slab<W>,
    wc: &Completion,
    id: WrId,
    out: &mut VecDeque<Routed<W>>,
    ctx: Option<CtxWord>,
) {
    if !shared.commands.is_empty() {
        apply_commands(shared, slab);
        if let Some(entry) = slab.get_mut(id.key) {
            complete(shared, entry, id, wc, out, ctx);
            if entry.retiring {
                retire_if_drained(shared, slab, id.key);
            }
            return;
        }
    }
    stale(shared, wc, id);
}

/// Counts and names a completion whose wr_id names no live handler.
#[cold]
#[inline(never)]
fn stale<W>(shared: &CqShared<W>, wc: &Completion, id: WrId) {
    bump(&shared.metrics.0.stale_wr_ids, 1);
    let m = &shared.metrics.0;
    m.last_stale_qp
        .store(u64::from(wc.qp_num) + 1, Ordering::Relaxed);
    m.last_stale_key.store(key_word(id.key), Ordering::Relaxed);
    tracing::warn!(cq = %shared.name, wr_id = format_args!("{:#x}", wc.wr_id), key = %id.key,
        kind = %id.kind, status = %wc.status, "stale wr_id: no live handler has this generation");
}

/// Everything but a success with a known opcode goes to `on_error`: error
/// statuses (flushes counted as such), and the anomalies — a status or an
/// opcode this cqd does not know — counted and traced first, so that the
/// handler can still release what the request held.
#[cold]
#[inline(never)]
fn not_success<W: 'static>(
    shared: &CqShared<W>,
    entry: &mut Entry<W>,
    id: WrId,
    wc: &Completion,
    out: &mut VecDeque<Routed<W>>,
    ctx: Option<CtxWord>,
) {
    let m = &shared.metrics.0;
    let status = wc.status;
    let anomaly = if !status.is_known() {
        bump(&m.unknown_status, 1);
        Some("unknown status")
    } else if status.is_success() {
        bump(&m.unknown_opcode, 1);
        Some("unknown opcode")
    } else {
        bump(&m.errors_by_status[status.table_index()], 1);
        if status.is_flush() {
            bump(&m.flushes, 1);
            entry.ledger.add_flushed(id.kind);
        }
        None
    };
    if let Some(anomaly) = anomaly {
        tracing::error!(cq = %shared.name, wr_id = format_args!("{:#x}", wc.wr_id), key = %id.key,
            kind = %id.kind, status = %wc.status, opcode = %wc.opcode, qp = wc.qp_num,
            vendor_err = wc.vendor_err, "{anomaly}: counted, delivered to on_error");
    }
    let failed = Failed {
        kind: id.kind,
        tag: id.tag,
        key: id.key,
        wc,
        ctx,
    };
    let mut outbox = Outbox::new(out, entry.route);
    entry.handler.on_error(&failed, &mut outbox);
}

#[cold]
#[inline(never)]
fn handler_panicked<W>(shared: &CqShared<W>, wc: &Completion) {
    bump(&shared.metrics.0.handler_panics, 1);
    let id = WrId::decode(wc.wr_id).ok();
    note_key(&shared.metrics.0.last_panic_key, wc.wr_id);
    tracing::error!(cq = %shared.name, wr_id = format_args!("{:#x}", wc.wr_id), id = ?id,
        status = %wc.status, "handler panicked; completion counted as delivered");
}

#[cold]
#[inline(never)]
fn silent_panicked<W>(shared: &CqShared<W>, wr_id: u64) {
    bump(&shared.metrics.0.handler_panics, 1);
    note_key(&shared.metrics.0.last_panic_key, wr_id);
    tracing::error!(cq = %shared.name, wr_id = format_args!("{:#x}", wr_id),
        "handler panicked in on_silent; the request counts as completed");
}

#[cold]
#[inline(never)]
fn retire_if_drained<W>(shared: &CqShared<W>, slab: &mut Slab<W>, key: HandlerKey) {
    if slab
        .get_mut(key)
        .is_some_and(|e| e.ledger.outstanding_raw() == 0)
        && !retire(shared, slab, key)
    {
        // A poster is entering the slot: try again at the next poll.
        super::handle::push_command(shared, Command::Unregister { key });
    }
}
