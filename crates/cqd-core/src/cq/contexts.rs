//! A registered [`ContextHandler`](crate::context::ContextHandler)'s posting
//! side: one context per request in, and back out of a refused post
//! (`crate::context` has the protocol).

use std::fmt;
use std::sync::Arc;

use crate::context::{from_word, in_ring, to_word, Shared, Table};
use crate::post::{PostRecv, PostSend, Refused, WorkRequest};
use crate::sync::Ordering;
use crate::wr_id::{HandlerKey, MAX_TAG, TAG_MASK};

use super::posting::Words;

/// A registered [`ContextHandler`](crate::context::ContextHandler): its posting calls take one context per
/// request. Cloneable and `Sync` like a [`Registration`](super::Registration);
/// it has no tag-based posting call, so no request of this handler can
/// name a slot it did not fill.
pub struct ContextRegistration<C> {
    pub(crate) reg: super::Registration,
    /// The table, for a context too large for the ring.
    pub(crate) table: Option<Arc<Table<C>>>,
    pub(crate) shared: Arc<Shared>,
    /// The capacity registered.
    pub(crate) capacity: u32,
}

impl<C> Clone for ContextRegistration<C> {
    fn clone(&self) -> Self {
        ContextRegistration {
            reg: self.reg.clone(),
            table: self.table.clone(),
            shared: Arc::clone(&self.shared),
            capacity: self.capacity,
        }
    }
}

impl<C> fmt::Debug for ContextRegistration<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextRegistration")
            .field("key", &self.reg.key())
            .field(
                "capacity",
                &self.table.as_ref().map_or(self.capacity, |t| t.capacity()),
            )
            .field("in_ring", &self.table.is_none())
            .finish()
    }
}

/// A post refused, with the contexts of the requests that were not posted.
pub struct PostRefused<E, C, const N: usize> {
    /// Why.
    pub error: E,
    /// The contexts handed back: `Some` for each request that was not
    /// posted (verbs: from `bad_wr` on; a refusal before the device: all),
    /// `None` for those posted (their contexts come back with their
    /// completions).
    pub back: [Option<C>; N],
}

impl<E: fmt::Display, C, const N: usize> fmt::Display for PostRefused<E, C, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.back.iter().filter(|c| c.is_some()).count();
        write!(f, "{} ({n} of {N} requests not posted)", self.error)
    }
}

impl<E: fmt::Debug, C, const N: usize> fmt::Debug for PostRefused<E, C, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let back: Vec<bool> = self.back.iter().map(Option::is_some).collect();
        f.debug_struct("PostRefused")
            .field("error", &self.error)
            .field("back", &back)
            .finish()
    }
}

impl<E: std::error::Error + 'static, C, const N: usize> std::error::Error for PostRefused<E, C, N> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<C: Send + 'static> ContextRegistration<C> {
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.reg.key()
    }

    /// The handler's ledger (posted, completed, flushed per kind).
    pub fn ledger(&self) -> &crate::slab::SlotLedger {
        self.reg.ledger()
    }

    /// The most requests this handler can have outstanding. A context of
    /// more than 8 bytes lives in a table: its slots, the capacity
    /// registered and up to 15 that the poller returns in groups. A
    /// smaller one travels in its queue's ring and needs no slot: the
    /// capacity registered, which nothing enforces (the CQ's credits and
    /// the queues' depths bound what is outstanding).
    pub fn capacity(&self) -> u32 {
        self.table.as_ref().map_or(self.capacity, |t| t.capacity())
    }

    /// True when this handler's contexts travel in their queues' rings
    /// (a type of at most 8 bytes: an integer, a `Box`, an `Arc`), false
    /// when they live in a table.
    pub fn in_ring(&self) -> bool {
        self.table.is_none()
    }

    /// Completions that carried no context of this handler (a foreign or
    /// corrupted wr_id): not delivered, counted here and traced.
    pub fn empty_hits(&self) -> u64 {
        match &self.table {
            Some(t) => t.empty_hits.load(Ordering::Relaxed),
            None => self.shared.empty_hits.load(Ordering::Relaxed),
        }
    }

    /// Posts `wrs` on `qp`'s send queue, request `i` carrying `ctxs[i]`,
    /// through the posting call ([`Registration::post_send`](super::Registration::post_send)).
    /// The requests' wr_id fields are set by the call (the tag is the
    /// request's position on its queue, or its context's table slot).
    ///
    /// # Errors
    /// The posting call's errors; [`Refused::Contexts`] when a table
    /// has fewer than `N` free slots; [`Refused::Ended`] once the handler's
    /// poller has stopped; [`Refused::ContextTagsWrap`] (see there).
    /// [`PostRefused::back`] holds the contexts of the requests that were
    /// not posted.
    pub fn post_send<Q: PostSend + ?Sized, const N: usize>(
        &self,
        qp: &Q,
        wrs: &mut [Q::Wr<'_>; N],
        ctxs: [C; N],
    ) -> Result<(), PostRefused<Q::Error, C, N>> {
        if in_ring::<C>() {
            return self.post_in_ring(wrs, ctxs, |wrs, words| {
                self.reg.post_send_with(qp, wrs, Some(words))
            });
        }
        self.fill(wrs, ctxs)?;
        let result = self.reg.post_send(qp, wrs);
        self.settle(wrs, result)
    }

    /// As [`post_send`](Self::post_send), on a receive queue (a QP's, or an
    /// SRQ).
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn post_recv<Q: PostRecv + ?Sized, const N: usize>(
        &self,
        queue: &Q,
        wrs: &mut [Q::Wr<'_>; N],
        ctxs: [C; N],
    ) -> Result<(), PostRefused<Q::Error, C, N>> {
        if in_ring::<C>() {
            return self.post_in_ring(wrs, ctxs, |wrs, words| {
                self.reg.post_recv_with(queue, wrs, Some(words))
            });
        }
        self.fill(wrs, ctxs)?;
        let result = self.reg.post_recv(queue, wrs);
        self.settle(wrs, result)
    }

    /// A list whose contexts travel in the ring: each moves into a word,
    /// which the posting call writes beside its request's entry (R1); the
    /// words it hands back (refused, or tombstoned at R4) move back into
    /// contexts for the caller.
    #[inline]
    fn post_in_ring<R: WorkRequest, E, const N: usize>(
        &self,
        wrs: &mut [R; N],
        ctxs: [C; N],
        post: impl FnOnce(&mut [R; N], &mut Words<'_>) -> Result<(), E>,
    ) -> Result<(), PostRefused<E, C, N>> {
        for wr in wrs.iter_mut() {
            // The tag is the request's position, set under the posting
            // lock.
            wr.set_wr_id(0);
        }
        let words = ctxs.map(to_word);
        let mut back = [true; N];
        let result = post(
            wrs,
            &mut Words {
                words: &words,
                back: &mut back,
                gone: &self.shared.gone,
            },
        );
        let Err(error) = result else {
            return Ok(());
        };
        Err(PostRefused {
            error,
            // SAFETY: each word was made from a `C` just above; the call
            // says which are the caller's again (`back`), the others are
            // their entries' now and are not touched here.
            back: std::array::from_fn(|i| back[i].then(|| unsafe { from_word::<C>(words[i]) })),
        })
    }

    /// Steps 1–2 for a list: each context into a slot, the slot's index into
    /// its request's wr_id field. All or nothing.
    fn fill<R: WorkRequest, E: From<Refused>, const N: usize>(
        &self,
        wrs: &mut [R; N],
        ctxs: [C; N],
    ) -> Result<(), PostRefused<E, C, N>> {
        let mut back: [Option<C>; N] = [const { None }; N];
        let Some(table) = &self.table else {
            unreachable!("a table is made for every context too large for the ring")
        };
        let mut ctxs = ctxs.into_iter();
        for i in 0..N {
            let Some(ctx) = ctxs.next() else { break };
            match table.put(ctx) {
                Ok(index) => wrs[i].set_wr_id(u64::from(index)),
                Err(ctx) => {
                    back[i] = Some(ctx);
                    for (j, ctx) in ctxs.enumerate() {
                        back[i + 1 + j] = Some(ctx);
                    }
                    for (j, wr) in wrs.iter().enumerate().take(i) {
                        back[j] = table.take(wr.wr_id() as u32);
                    }
                    let error = Refused::Contexts {
                        handler: self.reg.key(),
                        capacity: table.capacity(),
                    };
                    return Err(PostRefused {
                        error: error.into(),
                        back,
                    });
                }
            }
        }
        Ok(())
    }

    /// After the posting call: the contexts of requests it did not post
    /// (their wr_id fields hold their tags again, unencoded) go back to the
    /// caller (step 3 by the poster).
    fn settle<R: WorkRequest, E, const N: usize>(
        &self,
        wrs: &[R; N],
        result: Result<(), E>,
    ) -> Result<(), PostRefused<E, C, N>> {
        let Err(error) = result else {
            return Ok(());
        };
        let mut back: [Option<C>; N] = [const { None }; N];
        let Some(table) = &self.table else {
            return Err(PostRefused { error, back });
        };
        for (wr, b) in wrs.iter().zip(back.iter_mut()) {
            let id = wr.wr_id();
            if id <= u64::from(MAX_TAG) && id & TAG_MASK == id {
                *b = table.take(id as u32);
            }
        }
        Err(PostRefused { error, back })
    }
}
