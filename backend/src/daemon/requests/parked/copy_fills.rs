//! Copy clones being filled from their template: a copy clone reads the
//! template's memory (RESTORE with COPY, `requests/park/clone_copy.rs`)
//! while its guest already runs, so the template must stay parked and
//! unwritten until every byte was read. Each fill holds its template here
//! from the moment it is admitted (under the template's change gate) to
//! the end of its reads; RESTORE and UNPARK of the template wait, under
//! the gate, until no fill holds it. The gate itself is not held while a
//! copy fills, so that copy clones of one template fill at once.
//!
//! A fill's reads end within the time it takes to read the template's
//! bytes: the background fill reads every unit whatever the receiver does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::daemon::ids::AllocId;

/// The templates copy clones are reading, with how many each.
#[derive(Debug, Default)]
pub struct CopyFills {
    reading: Mutex<HashMap<AllocId, usize>>,
    ended: Notify,
}

/// One copy clone's hold on its template; dropped when its reads end.
#[derive(Debug)]
pub struct Reading {
    fills: Arc<CopyFills>,
    template: AllocId,
}

impl Drop for Reading {
    fn drop(&mut self) {
        let mut reading = self.fills.lock();
        if let Some(n) = reading.get_mut(&self.template) {
            *n -= 1;
            if *n == 0 {
                reading.remove(&self.template);
            }
        }
        drop(reading);
        self.fills.ended.notify_waiters();
    }
}

impl CopyFills {
    fn lock(&self) -> MutexGuard<'_, HashMap<AllocId, usize>> {
        self.reading.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A copy clone starts reading `template` (call under its change gate).
    pub fn start(self: &Arc<Self>, template: AllocId) -> Reading {
        *self.lock().entry(template).or_insert(0) += 1;
        Reading {
            fills: Arc::clone(self),
            template,
        }
    }

    /// Copy clones reading `template` now.
    pub fn of(&self, template: AllocId) -> usize {
        self.lock().get(&template).copied().unwrap_or(0)
    }

    /// Returns once no copy clone reads `template` (call under its change
    /// gate, so that none starts meanwhile).
    pub async fn wait_ended(&self, template: AllocId) {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            // Registered before the count is read: no drop is missed.
            ended.as_mut().enable();
            if self.of(template) == 0 {
                return;
            }
            ended.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_ends_when_the_last_reader_of_its_template_does() {
        let fills = Arc::new(CopyFills::default());
        let (a, b) = (fills.start(1), fills.start(1));
        let other = fills.start(2);
        assert_eq!((fills.of(1), fills.of(2)), (2, 1));
        drop(a);
        let waiter = {
            let fills = Arc::clone(&fills);
            tokio::spawn(async move { fills.wait_ended(1).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one reader of template 1 is left");
        drop(b);
        waiter.await.expect("the wait ends");
        assert_eq!((fills.of(1), fills.of(2)), (0, 1));
        drop(other);
        fills.wait_ended(2).await;
    }
}
