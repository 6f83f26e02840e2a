//! What to do with one page, as a function of its [`PageState`]: the fault
//! service's policy, apart from the userfaultfd mechanism (Firecracker's
//! `uffd_utils.rs` split: the runtime owns the poll loop, the policy decides
//! per fault).
//!
//! The scrub-before-map invariant lives here. A page reaches a guest only
//! through [`PageOps::install`], and `install` is called only on a page this
//! module has just seen in `Mapped`; `Mapped` is entered only from `Clean`
//! (the state table has no other way in), and `Clean` only from `Clearing`,
//! which one thread at a time owns while it clears. So:
//!
//! * a fault on a **dirty** page claims it (`Dirty → Clearing`; the
//!   exchange picks exactly one winner among handlers and scrubbers), clears
//!   it with the faulting neighbourhood last, then `Clean → Mapped` and
//!   install;
//! * a fault on a page **being cleared** by another thread is left to it
//!   ([`Served::Coalesced`]): a handler or scrubber of the service installs
//!   and wakes the whole page when done, which wakes this fault too (its
//!   thread is already on the wait queue when its event is read); the
//!   service also re-checks such faults every millisecond, since the owner
//!   may be one of the pool's scrubbers, which clears but does not install;
//! * a **clean** page (scrubbed ahead) is mapped and installed;
//! * a **mapped** page (a second vCPU on the same page, or the VMM zapped the
//!   PTE with `MADV_DONTNEED`) is installed again: `EEXIST` is served, and
//!   the page holds this guest's own data;
//! * an **unpopulated** page raising MINOR was put in the page cache by the
//!   kernel's own zeroing fault in the VMM's MINOR-only range (the pool never
//!   touched it), i.e. it holds zeros or this guest's data: it is adopted
//!   (`Unpopulated → Clearing → Clean → Mapped`) without clearing;
//! * a **MISSING** fault (the VMM also registered MISSING mode, and no page
//!   is in the page cache) is filled with zeros by `install` itself
//!   (`UFFDIO_COPY`), after the same state walk: there is no old data to leak.
//!
//! A scrubber ([`scrub_page`]) claims dirty pages the same way, clears them
//! whole and installs them ahead of any fault.

use guest_mem::{PageState, PageStates, StateError};

use crate::uffd::FaultKind;

/// How a page is cleared and handed to the VMM; implemented by the service
/// (daemon mapping + uffd) and by test doubles.
pub trait PageOps {
    /// Error of [`PageOps::install`].
    type Error;

    /// Zeroes the page. `fault_offset` (bytes from the page start) is where
    /// the guest faulted, cleared last so it is cache-hot; `None` for a
    /// background scrub (the whole page with the bulk kernel).
    fn clear(&self, fault_offset: Option<usize>);

    /// Installs the page into the VMM and wakes threads waiting on it
    /// (`UFFDIO_CONTINUE` for MINOR; a copy of zeros for MISSING). `EEXIST`
    /// counts as installed.
    ///
    /// # Errors
    ///
    /// The ioctl's error (the VMM's address space is gone, the range was
    /// unmapped).
    fn install(&self, kind: FaultKind) -> Result<(), Self::Error>;
}

/// What serving a fault did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// The page was dirty: cleared, then installed.
    Cleared,
    /// The page was already clean: installed.
    WasClean,
    /// The page was already mapped: installed again (or found installed).
    WasMapped,
    /// A never-pooled page in the page cache (the guest's own): adopted and installed.
    Adopted,
    /// Another thread is clearing it and will install it.
    Coalesced,
    /// The page is in a state the service must not install from (the region
    /// is being taken back); the fault is left alone.
    Refused(PageState),
}

/// Errors of the policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError<E> {
    /// The page index is not in the region (a bug in the caller's table).
    #[error("page state")]
    State(#[source] StateError),
    /// Installing failed.
    #[error("install")]
    Install(#[source] E),
}

/// Upper bound on state re-reads while racing other threads. Each retry
/// follows a state change by another thread, and the table is acyclic within
/// one dirty epoch, so a handful suffice; the bound only guards against a
/// freer cycling the page forever.
const MAX_RACES: usize = 64;

/// Serves one fault on `page` (see the module docs).
///
/// # Errors
///
/// [`PolicyError::State`] for a page index out of range,
/// [`PolicyError::Install`] when installing failed.
pub fn serve_fault<O: PageOps>(
    states: &PageStates,
    page: usize,
    kind: FaultKind,
    fault_offset: usize,
    ops: &O,
) -> Result<Served, PolicyError<O::Error>> {
    for _ in 0..MAX_RACES {
        let state = states.get(page).map_err(PolicyError::State)?;
        match state {
            PageState::Dirty | PageState::Unpopulated => {
                if states
                    .try_transition(page, state, PageState::Clearing)
                    .is_err()
                {
                    continue; // someone else moved it; look again
                }
                // This thread owns the page now.
                let served = match (state, kind) {
                    (PageState::Dirty, FaultKind::Minor | FaultKind::WriteProtect) => {
                        ops.clear(Some(fault_offset));
                        Served::Cleared
                    }
                    // MISSING: nothing in the page cache; install fills zeros.
                    (PageState::Dirty, FaultKind::Missing) => Served::Cleared,
                    _ => Served::Adopted,
                };
                finish_clearing(states, page);
                return match map_and_install(states, page, kind, ops)? {
                    Some(_) => Ok(served),
                    None => Ok(Served::Refused(
                        states.get(page).map_err(PolicyError::State)?,
                    )),
                };
            }
            PageState::Clearing => return Ok(Served::Coalesced),
            PageState::Clean => {
                return match map_and_install(states, page, kind, ops)? {
                    Some(_) => Ok(Served::WasClean),
                    None => Ok(Served::Refused(
                        states.get(page).map_err(PolicyError::State)?,
                    )),
                };
            }
            PageState::Mapped => {
                ops.install(kind).map_err(PolicyError::Install)?;
                return Ok(Served::WasMapped);
            }
        }
    }
    Ok(Served::Refused(
        states.get(page).map_err(PolicyError::State)?,
    ))
}

/// A scrubber's step on `page`: if it is dirty, claim it, clear it whole,
/// and install it ahead of any fault. Returns `Ok(true)` when this call
/// cleared the page; `Ok(false)` when it was not dirty (already claimed,
/// clean, mapped or unpopulated: nothing to do).
///
/// # Errors
///
/// As [`serve_fault`]; the page stays `Mapped` (clean) when installing failed.
pub fn scrub_page<O: PageOps>(
    states: &PageStates,
    page: usize,
    ops: &O,
) -> Result<bool, PolicyError<O::Error>> {
    if states
        .try_transition(page, PageState::Dirty, PageState::Clearing)
        .is_err()
    {
        return Ok(false);
    }
    ops.clear(None);
    finish_clearing(states, page);
    map_and_install(states, page, FaultKind::Minor, ops)?;
    Ok(true)
}

/// A scrubber's step on a page that is already clean (a pooled region
/// scrubbed earlier): map and install it ahead of any fault. Returns
/// `Ok(true)` when it was installed by this call.
///
/// # Errors
///
/// As [`serve_fault`].
pub fn precontinue<O: PageOps>(
    states: &PageStates,
    page: usize,
    ops: &O,
) -> Result<bool, PolicyError<O::Error>> {
    match states.try_transition(page, PageState::Clean, PageState::Mapped) {
        Ok(()) => {
            ops.install(FaultKind::Minor)
                .map_err(PolicyError::Install)?;
            Ok(true)
        }
        Err(StateError::Conflict { .. }) => Ok(false),
        Err(e) => Err(PolicyError::State(e)),
    }
}

/// `Clearing → Clean` by the page's owner.
fn finish_clearing(states: &PageStates, page: usize) {
    if let Err(e) = states.try_transition(page, PageState::Clearing, PageState::Clean) {
        // Only the owner leaves Clearing, so this cannot happen.
        tracing::error!(error = %e, "a page left Clearing under its owner");
    }
}

/// `Clean → Mapped` (or already `Mapped`), then install. `Ok(None)` when the
/// page is in neither state any more (taken back): nothing is installed.
fn map_and_install<O: PageOps>(
    states: &PageStates,
    page: usize,
    kind: FaultKind,
    ops: &O,
) -> Result<Option<()>, PolicyError<O::Error>> {
    match states.try_transition(page, PageState::Clean, PageState::Mapped) {
        Ok(())
        | Err(StateError::Conflict {
            actual: PageState::Mapped,
            ..
        }) => {}
        Err(StateError::Conflict { .. }) => return Ok(None),
        Err(e) => return Err(PolicyError::State(e)),
    }
    ops.install(kind).map_err(PolicyError::Install)?;
    Ok(Some(()))
}

#[cfg(test)]
mod tests {
    //! Property test: the page-state machine under concurrent fault
    //! handlers, scrubbers and a freer, through the real policy functions and
    //! a model of page contents.

    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Barrier, Mutex};

    use proptest::prelude::*;

    /// Page contents in the model.
    const ZERO: u64 = 0;
    /// Stale data of the previous tenant.
    const STALE: u64 = u64::MAX;

    /// The shadow of one page.
    #[derive(Default)]
    struct Shadow {
        /// Serialises the guest (writes, being given the page) against the
        /// freer: a VM is gone before its memory is taken back (the daemon's
        /// holder scan), so the two never overlap in reality either.
        guest: Mutex<()>,
        /// Dirty epoch: bumped by the freer when it moves the page to Dirty.
        epoch: AtomicU64,
        /// Contents: ZERO, STALE, or `epoch + 1` of the guest that wrote.
        content: AtomicU64,
        /// Clears per epoch (index = epoch).
        clears: Mutex<Vec<u32>>,
        /// Installed into the current epoch's guest.
        installed: AtomicBool,
        /// `epoch + 1` of the last MISSING fill (zeros copied in instead of a clear).
        filled: AtomicU64,
    }

    struct Model {
        states: PageStates,
        pages: Vec<Shadow>,
        /// Fault handlers and scrubbers hold it shared for one operation;
        /// the freer takes it exclusively. Frees interleave with faults
        /// between operations, as in the daemon, which stops a region's
        /// fault service (joining its threads) before taking the region back.
        quiesce: std::sync::RwLock<()>,
    }

    /// The ops of one page.
    struct Ops<'a> {
        model: &'a Model,
        page: usize,
    }

    impl PageOps for Ops<'_> {
        type Error = guest_mem::StateError;

        fn clear(&self, _fault_offset: Option<usize>) {
            let sh = &self.model.pages[self.page];
            assert_eq!(
                self.model.states.get(self.page),
                Ok(PageState::Clearing),
                "cleared without owning"
            );
            let epoch = usize::try_from(sh.epoch.load(Ordering::Acquire)).expect("small");
            let mut clears = sh.clears.lock().expect("lock");
            if clears.len() <= epoch {
                clears.resize(epoch + 1, 0);
            }
            clears[epoch] += 1;
            assert_eq!(
                clears[epoch], 1,
                "page {} cleared twice in epoch {epoch}",
                self.page
            );
            sh.content.store(ZERO, Ordering::Release);
        }

        fn install(&self, kind: FaultKind) -> Result<(), Self::Error> {
            let sh = &self.model.pages[self.page];
            let _guest = sh.guest.lock().expect("lock");
            // Installed only from Mapped: anything else gives a guest a page
            // that was not cleared in this epoch.
            let state = self.model.states.get(self.page)?;
            assert_eq!(
                state,
                PageState::Mapped,
                "page {} installed while {state}",
                self.page
            );
            if kind == FaultKind::Missing {
                // A MISSING fault means no page in the page cache: the fill
                // copies zeros (in the model, whatever was there is gone).
                sh.content.store(ZERO, Ordering::Release);
                sh.filled
                    .store(sh.epoch.load(Ordering::Acquire) + 1, Ordering::Release);
            }
            let epoch = sh.epoch.load(Ordering::Acquire);
            let content = sh.content.load(Ordering::Acquire);
            assert!(
                content == ZERO || content == epoch + 1,
                "page {} installed with contents {content:#x} in epoch {epoch}",
                self.page
            );
            sh.installed.store(true, Ordering::Release);
            Ok(())
        }
    }

    impl Model {
        fn new(initial: &[u8]) -> Self {
            let states = PageStates::new(initial.len(), PageState::Unpopulated);
            let pages: Vec<Shadow> = initial.iter().map(|_| Shadow::default()).collect();
            for (page, kind) in initial.iter().enumerate() {
                // Two in three pages are pooled (dirty, in the page cache);
                // the rest were never populated.
                if kind % 3 != 2 {
                    states
                        .try_transition(page, PageState::Unpopulated, PageState::Dirty)
                        .expect("setup");
                    pages[page].content.store(STALE, Ordering::Relaxed);
                }
            }
            Self {
                states,
                pages,
                quiesce: std::sync::RwLock::new(()),
            }
        }

        fn ops(&self, page: usize) -> Ops<'_> {
            Ops { model: self, page }
        }

        /// The guest writes to a page it was given.
        fn guest_writes(&self, page: usize) {
            let sh = &self.pages[page];
            let _guest = sh.guest.lock().expect("lock");
            if self.states.get(page) == Ok(PageState::Mapped)
                && sh.installed.load(Ordering::Acquire)
            {
                let e = sh.epoch.load(Ordering::Acquire);
                sh.content.store(e + 1, Ordering::Release);
            }
        }

        /// The freer takes one page back (its VM is gone): new epoch, dirty.
        /// Pages being cleared are left to their owner, as `mark_all_dirty` does.
        fn free(&self, page: usize) {
            let sh = &self.pages[page];
            let _guest = sh.guest.lock().expect("lock");
            loop {
                match self.states.get(page).expect("page") {
                    PageState::Dirty | PageState::Clearing => return,
                    s => {
                        // The epoch moves first, so a clearer that wins the
                        // page after it is Dirty counts in the new epoch; it is
                        // moved back when the page changed under us (no clear
                        // can start meanwhile: only the freer makes pages Dirty).
                        sh.epoch.fetch_add(1, Ordering::AcqRel);
                        if self
                            .states
                            .try_transition(page, s, PageState::Dirty)
                            .is_err()
                        {
                            sh.epoch.fetch_sub(1, Ordering::AcqRel);
                            continue;
                        }
                        sh.installed.store(false, Ordering::Release);
                        if sh.content.load(Ordering::Acquire) != ZERO {
                            sh.content.store(STALE, Ordering::Release);
                        }
                        return;
                    }
                }
            }
        }
    }

    fn run(
        initial: &[u8],
        handlers: usize,
        scrubbers: usize,
        ops: &[Vec<u8>],
        free_at: Option<usize>,
    ) {
        let model = Model::new(initial);
        let pages = initial.len();
        let barrier = Barrier::new(handlers + scrubbers + 1);
        std::thread::scope(|s| {
            let mut joins = Vec::new();
            for (t, my_ops) in ops.iter().take(handlers).enumerate() {
                let (model, barrier) = (&model, &barrier);
                joins.push(s.spawn(move || {
                    barrier.wait();
                    for (i, &op) in my_ops.iter().enumerate() {
                        let page = (usize::from(op) + i * 3 + t) % pages;
                        if free_at == Some(i) && t == 0 {
                            let _all = model.quiesce.write().expect("lock");
                            for p in 0..pages {
                                model.free(p);
                            }
                        }
                        let _op = model.quiesce.read().expect("lock");
                        match op % 4 {
                            // A fault from the guest touching the page.
                            0 | 1 => {
                                let kind = if op % 8 == 0 {
                                    FaultKind::Missing
                                } else {
                                    FaultKind::Minor
                                };
                                let served = serve_fault(
                                    &model.states,
                                    page,
                                    kind,
                                    usize::from(op) * 4096,
                                    &model.ops(page),
                                )
                                .expect("served");
                                assert!(
                                    !matches!(
                                        served,
                                        Served::Refused(PageState::Clean | PageState::Mapped)
                                    ),
                                    "{served:?}"
                                );
                            }
                            // The guest writes to what it has.
                            2 => model.guest_writes(page),
                            // A prioritised scrub of the next page.
                            _ => {
                                let next = (page + 1) % pages;
                                scrub_page(&model.states, next, &model.ops(next)).expect("scrub");
                            }
                        }
                    }
                }));
            }
            for t in 0..scrubbers {
                let (model, barrier) = (&model, &barrier);
                joins.push(s.spawn(move || {
                    barrier.wait();
                    // Guest-physical order from a per-scrubber start.
                    for k in 0..pages {
                        let page = (k + t * pages / scrubbers) % pages;
                        let _op = model.quiesce.read().expect("lock");
                        if scrub_page(&model.states, page, &model.ops(page)).expect("scrub") {
                            continue;
                        }
                        precontinue(&model.states, page, &model.ops(page)).expect("precontinue");
                    }
                }));
            }
            // Counts conserve while everything runs.
            let (model, barrier) = (&model, &barrier);
            let observer = s.spawn(move || {
                barrier.wait();
                for _ in 0..200 {
                    assert_eq!(model.states.counts().total(), pages);
                    std::thread::yield_now();
                }
            });
            for j in joins {
                if let Err(p) = j.join() {
                    std::panic::resume_unwind(p);
                }
            }
            if let Err(p) = observer.join() {
                std::panic::resume_unwind(p);
            }
        });
        // Drain: a final scrub pass leaves no dirty page behind.
        for page in 0..pages {
            scrub_page(&model.states, page, &model.ops(page)).expect("scrub");
        }
        let counts = model.states.counts();
        assert_eq!(counts.total(), pages);
        assert_eq!(counts.dirty + counts.clearing, 0, "{counts:?}");
        for (page, sh) in model.pages.iter().enumerate() {
            let clears = sh.clears.lock().expect("lock");
            assert!(clears.iter().all(|&c| c <= 1), "page {page}: {clears:?}");
            let state = model.states.get(page).expect("page");
            let e = sh.epoch.load(Ordering::Acquire);
            let c = sh.content.load(Ordering::Acquire);
            assert!(
                c == ZERO || c == e + 1,
                "page {page} ({state}) holds {c:#x} in epoch {e}"
            );
            // Every page that was dirty in its current epoch (all of them but
            // never-pooled pages still in epoch 0) was cleared exactly once in
            // it, or served by a MISSING fill of zeros (no page to clear).
            if e > 0 || initial[page] % 3 != 2 {
                let now = clears
                    .get(usize::try_from(e).expect("small"))
                    .copied()
                    .unwrap_or(0);
                let filled = sh.filled.load(Ordering::Acquire) == e + 1;
                assert!(
                    now == 1 || (now == 0 && filled),
                    "page {page} ({state}) epoch {e}: {clears:?}"
                );
            } else {
                assert!(
                    clears.is_empty(),
                    "never-pooled page {page} was cleared: {clears:?}"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        #[test]
        fn fault_scrub_free_keeps_scrub_before_map(
            initial in proptest::collection::vec(any::<u8>(), 1..24),
            handlers in 1usize..4,
            scrubbers in 0usize..3,
            ops in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 4),
            free_at in proptest::option::of(0usize..200),
        ) {
            run(&initial, handlers, scrubbers, &ops, free_at);
        }
    }

    /// Deterministic walk through each branch.
    #[test]
    fn each_state_is_served_as_documented() {
        let model = Model::new(&[0, 0, 2, 0]);
        let ops = |p| model.ops(p);
        assert_eq!(
            serve_fault(&model.states, 0, FaultKind::Minor, 0, &ops(0)).expect("dirty"),
            Served::Cleared
        );
        assert_eq!(model.states.get(0), Ok(PageState::Mapped));
        assert_eq!(
            serve_fault(&model.states, 0, FaultKind::Minor, 0, &ops(0)).expect("mapped"),
            Served::WasMapped
        );
        assert!(scrub_page(&model.states, 1, &ops(1)).expect("scrub"));
        assert!(!scrub_page(&model.states, 1, &ops(1)).expect("scrub again"));
        assert_eq!(
            model.states.get(1),
            Ok(PageState::Mapped),
            "scrubbed pages are installed ahead"
        );
        assert_eq!(
            serve_fault(&model.states, 2, FaultKind::Minor, 0, &ops(2)).expect("adopt"),
            Served::Adopted
        );
        assert_eq!(
            model.pages[2].clears.lock().expect("lock").len(),
            0,
            "adopted without clearing"
        );
        model
            .states
            .try_transition(3, PageState::Dirty, PageState::Clearing)
            .expect("claim");
        ops(3).clear(None);
        assert_eq!(
            serve_fault(&model.states, 3, FaultKind::Minor, 0, &ops(3)).expect("busy"),
            Served::Coalesced
        );
        model
            .states
            .try_transition(3, PageState::Clearing, PageState::Clean)
            .expect("done");
        assert_eq!(
            serve_fault(&model.states, 3, FaultKind::Minor, 0, &ops(3)).expect("clean"),
            Served::WasClean
        );
        assert!(matches!(
            serve_fault(&model.states, 9, FaultKind::Minor, 0, &ops(0)),
            Err(PolicyError::State(StateError::OutOfRange { .. }))
        ));
    }
}
