//! Logging setup: `tracing` events go to stderr, filtered by `DDLF_LOG` (or `RUST_LOG`), and into the daemon's
//! in-memory ring of recent lines (read by `cluster.logs()`), filtered by `DDLF_LOG_KEEP` (default: info, and
//! each request's line at debug). Python's `logging` records on a worker reach the same two places through
//! [`log_record`].

use std::io::IsTerminal;

use pyo3::prelude::*;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, EnvFilter, Layer};

use ddlf_worker::logs::RingWriter;

/// What the ring keeps unless `DDLF_LOG_KEEP` says otherwise: a line per request served, and every warning.
const KEEP_DEFAULT: &str = "info,ddlf_worker=debug";

fn filter(var: &str, fallback: Option<&str>, default: &str) -> EnvFilter {
    let spec = std::env::var(var)
        .ok()
        .or_else(|| fallback.and_then(|f| std::env::var(f).ok()))
        .unwrap_or_else(|| default.to_string());
    EnvFilter::try_new(&spec).unwrap_or_else(|_| EnvFilter::new(default))
}

/// Install the log subscriber once per process. `default` is the stderr level used when neither `DDLF_LOG`
/// nor `RUST_LOG` is set. Returns False if a subscriber was already installed.
#[pyfunction]
#[pyo3(signature = (default = "warn"))]
pub fn init_logging(default: &str) -> bool {
    let stderr = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_filter(filter("DDLF_LOG", Some("RUST_LOG"), default));
    // Plain `name=value` span fields through a field formatter of its own type: the fmt layers cache a span's
    // formatted fields per formatter type, so sharing the stderr layer's would leak its colour codes here.
    let plain_fields = fmt::format::debug_fn(|w, field, value| {
        if field.name() == "message" {
            write!(w, "{value:?}")
        } else {
            write!(w, "{field}={value:?}")
        }
    })
    .delimited(" ");
    let ring = fmt::layer()
        .with_writer(RingWriter)
        .with_ansi(false)
        .with_target(false)
        .fmt_fields(plain_fields)
        .with_filter(filter("DDLF_LOG_KEEP", None, KEEP_DEFAULT));
    tracing_subscriber::registry()
        .with(stderr)
        .with(ring)
        .try_init()
        .is_ok()
}

/// Log a Python `logging` record through `tracing` (on a worker: to stderr and the ring, inside the span of
/// the request being served, so the line carries its id and function). `level` is Python's numeric level.
#[pyfunction]
pub fn log_record(level: u32, logger: &str, message: &str) {
    match level {
        0..=10 => tracing::debug!(target: "python", logger, "{message}"),
        11..=20 => tracing::info!(target: "python", logger, "{message}"),
        21..=30 => tracing::warn!(target: "python", logger, "{message}"),
        _ => tracing::error!(target: "python", logger, "{message}"),
    }
}
