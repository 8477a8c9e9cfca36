//! softverbs fed arbitrary work requests — through its validation layer.
//!
//! The provider's verbs (`post_send`, `post_recv`) run only inside a
//! process that libibverbs loaded the provider into, under the launcher's
//! private mount namespace (fake sysfs), so a fuzzer cannot call them
//! in-process. This target drives the same code they call, with no FFI:
//!
//! - `post_send`'s checks before execution: the opcode for the QP type,
//!   the gather-list length against the QP's `max_send_sge` and MAX_SGE,
//!   inline data against `max_inline_data` (`shape_ok`, `inline_ok`);
//! - the requester's check of the gather list against a context's MR
//!   table (`local_check`, over a table laid out as in the context
//!   segment), with arbitrary lkeys, PDs, addresses, lengths and access;
//! - `recv_wqe`, which copies a receive's scatter list, with any `num_sge`
//!   (negative, above the QP's cap, above MAX_SGE);
//! - the cross-process ring (`shm::ring`) under any sequence of pushes and
//!   pops, against a queue model;
//! - the QP state machine (`transition_ok`, `attrs_ok`) for any pair of
//!   raw states, any type and any attribute mask.
//!
//! Each result is checked against an oracle written here from the verbs
//! rules, not from the code: no panic, a refused request is refused for a
//! reason the rules give, an accepted one breaks none.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use softverbs::model::qp::{attrs_ok, transition_ok, QpState, QpType, ATTR_STATE};
use softverbs::model::wc::{access, send_flags, wr};
use softverbs::provider::qp::{recv_wqe, Caps};
use softverbs::provider::send::{inline_ok, local_check, shape_ok};
use softverbs::shm::layout::{
    key_index, mr_lookup, mr_publish, mr_table, MrInfo, Sge, CTX_BYTES, MAX_SGE,
};
use softverbs::shm::ring::Ring;

#[derive(Arbitrary, Debug)]
struct Region {
    key: u32,
    pd: u8,
    access: u8,
    addr: u64,
    len: u64,
}

#[derive(Arbitrary, Debug)]
struct SgeIn {
    /// Index of a registered region (its key), or a key of its own.
    region: Result<u8, u32>,
    addr: u64,
    length: u32,
}

#[derive(Arbitrary, Debug)]
struct Input {
    regions: Vec<Region>,
    qp_type: u8,
    pd: u8,
    opcode: u32,
    flags: u32,
    max_send_sge: u8,
    max_recv_sge: u8,
    max_inline: u16,
    sges: Vec<SgeIn>,
    num_sge: i32,
    ring_cap: u8,
    ring_ops: Vec<Option<u64>>,
    states: (u32, u32),
    mask: i32,
}

/// The QP whose sends are checked (regions name no QP: any may use them).
const QPN: u32 = 7;

fuzz_target!(|input: Input| {
    // The context segment's MR table, every slot free, then the regions.
    let mut seg = vec![0u64; CTX_BYTES / 8 + 1];
    // SAFETY: `seg` is CTX_BYTES long, 8-byte aligned, zeroed (all slots
    // free) and outlives `mrs`; MrSlot is atomics, valid for any bits.
    let mrs = unsafe { mr_table(seg.as_mut_ptr().cast()) };
    let mut keys = Vec::new();
    for r in input.regions.iter().take(16) {
        let key = r.key | 1;
        let slot = &mrs[key_index(key)];
        let mut info = MrInfo::at(u32::from(r.pd % 4), u32::from(r.access % 16), r.addr, r.len);
        // Some regions are named by an I/O virtual address of their own
        // (ibv_reg_mr_iova): users' addresses are translated.
        if key & 0x100 != 0 {
            info.iova = r.addr.wrapping_add(0x10000);
        }
        mr_publish(slot, key, info);
        keys.push(key);
    }
    let sges: Vec<Sge> = input
        .sges
        .iter()
        .take(MAX_SGE + 4)
        .map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: match s.region {
                Ok(i) if !keys.is_empty() => keys[usize::from(i) % keys.len()],
                Ok(_) => 0,
                Err(k) => k,
            },
        })
        .collect();
    let ty = [
        QpType::Rc,
        QpType::Uc,
        QpType::Ud,
        QpType::XrcSend,
        QpType::XrcRecv,
    ][usize::from(input.qp_type % 5)];
    let caps = Caps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: u32::from(input.max_send_sge % 12),
        max_recv_sge: u32::from(input.max_recv_sge % 12),
        max_inline: u32::from(input.max_inline),
    };
    let pd = u32::from(input.pd % 4);

    // post_send's shape checks.
    let shape = shape_ok(ty, &caps, input.opcode, sges.len());
    // ibv_post_send(3)'s table of operations per transport.
    let rc = input.opcode <= wr::SEND_WITH_INV || input.opcode == wr::ATOMIC_WRITE;
    let windows = matches!(
        input.opcode,
        wr::LOCAL_INV | wr::BIND_MW | wr::SEND_WITH_INV
    );
    let known = match ty {
        QpType::Rc => rc,
        QpType::Uc => input.opcode <= wr::SEND_WITH_IMM || windows,
        QpType::Ud => matches!(input.opcode, wr::SEND | wr::SEND_WITH_IMM),
        QpType::XrcSend => rc && !windows,
        QpType::XrcRecv => false,
    };
    assert_eq!(
        shape,
        known && sges.len() <= MAX_SGE && sges.len() <= caps.max_send_sge as usize,
        "shape of {ty:?} op {} with {} sges, cap {}",
        input.opcode,
        sges.len(),
        caps.max_send_sge
    );
    let inline_len: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
    let limit = u64::from(caps.max_inline.max(4096));
    assert_eq!(
        inline_ok(&caps, input.flags, &sges),
        input.flags & send_flags::INLINE == 0 || inline_len <= limit
    );
    if !shape {
        return ring_and_states(&input);
    }

    // The requester's check of the gather list.
    let writes = input.opcode == wr::RDMA_READ || wr::is_atomic(input.opcode);
    let inline = input.flags & send_flags::INLINE != 0 && !writes;
    let fine = |s: &Sge| {
        if inline || s.length == 0 {
            return true;
        }
        let Some(m) = mr_lookup(mrs, s.lkey) else {
            return false;
        };
        let end = s.addr.checked_add(u64::from(s.length));
        m.parent == 0
            && m.pd == pd
            && (m.qpn == 0 || m.qpn == QPN)
            && s.addr >= m.iova
            && end.is_some_and(|e| e <= m.iova.saturating_add(m.len))
            && (!writes || m.access & access::LOCAL_WRITE != 0)
    };
    let mut addrs = vec![0u64; sges.len()];
    match local_check(mrs, pd, QPN, input.opcode, input.flags, &sges, &mut addrs) {
        Some(total) => {
            assert!(sges.iter().all(fine), "accepted a bad gather list {sges:?}");
            assert_eq!(total, inline_len);
            for (s, &a) in sges.iter().zip(&addrs) {
                let want = match mr_lookup(mrs, s.lkey) {
                    Some(m) if !inline && s.length > 0 => m.translate(s.addr),
                    _ => s.addr,
                };
                assert_eq!(a, want, "the owner's address of {s:?}");
            }
        }
        None => assert!(!sges.iter().all(fine), "refused a good list {sges:?}"),
    }

    // recv_wqe with any num_sge up to the list it points to.
    let raw: Vec<rdma_sys_ibv_sge> = sges
        .iter()
        .map(|s| rdma_sys_ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect();
    let mut r: softverbs::sys::ibv::ibv_recv_wr =
        // SAFETY: a plain C struct, all-zero valid.
        unsafe { std::mem::zeroed() };
    r.wr_id = 42;
    r.sg_list = raw.as_ptr().cast_mut().cast();
    let n = input.num_sge.clamp(i32::MIN, raw.len() as i32);
    r.num_sge = n;
    // SAFETY: `sg_list` has at least `num_sge` entries (clamped above).
    let wqe = unsafe { recv_wqe(&r, caps.max_recv_sge) };
    let count = n.max(0) as usize;
    match wqe {
        Some(w) => {
            assert!(count <= MAX_SGE && count <= caps.max_recv_sge as usize);
            let got: Vec<_> = w
                .sges()
                .iter()
                .map(|s| (s.addr, s.length, s.lkey))
                .collect();
            let want: Vec<_> = sges[..count]
                .iter()
                .map(|s| (s.addr, s.length, s.lkey))
                .collect();
            assert_eq!(got, want);
        }
        None => assert!(count > MAX_SGE || count > caps.max_recv_sge as usize),
    }
    ring_and_states(&input);
});

use softverbs::sys::ibv::ibv_sge as rdma_sys_ibv_sge;

fn ring_and_states(input: &Input) {
    // The ring against a queue.
    #[repr(C, align(64))]
    struct Mem([u8; 8192]);
    let mut mem = Box::new(Mem([0; 8192]));
    let cap = Ring::<u64>::capacity_for(usize::from(input.ring_cap % 64));
    assert!(Ring::<u64>::bytes(cap) <= 8192);
    // SAFETY: 64-byte aligned, 8192 bytes (enough, checked), ours alone,
    // outlives the ring.
    let ring = unsafe { Ring::<u64>::init(mem.0.as_mut_ptr(), cap) };
    let mut model = std::collections::VecDeque::new();
    for op in input.ring_ops.iter().take(1024) {
        match op {
            Some(v) => match ring.push(*v) {
                Ok(()) => {
                    assert!(model.len() < cap, "pushed into a full ring");
                    model.push_back(*v);
                }
                Err(back) => {
                    assert_eq!(back, *v);
                    assert_eq!(model.len(), cap, "refused with room");
                }
            },
            None => assert_eq!(ring.pop(), model.pop_front()),
        }
        assert_eq!(ring.len(), model.len());
    }
    // SAFETY: the same memory, initialised above, still alive.
    let again = unsafe { Ring::<u64>::attach(mem.0.as_mut_ptr(), 8192) }.expect("attach");
    assert_eq!(again.capacity(), cap);
    while let Some(v) = model.pop_front() {
        assert_eq!(again.pop(), Some(v));
    }
    assert_eq!(again.pop(), None);

    // The state machine: any raw states, never a panic.
    if let (Some(from), Some(to)) = (
        QpState::from_u32(input.states.0),
        QpState::from_u32(input.states.1),
    ) {
        let ok = transition_ok(from, to);
        for ty in [
            QpType::Rc,
            QpType::Uc,
            QpType::Ud,
            QpType::XrcSend,
            QpType::XrcRecv,
        ] {
            // Never a panic; the state alone always fits a move to RESET
            // or ERR, and nothing the rules do not list is ever allowed.
            let _ = attrs_ok(ty, from, to, input.mask);
            if to == QpState::Reset || to == QpState::Err {
                assert!(
                    attrs_ok(ty, from, to, ATTR_STATE),
                    "{ty:?} {from:?} -> {to:?}"
                );
            }
            assert!(
                !attrs_ok(ty, from, to, ATTR_STATE | (1 << 30)),
                "an unknown attribute"
            );
        }
        // IBA 10.3.1: any state may go to RESET, any but RESET to ERR.
        if to == QpState::Reset || (to == QpState::Err && from != QpState::Reset) {
            assert!(ok, "{from:?} -> {to:?} must be allowed");
        }
        if from == QpState::Reset && to == QpState::Err {
            assert!(!ok, "RESET -> ERR is not a transition");
        }
    }
}
