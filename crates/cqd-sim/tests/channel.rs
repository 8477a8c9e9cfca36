//! CQs of the simulated NIC on a shared completion channel
//! (`CqConfig::channel`, like `ibv_create_cq`'s `channel`): two rigs whose
//! CQs share one channel, served by one poller in every mode; each CQ's
//! completions reach its own handler and each CQ takes only its own
//! notifications.

mod common;

use std::time::{Duration, Instant};

use common::Rig;
use cqd_core::{NoSink, PollMode, PollerBuilder};
use cqd_sim::{CqConfig, Fabric, QpCap, SendWr, SimChannel, WrOp};

fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    cond()
}

#[test]
fn nic_cqs_on_one_channel_share_one_poller() {
    for mode in PollMode::all() {
        let chan = SimChannel::new().unwrap();
        let config = CqConfig {
            channel: Some(chan.clone()),
            ..CqConfig::default()
        };
        let mut rigs = [
            Rig::with(Fabric::inline(), QpCap::default(), 1024, config.clone()),
            Rig::with(Fabric::inline(), QpCap::default(), 1024, config),
        ];
        let mut b = PollerBuilder::new(mode.name(), NoSink).mode(mode);
        for r in &mut rigs {
            b = b.cq(r.take_poller());
        }
        let thread = b.spawn().unwrap();
        // Traffic on the second CQ only, then on the first only.
        for (which, n) in [(1usize, 10u64), (0, 5)] {
            let r = &rigs[which];
            let sge = [r.mr_a.sge(0, 8)];
            for t in 0..n {
                std::thread::sleep(Duration::from_millis(1));
                let mut wrs = [SendWr::new(t, WrOp::Write(r.mr_a.remote(0)), &sge)];
                r.reg.post_send(&r.a, &mut wrs).unwrap();
            }
        }
        assert!(
            wait_until(Duration::from_secs(5), || {
                rigs[0].log.0.lock().len() == 5 && rigs[1].log.0.lock().len() == 10
            }),
            "{}: {} and {} delivered",
            mode.name(),
            rigs[0].log.0.lock().len(),
            rigs[1].log.0.lock().len()
        );
        let report = thread.stop().unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        for c in &report.cqs {
            assert_eq!(c.recovered_missed_events, 0, "{}", mode.name());
            assert_eq!(c.acks, c.events, "{}: every event acked", mode.name());
        }
    }
}
