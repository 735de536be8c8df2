//! Logging setup: `tracing` events go to stderr, filtered by `DDLF_LOG` (or `RUST_LOG`).

use pyo3::prelude::*;
use tracing_subscriber::EnvFilter;

/// Install the stderr log subscriber once per process. `default` is used when neither `DDLF_LOG` nor
/// `RUST_LOG` is set. Returns False if a subscriber was already installed.
#[pyfunction]
#[pyo3(signature = (default = "warn"))]
pub fn init_logging(default: &str) -> bool {
    let filter = std::env::var("DDLF_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.to_string());
    let filter = EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init()
        .is_ok()
}
