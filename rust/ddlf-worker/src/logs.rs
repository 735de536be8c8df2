//! The daemon's recent log lines, kept in memory so that a master can read them over RPC
//! (`cluster.logs(worker)`) without logging into the worker's node.
//!
//! [`RingWriter`] is a `tracing_subscriber` writer: install it as a second formatting layer beside the
//! stderr one, and every event it formats becomes one line of the process-wide [`LogRing`].

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use tracing_subscriber::fmt::MakeWriter;

/// Lines kept per process. At ~150 bytes a line that is ~1.5 MB at most.
pub const CAPACITY: usize = 10_000;

/// A bounded buffer of log lines: the oldest line is dropped when it is full.
#[derive(Debug)]
pub struct LogRing {
    lines: Mutex<VecDeque<String>>,
    capacity: usize,
    dropped: AtomicU64,
}

impl LogRing {
    pub fn new(capacity: usize) -> Self {
        LogRing {
            lines: Mutex::new(VecDeque::with_capacity(capacity.min(1024))),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
        }
    }

    /// Append one line (a trailing newline is removed).
    pub fn push(&self, line: &str) {
        let line = line.trim_end_matches(['\n', '\r']);
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.len() == self.capacity {
            lines.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        lines.push_back(line.to_string());
    }

    /// The last `n` lines, oldest first (`n == 0`: all kept), and how many lines fell out of the buffer.
    pub fn tail(&self, n: usize) -> (Vec<String>, u64) {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let n = if n == 0 {
            lines.len()
        } else {
            n.min(lines.len())
        };
        let out = lines.iter().skip(lines.len() - n).cloned().collect();
        (out, self.dropped.load(Ordering::Relaxed))
    }
}

/// The process-wide ring that the daemon's `Logs` RPC reads.
pub fn ring() -> &'static LogRing {
    static RING: OnceLock<LogRing> = OnceLock::new();
    RING.get_or_init(|| LogRing::new(CAPACITY))
}

/// `MakeWriter` for the process-wide ring: each event is formatted into a buffer and pushed as lines when the
/// writer is dropped (the fmt layer makes one writer per event).
#[derive(Clone, Copy, Debug, Default)]
pub struct RingWriter;

/// One event's bytes on their way to the ring.
#[derive(Debug, Default)]
pub struct RingLine(Vec<u8>);

impl io::Write for RingLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for RingLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let text = String::from_utf8_lossy(&self.0);
        let r = ring();
        for line in text.lines() {
            r.push(line);
        }
    }
}

impl<'a> MakeWriter<'a> for RingWriter {
    type Writer = RingLine;

    fn make_writer(&'a self) -> Self::Writer {
        RingLine::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_lines_and_counts_the_dropped() {
        let r = LogRing::new(3);
        for i in 0..5 {
            r.push(&format!("line {i}\n"));
        }
        let (lines, dropped) = r.tail(0);
        assert_eq!(lines, ["line 2", "line 3", "line 4"]);
        assert_eq!(dropped, 2);
        assert_eq!(r.tail(2).0, ["line 3", "line 4"]);
        assert_eq!(r.tail(10).0.len(), 3);
    }

    #[test]
    fn an_empty_ring_has_no_lines() {
        let r = LogRing::new(4);
        assert_eq!(r.tail(5), (vec![], 0));
    }

    #[test]
    fn the_writer_splits_an_event_into_lines() {
        use std::io::Write;
        let before = ring().tail(0).0.len();
        {
            let mut w = RingWriter.make_writer();
            w.write_all(b"first\nsecond\n").unwrap();
        }
        let (lines, _) = ring().tail(2);
        assert_eq!(lines, ["first", "second"]);
        assert!(ring().tail(0).0.len() >= before + 2 || before + 2 > CAPACITY);
    }
}
