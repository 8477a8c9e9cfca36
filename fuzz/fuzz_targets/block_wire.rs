//! The demo's block protocol (`cqd_demo::wire`): any bytes decode as a
//! request or a reply, or give a reason, never a panic; what decodes
//! encodes back to the very bytes (the format has one encoding: reserved
//! bytes are zero, every field is fixed); a request's salvage (the slot and
//! id the server answers a malformed request with) agrees with its decode;
//! a reply made for a decoded request decodes back to itself.
#![no_main]

use cqd_demo::wire::{Reply, ReplyStatus, Request, MSG_LEN};
use libfuzzer_sys::fuzz_target;

const STATUSES: [ReplyStatus; 5] = [
    ReplyStatus::Ok,
    ReplyStatus::OutOfRange,
    ReplyStatus::BadLength,
    ReplyStatus::Malformed,
    ReplyStatus::SlotBusy,
];

fuzz_target!(|input: (&[u8], u8)| {
    let (bytes, status) = input;
    let salvaged = Request::salvage(bytes);
    if let Ok(req) = Request::decode(bytes) {
        assert_eq!(bytes.len(), MSG_LEN);
        assert_eq!(
            &req.encode()[..],
            bytes,
            "a request encodes back to its bytes"
        );
        assert_eq!(
            salvaged,
            Some((req.slot, req.id)),
            "salvage agrees with decode"
        );
        let status = STATUSES[usize::from(status) % STATUSES.len()];
        let reply = Reply::to(&req, status);
        let back = Reply::decode(&reply.encode()).expect("a reply made here decodes");
        assert_eq!(back, reply);
    } else if bytes.len() != MSG_LEN {
        assert_eq!(salvaged, None, "salvage needs a whole message");
    }
    if let Ok(reply) = Reply::decode(bytes) {
        assert_eq!(
            &reply.encode()[..],
            bytes,
            "a reply encodes back to its bytes"
        );
    }
});
