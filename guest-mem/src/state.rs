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
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicI64, AtomicU64};
    use std::sync::Barrier;

    use proptest::prelude::*;

    #[test]
    fn transition_table() {
        use PageState::*;
        let allowed = [
            (Unpopulated, Clearing),
            (Unpopulated, Dirty),
            (Dirty, Clearing),
            (Clearing, Clean),
            (Clearing, Dirty),
            (Clean, Mapped),
            (Clean, Dirty),
            (Mapped, Dirty),
        ];
        for from in PageState::ALL {
            for to in PageState::ALL {
                assert_eq!(
                    from.may_become(to),
                    allowed.contains(&(from, to)),
                    "{from} → {to}"
                );
            }
        }
        // Into Mapped only from Clean.
        for from in PageState::ALL {
            assert_eq!(from.may_become(Mapped), from == Clean);
        }
    }

    #[test]
    fn checked_exchanges() {
        let s = PageStates::new(3, PageState::Dirty);
        assert_eq!(s.len(), 3);
        assert_eq!(
            s.try_transition(0, PageState::Dirty, PageState::Clean),
            Err(StateError::Forbidden {
                page: 0,
                from: PageState::Dirty,
                to: PageState::Clean
            })
        );
        s.try_transition(0, PageState::Dirty, PageState::Clearing)
            .expect("claim");
        assert_eq!(
            s.try_transition(0, PageState::Dirty, PageState::Clearing),
            Err(StateError::Conflict {
                page: 0,
                expected: PageState::Dirty,
                actual: PageState::Clearing
            })
        );
        s.try_transition(0, PageState::Clearing, PageState::Clean)
            .expect("done");
        assert_eq!(s.get(0), Ok(PageState::Clean));
        assert_eq!(
            s.try_transition(3, PageState::Dirty, PageState::Clearing),
            Err(StateError::OutOfRange { page: 3, pages: 3 })
        );
        assert_eq!(
            s.counts(),
            StateCounts {
                dirty: 2,
                clean: 1,
                ..Default::default()
            }
        );
        assert_eq!(s.claim_dirty(2), Some(2));
        assert_eq!(s.claim_dirty(2), Some(1));
        assert_eq!(s.claim_dirty(0), None);
        assert_eq!(s.pages_in(PageState::Clearing), vec![1, 2]);
        let err = s
            .try_transition(1, PageState::Clean, PageState::Clearing)
            .expect_err("forbidden");
        assert_eq!(
            err.to_string(),
            "page 1: clean → clearing is not an allowed transition"
        );
    }

    #[test]
    fn prepare_claims_and_mark_all_dirty() {
        let s = PageStates::new(4, PageState::Unpopulated);
        assert_eq!(s.claim_for_prepare(0), Some(PageState::Unpopulated));
        assert_eq!(s.claim_for_prepare(0), None);
        s.try_transition(0, PageState::Clearing, PageState::Clean)
            .expect("done");
        s.try_transition(0, PageState::Clean, PageState::Mapped)
            .expect("map");
        s.try_transition(1, PageState::Unpopulated, PageState::Clearing)
            .expect("claim");
        // Page 0 mapped, 1 clearing, 2 and 3 unpopulated.
        assert_eq!(s.mark_all_dirty(), (3, 1));
        assert_eq!(
            s.counts(),
            StateCounts {
                dirty: 3,
                clearing: 1,
                ..Default::default()
            }
        );
        assert_eq!(s.claim_for_prepare(2), Some(PageState::Dirty));
    }

    /// Test-side shadow of one page, to check the invariants from outside.
    ///
    /// # Why a count of open epochs, not a generation number
    ///
    /// A "dirty epoch" starts with each move into `Dirty` (and, for
    /// `Unpopulated`, at creation) and ends with the one `Dirty → Clearing`
    /// (`Unpopulated → Clearing`) exchange that claims it. The machine
    /// guarantees one claim per epoch because that exchange consumes the
    /// state it starts from: a second claimer's `compare_exchange` finds
    /// `Clearing` (or a later state) and fails.
    ///
    /// An earlier model bumped a per-page `dirty_gen` *before* each attempt to
    /// move the page to `Dirty` and had the clearer assert that the
    /// generation it read was newer than the one of its previous clear. For
    /// the owner's moves (`Mapped → Dirty`, `Clearing → Dirty`) that is
    /// exact: nobody else can claim the page between the bump and the
    /// exchange. The pool's taint (`Clean → Dirty`) owns nothing, so its bump
    /// can be consumed by a clear of the *previous* epoch:
    ///
    /// ```text
    /// tainter T                 clearer A                clearer B
    /// dirty_gen 1 → 2           (page Dirty, epoch 1)
    ///                           Dirty → Clearing, reads 2
    ///                           Clearing → Clean
    /// Clean → Dirty  (epoch 2, dirty_gen still 2)
    ///                                                    Dirty → Clearing, reads 2
    ///                                                    "cleared twice in epoch 2"
    /// ```
    ///
    /// Every exchange there is legal and each epoch is cleared once; only the
    /// model's bookkeeping is wrong (the `cc 116a9db7…` failure, issue 10).
    /// Moving the bump after the exchange opens the opposite window (B
    /// claims before the bump and reads the old generation).
    ///
    /// This model counts instead: `open_epochs` is raised *before* every
    /// attempt to open an epoch and lowered again when that attempt fails,
    /// and every claim lowers it. It therefore never falls below the true
    /// number of unclaimed epochs (no false alarms), every claim of an epoch
    /// that was already claimed takes it below zero unless a tainter's
    /// pending raise hides it for that instant, the tainter's own lowering
    /// then checks it again, and after the threads are joined it must equal
    /// exactly 1 for a `Dirty`/`Unpopulated` page and 0 for any other, which
    /// catches every extra claim.
    struct Shadow {
        /// Epochs opened (or being opened) and not yet claimed by a clearer.
        open_epochs: AtomicI64,
        /// Model of the page contents: 0 = zero, else who wrote.
        content: AtomicU64,
        /// Thread id + 1 of the thread holding the page in `Clearing`/`Mapped`.
        owner: AtomicU64,
    }

    impl Shadow {
        fn new(open_epochs: i64, content: u64) -> Self {
            Self {
                open_epochs: AtomicI64::new(open_epochs),
                content: AtomicU64::new(content),
                owner: AtomicU64::new(0),
            }
        }

        /// Before an exchange that moves the page to `Dirty`.
        fn opening_epoch(&self) {
            self.open_epochs.fetch_add(1, Ordering::AcqRel);
        }

        /// That exchange failed: take back what [`Shadow::opening_epoch`] added.
        fn epoch_not_opened(&self, page: usize) {
            let before = self.open_epochs.fetch_sub(1, Ordering::AcqRel);
            assert!(before >= 1, "page {page} cleared twice in one dirty epoch");
        }

        /// Thread `me` won `Dirty → Clearing` or `Unpopulated → Clearing`:
        /// claims the epoch and zeroes the page.
        fn cleared(&self, page: usize, me: u64) {
            assert_eq!(
                self.owner.swap(me, Ordering::AcqRel),
                0,
                "page {page} claimed twice"
            );
            let before = self.open_epochs.fetch_sub(1, Ordering::AcqRel);
            assert!(before >= 1, "page {page} cleared twice in one dirty epoch");
            self.content.store(0, Ordering::Relaxed);
            self.owner.store(0, Ordering::Release);
        }
    }

    fn hammer(initial: &[u8], threads: usize, ops: &[Vec<u8>]) {
        let states = PageStates::new(initial.len(), PageState::Unpopulated);
        let mut shadows = Vec::with_capacity(initial.len());
        for (page, &kind) in initial.iter().enumerate() {
            shadows.push(match kind % 3 {
                // Unpopulated: one epoch, claimed by whoever populates it.
                0 => Shadow::new(1, 0),
                1 => {
                    states
                        .try_transition(page, PageState::Unpopulated, PageState::Dirty)
                        .expect("setup");
                    Shadow::new(1, u64::MAX)
                }
                _ => {
                    states
                        .try_transition(page, PageState::Unpopulated, PageState::Clearing)
                        .expect("setup");
                    states
                        .try_transition(page, PageState::Clearing, PageState::Clean)
                        .expect("setup");
                    Shadow::new(0, 0)
                }
            });
        }
        let pages = initial.len();
        let barrier = Barrier::new(threads + 1);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let mut workers = Vec::new();
            for (t, my_ops) in ops.iter().take(threads).enumerate() {
                let (states, shadows, barrier) = (&states, &shadows, &barrier);
                let me = t as u64 + 1;
                workers.push(scope.spawn(move || {
                    let mut mapped: Vec<usize> = Vec::new();
                    barrier.wait();
                    for (i, &op) in my_ops.iter().enumerate() {
                        let hint = (i * 7 + t * 13) % pages;
                        match op % 6 {
                            // Scrubber / preparer: claim, clear, finish or abort.
                            0 | 1 => {
                                let claimed = if op % 6 == 0 {
                                    states.claim_dirty(hint)
                                } else {
                                    states
                                        .claim(PageState::Unpopulated, PageState::Clearing, hint)
                                        .expect("allowed")
                                };
                                let Some(page) = claimed else { continue };
                                let sh = &shadows[page];
                                sh.cleared(page, me);
                                if i % 5 == 4 {
                                    // Abandon: must be cleared again.
                                    sh.opening_epoch();
                                    states
                                        .try_transition(page, PageState::Clearing, PageState::Dirty)
                                        .expect("owner aborts");
                                } else {
                                    states
                                        .try_transition(page, PageState::Clearing, PageState::Clean)
                                        .expect("owner finishes");
                                }
                            }
                            // Fault handler: map a clean page, the guest writes.
                            2 => {
                                let Some(page) = states
                                    .claim(PageState::Clean, PageState::Mapped, hint)
                                    .expect("allowed")
                                else {
                                    continue;
                                };
                                let sh = &shadows[page];
                                assert_eq!(
                                    sh.owner.swap(me, Ordering::AcqRel),
                                    0,
                                    "mapped page {page} has an owner"
                                );
                                assert_eq!(
                                    sh.content.load(Ordering::Relaxed),
                                    0,
                                    "page {page} mapped with dirty contents"
                                );
                                sh.content.store(me, Ordering::Relaxed);
                                mapped.push(page);
                            }
                            // VM gone: release one of mine.
                            3 => {
                                let Some(page) = mapped.pop() else { continue };
                                let sh = &shadows[page];
                                assert_eq!(sh.owner.swap(0, Ordering::AcqRel), me);
                                sh.opening_epoch();
                                states
                                    .try_transition(page, PageState::Mapped, PageState::Dirty)
                                    .expect("owner releases");
                            }
                            // Pool taints a clean page.
                            4 => taint(states, &shadows[hint], hint),
                            // Forbidden changes are refused whatever the page's state.
                            _ => {
                                for (from, to) in [
                                    (PageState::Dirty, PageState::Clean),
                                    (PageState::Dirty, PageState::Mapped),
                                    (PageState::Mapped, PageState::Clean),
                                    (PageState::Unpopulated, PageState::Mapped),
                                    (PageState::Clean, PageState::Unpopulated),
                                ] {
                                    assert!(matches!(
                                        states.try_transition(hint, from, to),
                                        Err(StateError::Forbidden { .. })
                                    ));
                                }
                            }
                        }
                    }
                    // Give back what this thread still holds.
                    for page in mapped {
                        assert_eq!(shadows[page].owner.swap(0, Ordering::AcqRel), me);
                        shadows[page].opening_epoch();
                        states
                            .try_transition(page, PageState::Mapped, PageState::Dirty)
                            .expect("owner releases");
                    }
                }));
            }
            // Observer: counts always conserve.
            let (states, barrier, done) = (&states, &barrier, &done);
            scope.spawn(move || {
                barrier.wait();
                while !done.load(Ordering::Acquire) {
                    assert_eq!(states.counts().total(), pages);
                    std::thread::yield_now();
                }
            });
            let results: Vec<_> = workers.into_iter().map(|w| w.join()).collect();
            done.store(true, Ordering::Release);
            for r in results {
                if let Err(panic) = r {
                    std::panic::resume_unwind(panic);
                }
            }
        });
        let counts = states.counts();
        assert_eq!(counts.total(), pages);
        assert_eq!(counts.clearing, 0, "a clearer left a page claimed");
        assert_eq!(counts.mapped, 0, "a mapper left a page mapped");
        for page in states.pages_in(PageState::Clean) {
            assert_eq!(
                shadows[page].content.load(Ordering::Relaxed),
                0,
                "clean page {page} has contents"
            );
        }
        // Exact once nothing is in flight: one unclaimed epoch per page
        // waiting to be cleared, none for the others.
        for (page, sh) in shadows.iter().enumerate() {
            let state = states.get(page).expect("in range");
            let open = i64::from(matches!(state, PageState::Dirty | PageState::Unpopulated));
            assert_eq!(
                sh.open_epochs.load(Ordering::Acquire),
                open,
                "page {page} ({state}): epochs opened and claimed do not match"
            );
        }
    }

    /// The pool taints a page: `Clean → Dirty` if it is clean, else nothing.
    fn taint(states: &PageStates, sh: &Shadow, page: usize) {
        sh.opening_epoch();
        if states
            .try_transition(page, PageState::Clean, PageState::Dirty)
            .is_err()
        {
            sh.epoch_not_opened(page);
        }
    }

    /// The interleaving behind issue 10's `cc 116a9db7…` failure, replayed
    /// step by step: a taint whose bookkeeping starts before a clear of the
    /// previous epoch and whose exchange lands after it. Both clears are
    /// legal (one per epoch) and the model must accept them.
    #[test]
    fn taint_racing_a_clear_is_a_new_epoch() {
        let states = PageStates::new(1, PageState::Unpopulated);
        states
            .try_transition(0, PageState::Unpopulated, PageState::Dirty)
            .expect("dirty");
        let sh = Shadow::new(1, u64::MAX);
        // Tainter, first half: announces an epoch while the page is Dirty.
        sh.opening_epoch();
        // Clearer A claims and finishes the current epoch.
        assert_eq!(states.claim_dirty(0), Some(0));
        sh.cleared(0, 1);
        states
            .try_transition(0, PageState::Clearing, PageState::Clean)
            .expect("done");
        // Tainter, second half: its exchange now succeeds, a new epoch.
        states
            .try_transition(0, PageState::Clean, PageState::Dirty)
            .expect("taint");
        // Clearer B claims the new epoch: legal, the model must not object.
        assert_eq!(states.claim_dirty(0), Some(0));
        sh.cleared(0, 2);
        states
            .try_transition(0, PageState::Clearing, PageState::Clean)
            .expect("done");
        assert_eq!(sh.open_epochs.load(Ordering::Acquire), 0);
        // And a taint that finds the page mapped changes nothing.
        states
            .try_transition(0, PageState::Clean, PageState::Mapped)
            .expect("map");
        taint(&states, &sh, 0);
        assert_eq!(states.get(0), Ok(PageState::Mapped));
        assert_eq!(sh.open_epochs.load(Ordering::Acquire), 0);
    }

    /// The model is not vacuous: a second clear in one epoch (what a machine
    /// that let two clearers claim one `Dirty` page would produce) fails.
    #[test]
    #[should_panic(expected = "cleared twice in one dirty epoch")]
    fn the_model_catches_two_clears_in_one_epoch() {
        let sh = Shadow::new(1, u64::MAX);
        sh.cleared(0, 1);
        sh.cleared(0, 2);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn state_machine_hammered_from_threads(
            initial in proptest::collection::vec(any::<u8>(), 1..48),
            threads in 2usize..6,
            ops in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..400), 6),
        ) {
            hammer(&initial, threads, &ops);
        }
    }
}
