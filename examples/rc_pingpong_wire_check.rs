//! Temporary: exercises `rc_pingpong/wire.rs` (its unit tests run with
//! `cargo test --example rc_pingpong_wire_check`) and does the TCP exchange
//! of `ibv_rc_pingpong` with a made-up address, no RDMA:
//!
//! ```text
//! cargo run --example rc_pingpong_wire_check -- [options]          # server
//! cargo run --example rc_pingpong_wire_check -- [options] <host>   # client
//! ```

#[path = "rc_pingpong/wire.rs"]
mod wire;

use std::time::Instant;

fn main() {
    let argv0 = std::env::args().next().unwrap_or_default();
    let o = match wire::parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{argv0}: {e}");
            print!("{}", wire::usage(&argv0));
            std::process::exit(1);
        }
    };
    println!(
        "device {:?} port {} size {} mtu {} rx_depth {} iters {} sl {} events {} gid {:?}",
        o.ib_dev,
        o.ib_port,
        o.size,
        o.mtu,
        o.rx_depth,
        o.iters,
        o.sl,
        o.events,
        o.gid_index()
    );
    let seed = std::process::id() ^ Instant::now().elapsed().subsec_nanos();
    let local = wire::WireDest {
        lid: 1,
        qpn: seed & 0xff_ffff,
        psn: seed.wrapping_mul(2_654_435_761) & 0xff_ffff,
        gid: [0; 16],
    };
    println!("{}", wire::address_line(true, &local));
    let start = Instant::now();
    let res = match &o.server_name {
        Some(host) => wire::client_exchange(host, o.port, &local),
        None => wire::server_exchange(o.port, &local, |r| {
            println!("connect QP (GRH: {})", r.needs_grh());
            Ok(())
        }),
    };
    let remote = match res {
        Ok((_stream, remote)) => remote,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    println!("{}", wire::address_line(false, &remote));
    let mut buf = vec![wire::INITIAL_FILL; o.size as usize];
    if o.chk {
        wire::fill_check_pattern(&mut buf, 4096);
        for page in wire::check_pattern(&buf, 4096) {
            println!("invalid data in page {page}");
        }
    }
    println!("wr ids recv {} send {}", wire::RECV_WRID, wire::SEND_WRID);
    println!(
        "{}",
        wire::summary(o.size, o.iters, start.elapsed().as_micros() as u64)
    );
}
