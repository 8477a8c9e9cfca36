//! The demo's handshake parser and the server's judgement of it: any bytes
//! as a line either parse as a message or give a reason, never a panic; a
//! `hello` is judged against any limits, and one that is admitted fits
//! them; an `answer` or a `welcome`'s proof is checked against a secret
//! without a panic, and only the right value passes; every message that
//! parses serializes back to one that parses the same. A `sealed` message
//! is opened without a panic, and opens only if its MAC is the session's;
//! the same bytes as an rdma_cm request's private data are judged by the
//! CM gate without a panic, and pass only with the session's MAC.
#![no_main]

use cqd_demo::auth::{Direction, Secret, SessionKey, NONCE_LEN};
use cqd_demo::net::{
    judge_hello, judge_request, parse_message, Binding, Limits, Msg, Open, PROTOCOL, VERSION,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&[u8], u32, u32, u32, bool)| {
    let (line, block_size, depth, connections, rdmacm) = input;
    let (s, l) = ([7u8; NONCE_LEN], [9u8; NONCE_LEN]);
    let key = SessionKey::from_token(&l, &s);
    let from = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 4791)));
    let mut gate = [Binding::new(key.clone(), [127, 0, 0, 1].into(), connections)];
    if let Ok((0, conn)) = judge_request(&mut gate, line, from) {
        assert!(key.check_cm_mac(conn, &line[12..28]));
    }
    // The endpoint is opaque here: any JSON value.
    let msg = match parse_message::<serde_json::Value>(line) {
        Ok(m) => m,
        Err(reason) => {
            assert!(reason.starts_with("not a cqd-demo message"), "{reason}");
            return;
        }
    };
    let again = serde_json::to_vec(&msg).expect("a parsed message serializes");
    let back = parse_message::<serde_json::Value>(&again).expect("and parses again");
    assert_eq!(
        serde_json::to_value(&back).unwrap(),
        serde_json::to_value(&msg).unwrap()
    );
    let secret = Secret::from_bytes(b"the fuzz target's shared secret".to_vec()).unwrap();
    if let Msg::Sealed { seq, body, mac } = &msg {
        let mut open = Open::new(key.clone(), Direction::LoadToServer);
        if open.open(msg.clone()).is_ok() {
            assert_eq!(*seq, 0);
            assert!(key.check_control_mac(Direction::LoadToServer, 0, body.as_bytes(), mac));
        }
    }
    match &msg {
        Msg::Answer { mac } => {
            if secret.check_answer(&s, &l, mac) {
                assert!(mac.eq_ignore_ascii_case(&secret.answer(&s, &l)));
            }
        }
        Msg::Welcome { proof: Some(p), .. } => {
            if secret.check_proof(&l, &s, p) {
                assert!(p.eq_ignore_ascii_case(&secret.proof(&l, &s)));
            }
        }
        _ => {}
    }
    let limits = Limits {
        block_size,
        depth,
        connections,
        rdmacm,
    };
    if let Msg::Hello {
        protocol,
        version,
        block_size: b,
        qd,
        connections: c,
        ..
    } = &msg
    {
        let (protocol, version, b, qd, c) = (protocol.clone(), *version, *b, *qd, *c);
        if let Ok((n, _nonce)) = judge_hello(msg, &limits) {
            assert_eq!(protocol, PROTOCOL);
            assert_eq!(version, VERSION);
            assert_eq!(b, block_size);
            assert!(qd >= 1 && qd <= depth);
            assert!(c >= 1 && c <= connections && n == c);
        }
    } else {
        assert!(
            judge_hello(msg, &limits).is_err(),
            "only a hello is admitted"
        );
    }
});
