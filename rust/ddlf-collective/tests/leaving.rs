//! A worker told to stop ([`ddlf_collective::peer::leave`]): its daemon refuses liveness probes and new links, so a
//! rank waiting on it fails at its next probe. In a file of its own: leaving is for the whole process.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ddlf_collective::peer::{self, leave, leaving};
use ddlf_collective::{Op, Request, Ring, RingSpec};
use ddlf_core::auth::Token;
use ddlf_worker::{Daemon, DaemonConfig};

#[test]
fn a_leaving_daemon_refuses_probes_and_a_ring_waiting_on_it_fails_at_its_next_probe() {
    let daemons: Vec<Daemon> = (0..2)
        .map(|_| {
            Daemon::start(DaemonConfig {
                listen: "127.0.0.1:0".into(),
                token: Token::new("t"),
                ..Default::default()
            })
            .unwrap()
            .0
        })
        .collect();
    let addresses: Vec<String> = daemons.iter().map(|d| d.local_addr().to_string()).collect();
    let second: SocketAddr = addresses[1].parse().unwrap();
    let token = Token::new("t");
    let ask = || {
        peer::probe(
            second,
            &addresses[1],
            7,
            token.as_ref(),
            None,
            Duration::from_secs(2),
        )
    };
    assert!(ask().is_ok(), "a serving daemon answers its probes");

    // Rank 0 forms a ring with rank 1, whose worker is still computing: it waits, probing rank 1's daemon every
    // quarter of the liveness bound (2 s here), and is content while the daemon answers.
    let spec = RingSpec {
        group: 7,
        rank: 0,
        addresses: addresses.clone(),
        streams: 1,
        timeout: Duration::from_secs(60),
        liveness: Duration::from_secs(8),
        tls: None,
        local: None,
    };
    let waiting = std::thread::spawn(move || {
        let t0 = Instant::now();
        let out = Ring::new(spec, Token::new("t"))
            .and_then(|mut ring| ring.run(Request::allreduce(&mut [1f32; 4], Op::Sum)));
        (out, t0.elapsed())
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(!leaving());
    let left_at = Instant::now();
    leave(); // rank 1's worker (this process) is told to stop
    let err = ask().unwrap_err().to_string();
    assert!(err.contains("stopping"), "{err}");
    let (out, took) = waiting.join().unwrap();
    let err = out.unwrap_err().to_string();
    assert!(err.contains("stopping"), "{err}");
    // Failed at its next probe (every 2 s), not after the 60 s timeout.
    assert!(
        left_at.elapsed() < Duration::from_secs(5),
        "{:?} after leave(), {took:?} in all",
        left_at.elapsed()
    );
}
