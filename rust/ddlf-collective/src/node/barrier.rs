//! The members of a host waiting for each other ([`Node::wait_all`]): a barrier of atomic words in the control
//! file, the failure flag a member raises for every other to see, and the liveness probe of a member waited on.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::segment::{Segment, W_ARRIVED};
use super::Node;
use crate::{peer, CollectiveError};

impl Node {
    /// Ask member `i`'s daemon whether its process still answers.
    pub(super) fn probe(&self, i: usize) -> Result<(), String> {
        let within = self.liveness * 3 / 4;
        peer::probe(
            self.peers[i],
            &self.spec.addresses[i],
            self.group,
            self.token.as_ref(),
            self.tls.as_ref(),
            within,
        )
        .map_err(|e| format!("its daemon did not answer a liveness probe within {within:?}: {e}"))
    }

    pub(super) fn control(&self) -> Result<&Segment, CollectiveError> {
        self.control
            .as_ref()
            .ok_or_else(|| CollectiveError::Invalid("a node without its control file".into()))
    }

    /// Look at the control file: has a member failed the call?
    pub(super) fn failed(&self) -> Result<(), CollectiveError> {
        match self.control.as_ref().and_then(Segment::failure) {
            Some((who, reason)) => Err(self.fail(who, reason)),
            None => Ok(()),
        }
    }

    /// Arrive at the next barrier and wait for every member (see the module docs on how long, and probes).
    pub(super) fn wait_all(&mut self) -> Result<(), CollectiveError> {
        self.barrier += 1;
        let b = self.barrier;
        let (k, j) = (self.members(), self.spec.index);
        let control = self.control()?;
        control.word(W_ARRIVED + j).store(b, Ordering::Release);
        let t0 = Instant::now();
        let mut alive = t0;
        let mut spins = 0u32;
        loop {
            self.failed()?;
            let late = (0..k).find(|&i| control.word(W_ARRIVED + i).load(Ordering::Acquire) < b);
            let Some(late) = late else {
                return Ok(());
            };
            if spins.is_multiple_of(256) {
                crate::activity::waiting(
                    self.activity,
                    || {
                        format!(
                            "member {late} ({}) at this host's shared-memory barrier",
                            self.spec.addresses[late]
                        )
                    },
                    t0,
                );
            }
            if t0.elapsed() >= self.timeout {
                return Err(self.fail(
                    late,
                    format!("did not reach the local barrier within {:?}", self.timeout),
                ));
            }
            if alive.elapsed() >= self.liveness / 4 {
                if let Err(why) = self.probe(late) {
                    return Err(self.fail(late, why));
                }
                alive = Instant::now();
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
