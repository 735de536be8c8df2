//! What this process's collectives are doing now, for `ddlf stacks`: each call in progress (which ring, which
//! call, how many elements, since when) and, while it waits, on whom (a neighbour's link, a member at the local
//! barrier, a link not opened yet) and since when nothing moved. Read by the daemon's network side
//! ([`snapshot`]) without the interpreter, so a worker stuck in a reduction says where it is stuck.
//!
//! A call registers itself with [`Activity::begin`] and leaves when the handle drops; the waits record
//! themselves with [`waiting`] (the call's id travels in [`crate::ring::Watch`] and the node's state). Only
//! waits are recorded: a call that makes progress touches the table once per wait, never per byte.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

struct Entry {
    what: String,
    started: Instant,
    waiting: Option<(String, Instant)>,
}

fn table() -> MutexGuard<'static, BTreeMap<u64, Entry>> {
    static TABLE: OnceLock<Mutex<BTreeMap<u64, Entry>>> = OnceLock::new();
    TABLE
        .get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// One collective call in progress; it leaves the table when dropped.
pub struct Activity {
    id: u64,
}

impl Activity {
    /// Register a call described by `what` (e.g. "all-reduce of 1000 float32 on ring 0x.., rank 0 of 2").
    pub fn begin(what: String) -> Activity {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        table().insert(
            id,
            Entry {
                what,
                started: Instant::now(),
                waiting: None,
            },
        );
        Activity { id }
    }

    /// This call's id, for [`waiting`].
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Activity {
    fn drop(&mut self) {
        table().remove(&self.id);
    }
}

/// Call `id` (0: none) waits on `on()` with nothing moved since `since`.
pub fn waiting(id: u64, on: impl FnOnce() -> String, since: Instant) {
    if id == 0 {
        return;
    }
    if let Some(e) = table().get_mut(&id) {
        match &mut e.waiting {
            Some((_, at)) if *at == since => {}
            w => *w = Some((on(), since)),
        }
    }
}

/// Every call in progress, oldest first, one line each: what it is, for how long, and on whom it waits.
pub fn snapshot() -> Vec<String> {
    let now = Instant::now();
    let secs = |d: Duration| d.as_secs_f64();
    table()
        .values()
        .map(|e| {
            let mut line = format!("{} for {:.1} s", e.what, secs(now - e.started));
            if let Some((on, since)) = &e.waiting {
                line.push_str(&format!(
                    "; waiting on {on}, nothing moved for {:.1} s",
                    secs(now.saturating_duration_since(*since))
                ));
            }
            line
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_listed_with_what_it_waits_on_until_it_ends() {
        let call = Activity::begin("all-reduce of 3 float32 on a test ring".into());
        let since = Instant::now() - Duration::from_secs(2);
        waiting(
            call.id(),
            || "the left neighbour, rank 1 (h:1)".into(),
            since,
        );
        let line = snapshot()
            .into_iter()
            .find(|l| l.contains("a test ring"))
            .unwrap();
        assert!(
            line.contains("waiting on the left neighbour, rank 1 (h:1), nothing moved for 2."),
            "{line}"
        );
        waiting(0, || unreachable!(), since); // no call: nothing recorded, nothing formatted
        drop(call);
        assert!(!snapshot().iter().any(|l| l.contains("a test ring")));
    }
}
