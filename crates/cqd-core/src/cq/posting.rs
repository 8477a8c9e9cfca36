//! The posting call's body: steps 1–6 of [`crate::post`] for one list, on a
//! handler's [`Registration`].

use crate::account::{CtxWord, QueueAccount};
use crate::cq::Registration;
use crate::post::{Invalid, Refused, WorkRequest};
use crate::sync::{AtomicBool, Ordering};
use crate::wr_id::{OpKind, TAG_MASK};

/// A list's contexts, as words (`crate::context`): the posting call
/// writes request `i`'s word beside its entry (R1) and says which words
/// come back to the caller.
pub(crate) struct Words<'a> {
    /// One word per request of the list.
    pub(crate) words: &'a [CtxWord],
    /// Set by the call: `true` for each request whose word is the
    /// caller's again (not posted, or tombstoned at R4), `false` for one
    /// whose word is now its entry's (posted, or taken by the poller
    /// first: its completion carries it).
    pub(crate) back: &'a mut [bool],
    /// The handler's end (`WithContexts` dropped): its contexts would no
    /// longer reach it, so the list is refused. Read under the posting
    /// lock, which the end takes on every queue after setting it.
    pub(crate) gone: &'a AtomicBool,
}

/// Puts the tags back in the wr_id fields of `wrs` (encoded by step 1).
fn restore<R: WorkRequest>(wrs: &mut [R]) {
    for wr in wrs {
        wr.set_wr_id(wr.wr_id() & TAG_MASK);
    }
}

/// Steps 1–6 of the module documentation for one list; with `ctx`, each
/// request carries a context word (see [`Words`]: `back` is all `true`
/// until the call says otherwise).
#[allow(clippy::too_many_arguments)]
pub(crate) fn post<R, E>(
    reg: &Registration,
    account: &QueueAccount,
    wrs: &mut [R],
    kind: impl Fn(&R) -> OpKind,
    signaled: impl Fn(&R) -> bool,
    check: impl Fn(&R) -> Result<(), Invalid>,
    raw: impl FnOnce(&[R]) -> Result<(), (usize, E)>,
    mut ctx: Option<&mut Words<'_>>,
) -> Result<(), E>
where
    R: WorkRequest,
    E: From<Refused>,
{
    if let Some(w) = ctx.as_deref_mut() {
        debug_assert_eq!(w.words.len(), wrs.len());
        w.back.fill(true);
    }
    if wrs.is_empty() {
        return Ok(());
    }
    reg.attach(account)?;
    // 0. The queue's checks: a refused list was not touched.
    for (index, wr) in wrs.iter().enumerate() {
        if let Err(source) = check(wr) {
            return Err(Refused::Invalid { index, source }.into());
        }
    }
    // 1. Encode.
    let key = reg.key();
    let mut per_kind = [0u64; OpKind::COUNT];
    for index in 0..wrs.len() {
        let wr = &mut wrs[index];
        let k = kind(wr);
        if k.side() != account.queue().side() {
            restore(&mut wrs[..index]);
            let queue = account.queue();
            return Err(Refused::WrongSide {
                index,
                kind: k,
                queue,
            }
            .into());
        }
        let tag = u32::try_from(wr.wr_id()).unwrap_or(u32::MAX);
        match reg.wr_id(k, tag) {
            Ok(id) => wr.set_wr_id(id),
            Err(source) => {
                restore(&mut wrs[..index]);
                return Err(Refused::Tag { index, source }.into());
            }
        }
        per_kind[k.index()] += 1;
    }
    // 2. The handler's ledger counts them before any can complete (and
    // before anything is taken, so that a released handler's list is
    // refused with nothing to undo).
    let slot = reg.ledger();
    if !slot.add_posted_all(&per_kind) {
        restore(wrs);
        if slot.is_pending() {
            return Err(Refused::NotInstalled { handler: key }.into());
        }
        return Err(Refused::Released { handler: key }.into());
    }
    // 3. The queue's posting lock (posters of this queue serialise; the
    // poller never takes it), and the credits.
    let mut posting = account.posting();
    // A list with contexts: the handler's end may have come (the poller
    // stopped), or the queue's positions may have wrapped past a request
    // still outstanding (its tags would repeat).
    let refused = match &ctx {
        Some(w) if w.gone.load(Ordering::SeqCst) => Some(Refused::Ended { handler: key }),
        Some(_) if posting.tags_wrap() => Some(Refused::ContextTagsWrap {
            handler: key,
            queue: account.number(),
        }),
        _ => None,
    };
    // The send queue's room: a list that would overfill it is refused
    // whole, before the device sees it, and the caller may post it again
    // once completions have freed slots.
    let refused = match refused {
        Some(r) => Some(r),
        None => posting
            .room(wrs.len())
            .err()
            .map(|(depth, outstanding)| Refused::Full {
                qp_num: account.number(),
                depth,
                outstanding,
                posting: wrs.len(),
            }),
    };
    let refused = match refused {
        Some(r) => Some(r),
        None => posting
            .take_credits(wrs.len() as u32)
            .err()
            .map(Refused::Credits),
    };
    if let Some(refused) = refused {
        drop(posting);
        for k in OpKind::ALL {
            if per_kind[k.index()] > 0 {
                slot.sub_posted(k, per_kind[k.index()]);
            }
        }
        reg.taken_back();
        restore(wrs);
        return Err(refused.into());
    }
    // 4. Record them in the queue's account and publish them (R1–R2 of
    // `account::ring`), before the backend's post: a completion that
    // arrives inside it finds them.
    let now = crate::account::stamp_now();
    match ctx.as_deref_mut() {
        None => {
            for wr in wrs.iter() {
                posting.write_stamped(wr.wr_id(), now, signaled(wr));
            }
        }
        Some(w) => {
            // A request with a context is tagged with its position (unique
            // among the queue's outstanding requests, R1), and its word
            // written beside its entry.
            for (wr, &word) in wrs.iter_mut().zip(w.words) {
                let id = (wr.wr_id() & !TAG_MASK) | (posting.next_pos() & TAG_MASK);
                wr.set_wr_id(id);
                posting.write_ctx(id, now, signaled(wr), word);
            }
        }
    }
    posting.publish();
    // 5. Post (R3), still holding the posting lock.
    let Err((posted, err)) = raw(wrs) else {
        posting.commit();
        if let Some(w) = ctx {
            w.back.fill(false);
        }
        return Ok(());
    };
    // 6. Take back what was not posted (R4): tombstone its entries, give
    // back their credits, then their ledger counts and tags.
    // A request past `bad_wr` that a completion retired first (only a
    // foreign wr_id equal to it can do that) counts as posted.
    let posted = posted.min(wrs.len());
    let mut back = ctx.map(|w| &mut *w.back);
    if let Some(b) = back.as_deref_mut() {
        b[..posted].fill(false);
    }
    posting.settle(posted, |i, taken_back| {
        if taken_back {
            let wr = &mut wrs[i];
            slot.sub_posted(kind(wr), 1);
            wr.set_wr_id(wr.wr_id() & TAG_MASK);
        }
        // R4: a tombstone that won gives the word back; a claim that won
        // took it with the entry.
        if let Some(b) = back.as_deref_mut() {
            b[i] = taken_back;
        }
    });
    reg.taken_back();
    Err(err)
}
