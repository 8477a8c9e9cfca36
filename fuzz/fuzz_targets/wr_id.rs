//! wr_id decoding: any 64-bit value the device hands back decodes without a
//! panic, and what decodes re-encodes to the same value; making a wr_id
//! from any (slot, generation, kind, tag) either fails with an error or
//! round-trips.
#![no_main]

use cqd_core::wr_id::{Malformed, MAGIC, MAGIC_MASK, MAGIC_SHIFT, MAX_TAG};
use cqd_core::{HandlerKey, OpKind, WrId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, u32, u16, u8, u32)| {
    let (raw, slot, generation, code, tag) = input;

    // Any value from the device.
    match WrId::decode(raw) {
        Ok(w) => {
            assert_eq!(w.encode(), raw, "decode then encode changed {raw:#x}");
            assert!(w.tag <= MAX_TAG);
            assert_eq!(w.kind.side(), OpKind::ALL[w.kind.index()].side());
        }
        Err(Malformed::Foreign) => assert_ne!((raw >> MAGIC_SHIFT) & MAGIC_MASK, MAGIC),
        Err(Malformed::BadKind(c)) => {
            assert_eq!((raw >> MAGIC_SHIFT) & MAGIC_MASK, MAGIC);
            assert!(OpKind::from_code(c).is_none(), "kind code {c} refused");
        }
        Err(e) => panic!("unexpected decode error {e:?}"),
    }

    // Any fields an application asks for.
    let Some(kind) = OpKind::from_code(code) else {
        return;
    };
    let Some(key) = HandlerKey::new(slot, generation) else {
        return;
    };
    match key.wr_id(kind, tag) {
        Ok(raw) => {
            let w = WrId::decode(raw).expect("a wr_id cqd made decodes");
            assert_eq!((w.kind, w.key, w.tag), (kind, key, tag));
        }
        Err(_) => assert!(tag > MAX_TAG, "tag {tag} refused though it fits"),
    }
});
