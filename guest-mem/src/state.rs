//! Per-page state shared by the preparer, the background scrubber, the fault
//! handler and migration.
//!
//! Every page of a region (every huge page; 2 MiB granules of a 4 KiB region,
//! see [`crate::region`]) has one [`PageState`] held in an `AtomicU8`. All
//! changes go through [`PageStates::try_transition`], a `compare_exchange`
//! from an expected state to a new one that is first checked against the
//! transition table below; a thread that wins the exchange owns the page for
//! as long as the new state says so (`Clearing`: the clearer; `Mapped`: the
//! guest and whoever mapped it).
//!
//! ```text
//!   Unpopulated ──claim──► Clearing ──done──► Clean ──map──► Mapped
//!        │                   ▲   │              │               │
//!        │ taint             │   │ abort        │ taint         │ release
//!        ▼                   │   ▼              ▼               ▼
//!      Dirty ─────claim──────┘  Dirty         Dirty           Dirty
//! ```
//!
//! * `Unpopulated → Clearing`: the page was never faulted in; "clearing" it is
//!   populating it, and the kernel zeroes a fresh page itself.
//! * `Dirty → Clearing`: a reused page is claimed by exactly one clearer (the
//!   exchange fails for every other thread), so no page is cleared twice in
//!   one dirty epoch.
//! * `Clearing → Clean` when the clear finished, `Clearing → Dirty` when it was
//!   abandoned (cancelled, failed): the page must be cleared again.
//! * `Clean → Mapped`: the only way into `Mapped`, so no page reaches a guest
//!   without having gone through `Clean`.
//! * `Mapped → Dirty` when the guest is gone; `Clean → Dirty` and
//!   `Unpopulated → Dirty` ("taint") when the pool no longer vouches for the
//!   contents. Tainting only ever causes extra clearing, never less.
//!
//! Not allowed: skipping the clear (`Dirty → Clean`, `Dirty → Mapped`),
//! going back to `Unpopulated` (we never punch holes), and `Mapped → Clean`
//! (a guest may have written).
//!
//! # Design
//!
//! One byte per page, not a bitmap with per-state bits: a single
//! `compare_exchange` then both checks and changes the state, which a
//! multi-bit encoding spread over words could not do without a lock. The
//! alternative, a `Mutex<Vec<State>>`, would serialise the scrubber against
//! the fault handler. Memory: 8 KiB for 8 TiB of 1 GiB pages, 4 KiB per 8 GiB
//! of 2 MiB pages.
//!
//! Ordering: a successful exchange is `AcqRel`, so what the clearer wrote
//! before `Clearing → Clean` is visible to the thread that then wins
//! `Clean → Mapped`.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};

/// The state of one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PageState {
    /// Never faulted in: the kernel will hand out a zeroed page on first touch.
    Unpopulated = 0,
    /// Holds data from an earlier user; must be cleared before it is mapped.
    Dirty = 1,
    /// Owned by one thread that is populating or clearing it.
    Clearing = 2,
    /// Zeroed and not mapped into any guest.
    Clean = 3,
    /// Handed to a guest.
    Mapped = 4,
}

impl PageState {
    /// All states, in discriminant order.
    pub const ALL: [PageState; 5] = [
        PageState::Unpopulated,
        PageState::Dirty,
        PageState::Clearing,
        PageState::Clean,
        PageState::Mapped,
    ];

    fn from_raw(raw: u8) -> Self {
        match raw {
            0 => PageState::Unpopulated,
            1 => PageState::Dirty,
            2 => PageState::Clearing,
            3 => PageState::Clean,
            // Only values of this enum are ever stored (see `PageStates`).
            _ => PageState::Mapped,
        }
    }

    /// True when the transition table allows `self → to`.
    pub const fn may_become(self, to: PageState) -> bool {
        use PageState::*;
        matches!(
            (self, to),
            (Unpopulated, Clearing)
                | (Unpopulated, Dirty)
                | (Dirty, Clearing)
                | (Clearing, Clean)
                | (Clearing, Dirty)
                | (Clean, Mapped)
                | (Clean, Dirty)
                | (Mapped, Dirty)
        )
    }
}

impl fmt::Display for PageState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageState::Unpopulated => "unpopulated",
            PageState::Dirty => "dirty",
            PageState::Clearing => "clearing",
            PageState::Clean => "clean",
            PageState::Mapped => "mapped",
        })
    }
}

/// A refused state change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The page was not in the expected state (another thread got there first).
    #[error("page {page} is {actual}, expected {expected}")]
    Conflict {
        /// Page index.
        page: usize,
        /// The state the caller expected.
        expected: PageState,
        /// The state the page was in.
        actual: PageState,
    },
    /// The transition table does not allow this change.
    #[error("page {page}: {from} → {to} is not an allowed transition")]
    Forbidden {
        /// Page index.
        page: usize,
        /// From state.
        from: PageState,
        /// To state.
        to: PageState,
    },
    /// No such page.
    #[error("page {page} is out of range ({pages} pages)")]
    OutOfRange {
        /// Page index asked for.
        page: usize,
        /// Number of pages.
        pages: usize,
    },
}

/// Number of pages in each state, from one pass over the pages.
///
/// Each page is read once, so the fields always sum to the page count even
/// while other threads change states; the split between states is a snapshot
/// that may already be stale.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCounts {
    /// Pages never populated.
    pub unpopulated: usize,
    /// Pages waiting to be cleared.
    pub dirty: usize,
    /// Pages being populated or cleared.
    pub clearing: usize,
    /// Clean, unmapped pages.
    pub clean: usize,
    /// Pages handed to a guest.
    pub mapped: usize,
}

impl StateCounts {
    /// Sum over all states.
    pub fn total(&self) -> usize {
        self.unpopulated + self.dirty + self.clearing + self.clean + self.mapped
    }

    /// The count for `state`.
    pub fn get(&self, state: PageState) -> usize {
        match state {
            PageState::Unpopulated => self.unpopulated,
            PageState::Dirty => self.dirty,
            PageState::Clearing => self.clearing,
            PageState::Clean => self.clean,
            PageState::Mapped => self.mapped,
        }
    }

    fn bump(&mut self, state: PageState) {
        match state {
            PageState::Unpopulated => self.unpopulated += 1,
            PageState::Dirty => self.dirty += 1,
            PageState::Clearing => self.clearing += 1,
            PageState::Clean => self.clean += 1,
            PageState::Mapped => self.mapped += 1,
        }
    }
}

/// The states of all pages of a region.
///
/// Invariant: every byte holds the discriminant of a [`PageState`]; only
/// [`PageStates::new`], [`PageStates::from_states`], [`PageStates::grow`] and successful checked exchanges
/// write them.
#[derive(Debug)]
pub struct PageStates {
    states: Box<[AtomicU8]>,
}

impl PageStates {
    /// `pages` pages, all in `initial`.
    pub fn new(pages: usize, initial: PageState) -> Self {
        Self {
            states: (0..pages).map(|_| AtomicU8::new(initial as u8)).collect(),
        }
    }

    /// Pages in the given states, in order (a region another daemon
    /// instance passed on, see `Region::adopt`).
    pub fn from_states(states: &[PageState]) -> Self {
        Self {
            states: states.iter().map(|s| AtomicU8::new(*s as u8)).collect(),
        }
    }

    /// Every page's state, in order (a snapshot: pages may change while it
    /// is taken; the caller stops every writer first when it matters).
    pub fn snapshot(&self) -> Vec<PageState> {
        self.states
            .iter()
            .map(|s| PageState::from_raw(s.load(Ordering::Acquire)))
            .collect()
    }

    /// Appends `pages` pages in `initial` (a region that grew). Needs
    /// `&mut self`: no other thread can be claiming pages while it runs.
    pub fn grow(&mut self, pages: usize, initial: PageState) {
        let mut states = std::mem::take(&mut self.states).into_vec();
        states.extend((0..pages).map(|_| AtomicU8::new(initial as u8)));
        self.states = states.into_boxed_slice();
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.states.len()
    }

    /// True for a region of no pages (never created by `Region`).
    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    fn slot(&self, page: usize) -> Result<&AtomicU8, StateError> {
        self.states.get(page).ok_or(StateError::OutOfRange {
            page,
            pages: self.states.len(),
        })
    }

    /// The current state of `page`.
    pub fn get(&self, page: usize) -> Result<PageState, StateError> {
        Ok(PageState::from_raw(
            self.slot(page)?.load(Ordering::Acquire),
        ))
    }

    /// Changes `page` from `from` to `to` if it is in `from` and the table
    /// allows it; the winner of a race is the one thread that gets `Ok`.
    ///
    /// # Errors
    ///
    /// [`StateError::Forbidden`] for a change the table does not allow (checked
    /// before touching the page), [`StateError::Conflict`] naming the actual
    /// state when the page was not in `from`, [`StateError::OutOfRange`].
    pub fn try_transition(
        &self,
        page: usize,
        from: PageState,
        to: PageState,
    ) -> Result<(), StateError> {
        let slot = self.slot(page)?;
        if !from.may_become(to) {
            return Err(StateError::Forbidden { page, from, to });
        }
        slot.compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|actual| StateError::Conflict {
                page,
                expected: from,
                actual: PageState::from_raw(actual),
            })
    }

    /// Finds a page in `from`, starting at `hint` and wrapping around, and
    /// moves it to `to`; returns its index, or `None` when a full pass found
    /// none that this thread could claim.
    ///
    /// Starting each worker at a different hint spreads workers over the
    /// region instead of having them all race for page 0.
    ///
    /// # Errors
    ///
    /// [`StateError::Forbidden`] when the table does not allow `from → to`.
    pub fn claim(
        &self,
        from: PageState,
        to: PageState,
        hint: usize,
    ) -> Result<Option<usize>, StateError> {
        let pages = self.states.len();
        if !from.may_become(to) {
            return Err(StateError::Forbidden {
                page: hint,
                from,
                to,
            });
        }
        if pages == 0 {
            return Ok(None);
        }
        let start = hint % pages;
        for page in (start..pages).chain(0..start) {
            let slot = &self.states[page];
            // Cheap load first so a scan over clean pages does not bounce
            // every cache line between cores with failed exchanges.
            if slot.load(Ordering::Relaxed) != from as u8 {
                continue;
            }
            if slot
                .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Ok(Some(page));
            }
        }
        Ok(None)
    }

    /// Claims the next dirty page for a scrubber (`Dirty → Clearing`),
    /// scanning from `hint`. The caller must finish it with
    /// `Clearing → Clean` (or `Clearing → Dirty` when it gives up).
    pub fn claim_dirty(&self, hint: usize) -> Option<usize> {
        // Dirty → Clearing is in the table, so `claim` cannot return Forbidden.
        self.claim(PageState::Dirty, PageState::Clearing, hint)
            .ok()
            .flatten()
    }

    /// Claims `page` for preparation: `Unpopulated → Clearing` (returns the
    /// state it was in, so the caller populates) or `Dirty → Clearing` (the
    /// caller clears). `None` when the page is in any other state, including
    /// when another thread claimed it first.
    pub fn claim_for_prepare(&self, page: usize) -> Option<PageState> {
        [PageState::Unpopulated, PageState::Dirty]
            .into_iter()
            .find(|&from| self.try_transition(page, from, PageState::Clearing).is_ok())
    }

    /// Number of pages in each state (one pass; see [`StateCounts`]).
    pub fn counts(&self) -> StateCounts {
        let mut counts = StateCounts::default();
        for slot in self.states.iter() {
            counts.bump(PageState::from_raw(slot.load(Ordering::Acquire)));
        }
        counts
    }

    /// Indices of the pages currently in `state` (a snapshot).
    pub fn pages_in(&self, state: PageState) -> Vec<usize> {
        (0..self.states.len())
            .filter(|&i| self.states[i].load(Ordering::Acquire) == state as u8)
            .collect()
    }

    /// Moves every page that is `Unpopulated`, `Clean` or `Mapped` to `Dirty`
    /// (pages already dirty stay so); returns how many pages changed and how
    /// many were left alone because another thread holds them in `Clearing`.
    ///
    /// For the pool taking a region back from a VM: afterwards nothing is
    /// handed out again before it has been cleared.
    pub fn mark_all_dirty(&self) -> (usize, usize) {
        let mut changed = 0;
        let mut busy = 0;
        for page in 0..self.states.len() {
            loop {
                let current = PageState::from_raw(self.states[page].load(Ordering::Acquire));
                match current {
                    PageState::Dirty => break,
                    PageState::Clearing => {
                        busy += 1;
                        break;
                    }
                    _ => match self.try_transition(page, current, PageState::Dirty) {
                        Ok(()) => {
                            changed += 1;
                            break;
                        }
                        // Changed under us: look again.
                        Err(_) => continue,
                    },
                }
            }
        }
        (changed, busy)
    }
}

#[cfg(test)]
mod tests;
