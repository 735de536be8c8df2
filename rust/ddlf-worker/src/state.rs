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
    running: Mutex<Option<(String, Instant)>>,
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
            running: Mutex::new(None),
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

    /// The running operation and for how long it has run.
    pub fn running(&self) -> Option<(String, std::time::Duration)> {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(op, t)| (op.clone(), t.elapsed()))
    }
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
    fn rss_is_reported_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(rss_bytes() > 0);
        }
    }
}
