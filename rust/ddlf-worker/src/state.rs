//! The daemon's view of itself, shared by the service and the interpreter thread. Lock-free where it is read
//! by status requests, so status never waits on a busy interpreter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Counters and the currently running operation.
#[derive(Debug)]
pub struct WorkerState {
    pub started: Instant,
    pub hostname: String,
    pub name: String,
    pub served: AtomicU64,
    /// Shared with the authentication interceptor.
    pub rejected: Arc<AtomicU64>,
    pub queued: AtomicU64,
    /// Pings answered on ping lanes ([`crate::pings`]).
    pub lane_pings: AtomicU64,
    /// Random per daemon start: tells a master that the daemon at an address was restarted.
    pub instance: u64,
    /// Open and refused connections (shared with the admission guard).
    pub connections: Arc<ddlf_net::ConnStats>,
    running: Mutex<Option<(String, Instant)>>,
    /// The Python threads' stacks, for the `Stacks` RPC (installed by the interpreter side).
    pub stacks: crate::stacks::Stacks,
    /// The training runs served now, as the interpreter side last reported them (`set_runs`).
    runs: Mutex<Vec<String>>,
}

impl WorkerState {
    pub fn new(name: String) -> Self {
        WorkerState {
            started: Instant::now(),
            hostname: hostname(),
            name,
            served: AtomicU64::new(0),
            rejected: Arc::new(AtomicU64::new(0)),
            queued: AtomicU64::new(0),
            lane_pings: AtomicU64::new(0),
            instance: new_instance(),
            connections: Arc::default(),
            running: Mutex::new(None),
            stacks: crate::stacks::Stacks::default(),
            runs: Mutex::new(Vec::new()),
        }
    }

    /// Record that the interpreter started `op`.
    pub fn begin(&self, op: &str) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((op.to_string(), Instant::now()));
    }

    /// Record that the interpreter finished its operation.
    pub fn end(&self) {
        *self.running.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.served.fetch_add(1, Ordering::Relaxed);
    }

    /// Count and log a refused request; returns the status to answer with.
    pub fn reject(&self, status: tonic::Status) -> tonic::Status {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(code = ?status.code(), message = status.message(), "request rejected");
        status
    }

    /// Replace the list of training runs this daemon serves (reported by the interpreter side).
    pub fn set_runs(&self, runs: Vec<String>) {
        *self.runs.lock().unwrap_or_else(|e| e.into_inner()) = runs;
    }

    /// The training runs this daemon serves, as last reported.
    pub fn runs(&self) -> Vec<String> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The running operation (empty when idle) and for how long, in milliseconds, as status replies carry it.
    pub fn running_ms(&self) -> (String, u64) {
        self.running()
            .map(|(op, d)| (op, d.as_millis() as u64))
            .unwrap_or_default()
    }

    /// The running operation and for how long it has run.
    pub fn running(&self) -> Option<(String, std::time::Duration)> {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(op, t)| (op.clone(), t.elapsed()))
    }
}

/// A number that differs between two starts of a daemon: the wall clock's nanoseconds mixed with the pid and
/// the address of a stack value (splitmix64 finaliser), never 0.
fn new_instance() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let marker = 0u8;
    let mut z = nanos ^ ((std::process::id() as u64) << 32) ^ (&marker as *const u8 as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    (z ^ (z >> 31)).max(1)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "unknown".into())
}

/// Resident set size of this process in bytes (Linux; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_is_tracked() {
        let s = WorkerState::new("w".into());
        assert!(s.running().is_none());
        s.begin("run:step");
        assert_eq!(s.running().unwrap().0, "run:step");
        s.end();
        assert!(s.running().is_none());
        assert_eq!(s.served.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn instances_differ_between_starts() {
        let a = WorkerState::new("a".into()).instance;
        let b = WorkerState::new("b".into()).instance;
        assert_ne!(a, 0);
        assert_ne!(a, b);
    }

    #[test]
    fn rss_is_reported_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(rss_bytes() > 0);
        }
    }
}
