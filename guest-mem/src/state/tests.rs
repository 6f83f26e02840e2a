//! Tests of a region's page state.

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
