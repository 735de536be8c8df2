//! Diagnostic: round-trip latency of gRPC pings from a Rust client to a Rust daemon on loopback, with no
//! Python anywhere. `cargo run --release -p ddlf-worker --example ping_latency`.

use std::time::{Duration, Instant};

use ddlf_net::{ClientConfig, WorkerConn};
use ddlf_worker::{Daemon, DaemonConfig};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let (daemon, _rx) = Daemon::start(DaemonConfig {
        listen: "127.0.0.1:0".into(),
        runtime_threads: threads,
        ..Default::default()
    })
    .unwrap();
    let addr = daemon.local_addr().to_string();
    for (label, rt) in [
        (
            "client current_thread",
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
        ),
        (
            "client multi_thread(1)",
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
        ),
    ] {
        let conn = rt
            .block_on(WorkerConn::connect(&addr, &ClientConfig::default()))
            .unwrap();
        let mut samples = Vec::new();
        for _ in 0..3000 {
            let t = Instant::now();
            rt.block_on(conn.ping(None)).unwrap();
            samples.push(t.elapsed());
        }
        println!(
            "{label}, server threads {threads}: median ping {:?}",
            median(samples[500..].to_vec())
        );
    }
    daemon.stop(Duration::from_secs(1));
}
