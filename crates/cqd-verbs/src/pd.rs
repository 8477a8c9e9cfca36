//! Protection domains and memory regions.
//!
//! A [`Mr`] owns its buffer: memory the device may write at any time is
//! never handed out as a Rust reference, only copied in and out
//! ([`Mr::read`], [`Mr::write`]) or named by address ([`Mr::sge`],
//! [`Mr::remote`]). Every queue that posts a request naming a region keeps
//! the region (registration and buffer) alive until that queue is
//! destroyed, which is after the request's last completion, flush
//! included: dropping a `Mr` while requests are in flight is safe.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::device::{Context, ContextInner};
use crate::error::VerbsError;
use crate::sys;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<sys::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: verbs objects may be used from any thread; the pointer is only
// used through `sys`.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every object of the domain holds an `Arc` to it: all gone.
        if let Err(e) = unsafe { sys::dealloc_pd(self.pd) } {
            tracing::error!(device = %self.ctx.name, error = %e, "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain. Cloning is cheap; it is deallocated when the last
/// clone and the last object made in it are gone.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pd")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

impl Pd {
    pub(crate) fn new(ctx: &Context) -> Result<Pd, VerbsError> {
        ctx.inner.check()?;
        // SAFETY: the context is open while `ctx` lives.
        let pd = unsafe { sys::alloc_pd(ctx.inner.ctx) }
            .map_err(|e| VerbsError::verb("ibv_alloc_pd", ctx.inner.name.clone(), e))?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                pd,
                ctx: Arc::clone(&ctx.inner),
            }),
        })
    }

    /// The device the domain belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.inner.ctx),
        }
    }

    /// Allocates `len` zeroed bytes (page-aligned) and registers them with
    /// `access`.
    ///
    /// # Errors
    /// [`VerbsError::Invalid`] for `len == 0`; `ibv_reg_mr` failed (EINVAL
    /// for remote write or atomic access without local write, as verbs
    /// requires).
    pub fn reg_mr(&self, len: u64, access: Access) -> Result<Mr, VerbsError> {
        self.inner.ctx.check()?;
        let len = usize::try_from(len).map_err(|_| {
            VerbsError::Invalid(format!(
                "a region of {len} bytes does not fit this address space"
            ))
        })?;
        if len == 0 {
            return Err(VerbsError::Invalid(
                "a memory region needs at least one byte".into(),
            ));
        }
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| VerbsError::Invalid(format!("memory region of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let buf = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| VerbsError::Invalid(format!("could not allocate {len} bytes")))?;
        // SAFETY: `buf` is `len` bytes we own until `MrInner`'s drop, which
        // deregisters before it frees.
        let mr = match unsafe { sys::reg_mr(self.inner.pd, buf.as_ptr(), len, access.0) } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above with this layout, never shared.
                unsafe { std::alloc::dealloc(buf.as_ptr(), layout) };
                return Err(VerbsError::verb(
                    "ibv_reg_mr",
                    format!("{len} bytes, access {:#x}", access.0),
                    e,
                ));
            }
        };
        // SAFETY: `mr` is live.
        let (lkey, rkey) = unsafe { (mr.as_ref().lkey, mr.as_ref().rkey) };
        Ok(Mr {
            inner: Arc::new(MrInner {
                mr,
                buf,
                layout,
                lkey,
                rkey,
                access,
                pd: Arc::clone(&self.inner),
            }),
        })
    }

    /// The raw `ibv_pd`, for verbs cqd does not wrap.
    pub fn as_raw(&self) -> *mut sys::ibv_pd {
        self.inner.pd.as_ptr()
    }
}

/// Access flags of a memory region or a QP (`ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access(pub u32);

impl Access {
    /// `IBV_ACCESS_LOCAL_WRITE`: the device may write (receives, RDMA READ
    /// destinations).
    pub const LOCAL_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// `IBV_ACCESS_REMOTE_WRITE`
    pub const REMOTE_WRITE: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    /// `IBV_ACCESS_REMOTE_READ`
    pub const REMOTE_READ: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// `IBV_ACCESS_REMOTE_ATOMIC`
    pub const REMOTE_ATOMIC: Access = Access(sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0);
    /// A region memory windows may be bound to (`IBV_ACCESS_MW_BIND`); it
    /// grants no peer anything by itself.
    pub const MW_BIND: Access = Access(sys::ibv_access_flags::IBV_ACCESS_MW_BIND.0);
    /// Local write, remote read and write.
    pub const ALL_RDMA: Access =
        Access(Self::LOCAL_WRITE.0 | Self::REMOTE_WRITE.0 | Self::REMOTE_READ.0);
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

pub(crate) struct MrInner {
    mr: NonNull<sys::ibv_mr>,
    buf: NonNull<u8>,
    layout: Layout,
    pub(crate) lkey: u32,
    rkey: u32,
    access: Access,
    pd: Arc<PdInner>,
}

// SAFETY: the buffer is only accessed through atomics (`Mr::split`), and
// by the device; the MR handle is used only to deregister it once.
unsafe impl Send for MrInner {}
// SAFETY: as above.
unsafe impl Sync for MrInner {}

impl Drop for MrInner {
    fn drop(&mut self) {
        // SAFETY: the last holder is gone: no queue that posted with this
        // region exists any more (each holds an `Arc`), so the device is
        // done with it.
        if let Err(e) = unsafe { sys::dereg_mr(self.mr) } {
            tracing::error!(device = %self.pd.ctx.name, error = %e, "ibv_dereg_mr failed; the buffer is leaked");
            return;
        }
        // SAFETY: allocated in `reg_mr` with this layout, deregistered above.
        unsafe { std::alloc::dealloc(self.buf.as_ptr(), self.layout) };
    }
}

/// A registered memory region that owns its buffer. Cloning is cheap (a
/// handle to the same region).
#[derive(Clone)]
pub struct Mr {
    pub(crate) inner: Arc<MrInner>,
}

impl fmt::Debug for Mr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

/// Out of line: the panic of a range outside a region (the constructors of
/// SGEs and remote addresses stay inline on the posting path).
#[cold]
#[inline(never)]
#[track_caller]
fn outside(offset: usize, len: usize, size: usize) -> ! {
    panic!("{len} bytes at offset {offset} are outside the {size}-byte memory region")
}

impl Mr {
    /// The buffer's address.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.inner.buf.as_ptr() as u64
    }

    /// The buffer's length.
    #[inline]
    pub fn len(&self) -> usize {
        self.inner.layout.size()
    }

    /// Always false (regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The local key.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// The remote key.
    #[inline]
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// The access the region was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    #[inline]
    #[track_caller]
    fn check(&self, offset: usize, len: usize) {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            outside(offset, len, self.len());
        }
    }

    /// A scatter/gather entry for `len` bytes at `offset`.
    ///
    /// # Panics
    /// When the range is outside the region (a programming error, like a
    /// slice index).
    #[inline]
    #[track_caller]
    pub fn sge(&self, offset: usize, len: u32) -> Sge<'_> {
        self.check(offset, len as usize);
        Sge {
            addr: self.addr() + offset as u64,
            len,
            mr: self,
        }
    }

    /// The remote address of `offset`, for a peer's RDMA READ or WRITE.
    ///
    /// # Panics
    /// When `offset` is outside the region.
    #[inline]
    #[track_caller]
    pub fn remote(&self, offset: usize) -> RemoteAddr {
        self.check(offset, 0);
        RemoteAddr {
            addr: self.addr() + offset as u64,
            rkey: self.rkey(),
        }
    }

    /// Copies `out.len()` bytes from `offset` out of the region.
    ///
    /// The region is shared (the device, other threads holding a clone):
    /// copies are made with relaxed atomic loads and stores, so concurrent
    /// access to the same bytes gives unspecified (possibly torn) contents,
    /// never undefined behaviour. Ordering them is the application's
    /// protocol (a completion, a message).
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        let (head, words, tail) = self.split(offset, out.len());
        let (o_head, rest) = out.split_at_mut(head.len());
        let (o_words, o_tail) = rest.split_at_mut(words.len() * 8);
        for (d, s) in o_head.iter_mut().zip(head) {
            *d = s.load(Ordering::Relaxed);
        }
        for (d, s) in o_words.chunks_exact_mut(8).zip(words) {
            d.copy_from_slice(&s.load(Ordering::Relaxed).to_ne_bytes());
        }
        for (d, s) in o_tail.iter_mut().zip(tail) {
            *d = s.load(Ordering::Relaxed);
        }
    }

    /// Copies `data` into the region at `offset` (see [`read`](Self::read)
    /// for concurrent access).
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        let (head, words, tail) = self.split(offset, data.len());
        let (d_head, rest) = data.split_at(head.len());
        let (d_words, d_tail) = rest.split_at(words.len() * 8);
        for (s, d) in d_head.iter().zip(head) {
            d.store(*s, Ordering::Relaxed);
        }
        for (s, d) in d_words.chunks_exact(8).zip(words) {
            let mut b = [0u8; 8];
            b.copy_from_slice(s);
            d.store(u64::from_ne_bytes(b), Ordering::Relaxed);
        }
        for (s, d) in d_tail.iter().zip(tail) {
            d.store(*s, Ordering::Relaxed);
        }
    }

    /// Fills `len` bytes at `offset` with `byte`.
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        self.check(offset, len);
        let (head, words, tail) = self.split(offset, len);
        let word = u64::from_ne_bytes([byte; 8]);
        for d in head.iter().chain(tail) {
            d.store(byte, Ordering::Relaxed);
        }
        for d in words {
            d.store(word, Ordering::Relaxed);
        }
    }

    /// `len` bytes at `offset` (in range) as atomics: unaligned head
    /// bytes, aligned 8-byte words, tail bytes.
    fn split(&self, offset: usize, len: usize) -> (&[AtomicU8], &[AtomicU64], &[AtomicU8]) {
        let base = self.inner.buf.as_ptr();
        // SAFETY: `offset` is inside the buffer (checked by the caller).
        let start = unsafe { base.add(offset) };
        let head_len = start.align_offset(8).min(len);
        let words = (len - head_len) / 8;
        let tail_len = len - head_len - words * 8;
        // SAFETY: the three ranges partition `offset..offset + len`, inside
        // the live buffer (checked by the caller); the words are 8-aligned.
        // The buffer is only ever accessed through atomics from Rust (the
        // device's writes are outside Rust's memory model), so atomic views
        // of it are sound; `AtomicU8`/`AtomicU64` have the layout of
        // `u8`/`u64`.
        unsafe {
            (
                std::slice::from_raw_parts(start.cast::<AtomicU8>(), head_len),
                if words == 0 {
                    // The pointer may be unaligned when no word fits.
                    &[]
                } else {
                    std::slice::from_raw_parts(start.add(head_len).cast::<AtomicU64>(), words)
                },
                std::slice::from_raw_parts(
                    start.add(head_len + words * 8).cast::<AtomicU8>(),
                    tail_len,
                ),
            )
        }
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v);
        v
    }

    /// The raw `ibv_mr`.
    pub fn as_raw(&self) -> *mut sys::ibv_mr {
        self.inner.mr.as_ptr()
    }

    pub(crate) fn same_pd(&self, pd: &Arc<PdInner>) -> bool {
        Arc::ptr_eq(&self.inner.pd, pd)
    }
}

/// A scatter/gather entry: bytes of a registered region. It borrows the
/// region, so a request cannot name memory that is not registered.
#[derive(Debug, Clone, Copy)]
pub struct Sge<'a> {
    /// Address.
    pub(crate) addr: u64,
    /// Length.
    pub(crate) len: u32,
    /// The region.
    pub(crate) mr: &'a Mr,
}

impl Sge<'_> {
    /// The address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The length.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True for a zero-length entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn raw(&self) -> sys::ibv_sge {
        sys::ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.mr.lkey(),
        }
    }
}

/// A peer's memory, as its region's address and remote key.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub struct RemoteAddr {
    /// The address in the peer's space.
    pub addr: u64,
    /// The peer region's remote key.
    pub rkey: u32,
}

impl RemoteAddr {
    /// `offset` bytes further.
    pub fn offset(self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            // A peer's address: never a panic (a wrapped address is the
            // peer's to refuse with a remote access error).
            addr: self.addr.wrapping_add(offset),
            rkey: self.rkey,
        }
    }
}
