//! The posting call's body: steps 1–6 of [`crate::post`] for one list, on a
//! handler's [`Registration`].

use crate::account::QueueAccount;
use crate::cq::Registration;
use crate::post::{Invalid, Refused, WorkRequest};
use crate::wr_id::{OpKind, TAG_MASK};

/// Puts the tags back in the wr_id fields of `wrs` (encoded by step 1).
fn restore<R: WorkRequest>(wrs: &mut [R]) {
    for wr in wrs {
        wr.set_wr_id(wr.wr_id() & TAG_MASK);
    }
}

/// Steps 1–6 of the module documentation for one list.
pub(crate) fn post<R, E>(
    reg: &Registration,
    account: &QueueAccount,
    wrs: &mut [R],
    kind: impl Fn(&R) -> OpKind,
    signaled: impl Fn(&R) -> bool,
    check: impl Fn(&R) -> Result<(), Invalid>,
    raw: impl FnOnce(&[R]) -> Result<(), (usize, E)>,
) -> Result<(), E>
where
    R: WorkRequest,
    E: From<Refused>,
{
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
    if let Err(e) = posting.take_credits(wrs.len() as u32) {
        drop(posting);
        for k in OpKind::ALL {
            if per_kind[k.index()] > 0 {
                slot.sub_posted(k, per_kind[k.index()]);
            }
        }
        reg.taken_back();
        restore(wrs);
        return Err(Refused::Credits(e).into());
    }
    // 4. Record them in the queue's account and publish them (R1–R2 of
    // `account::ring`), before the backend's post: a completion that
    // arrives inside it finds them.
    let now = crate::account::stamp_now();
    for wr in wrs.iter() {
        posting.write_stamped(wr.wr_id(), now, signaled(wr));
    }
    posting.publish();
    // 5. Post (R3), still holding the posting lock.
    let Err((posted, err)) = raw(wrs) else {
        posting.commit();
        return Ok(());
    };
    // 6. Take back what was not posted (R4): tombstone its entries, give
    // back their credits, then their ledger counts and tags.
    // A request past `bad_wr` that a completion retired first (only a
    // foreign wr_id equal to it can do that) counts as posted.
    let posted = posted.min(wrs.len());
    posting.settle(posted, |i, taken_back| {
        if taken_back {
            let wr = &mut wrs[i];
            slot.sub_posted(kind(wr), 1);
            wr.set_wr_id(wr.wr_id() & TAG_MASK);
        }
    });
    reg.taken_back();
    Err(err)
}
