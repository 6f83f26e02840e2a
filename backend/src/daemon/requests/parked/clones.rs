//! Parked VMs that clones map: CLONE in SHARED mode sends a parked VM's
//! memory read-only to a clone's launcher, whose cloud-hypervisor maps it
//! privately (copy-on-write). The template stays parked and unchanged;
//! each such clone is counted against it for as long as the launcher's
//! connection lasts (the launcher keeps it open while its VM runs).
//!
//! While a template has clones, RESTORE and UNPARK of it are refused:
//! a restored VM would write the memory the clones still read for every
//! page they have not written, and an UNPARK would let the pool reuse it.
//! The count is a courtesy to the tenant, not the safety: memory a clone
//! still maps never leaves quarantine (the holder scan), whatever the
//! count says.
//!
//! The budget: the pages a shared clone writes come from the kernel's
//! free huge pages, not from the pool. Its cloud-hypervisor maps with the
//! kernel's reservation (`ch_migration::clone`: `reserve` on each zone),
//! so a clone that starts can write every page without `SIGBUS`, and a
//! CLONE is refused when the huge pages no one has taken or reserved
//! (`free - resv`), less those promised to clones admitted but not yet
//! mapped, would drop below `clones.headroom` once it maps.
//!
//! The promise: a clone is admitted before its cloud-hypervisor maps
//! anything, so the kernel's counts do not show it yet. Its pages stay
//! promised (subtracted from what the next CLONE sees) until its launcher
//! says the mapping is made, by closing its end of the migration socket
//! once its cloud-hypervisor runs, or its connection ends. Two CLONEs at
//! once can therefore never both be admitted on the same pages. Between
//! the mapping and the close the clone's pages would count twice (in
//! `HugePages_Rsvd` and as promised), and with many clones started at once
//! most of them are in that moment. So before a CLONE is refused, each
//! clone still promised is looked at: once its launcher's child (the
//! clone's VMM) maps the template's file (`/proc/PID/maps`), the kernel
//! made that mapping's reservation before the mapping showed, so its
//! promise ends there and its pages count once. A CLONE is refused only
//! on pages that are truly taken or promised to clones that have not
//! mapped yet; it is never admitted on pages another was promised.
//!
//! By allocation and connection: a takeover carries each connection's
//! count in its record (`ConnectionRecord::shared_clones`), and the
//! successor counts them again when it adopts the connection. A restart
//! from systemd's fd store cannot (no connection survives it), and a
//! clone's cloud-hypervisor may outlive its launcher's connection (the
//! launcher killed). Such clones run on, mapping the template, uncounted.
//! So the count is not the only guard: a template a shared clone was ever
//! admitted on stays *marked* (the mark travels in the state document,
//! `State::clone_templates`; a start from a document written while the
//! daemon served, which may be older than the last CLONE, marks every
//! parked VM). A RESTORE or UNPARK of a marked template with no clone
//! counted scans `/proc` for processes that map its files
//! ([`mapped_by`]): any found, it is refused naming them; none, the mark
//! is cleared and it goes on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use guest_mem::pools::PoolCounts;
use guest_mem::{PageSize, Region};

use crate::daemon::ids::{AllocId, SessionId};
use crate::daemon::peers::holders::{mappers, maps_any, FileId, Owned};

/// Why a shared clone was refused for want of huge pages.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// The headroom would be crossed.
    #[error(
        "a shared clone of {name:?} may write all its {need} pages of {page}: \
         {available} are free and unreserved ({promised} of them promised to \
         clones still starting), which would leave {left}, \
         below the headroom of {headroom} (short by {short})"
    )]
    Short {
        /// The template.
        name: String,
        /// Pages the clone may write.
        need: u64,
        /// Its page size, in words.
        page: String,
        /// Free and unreserved pages now (the kernel's counts).
        available: u64,
        /// Pages of those promised to clones admitted but not yet mapped.
        promised: u64,
        /// What would be left.
        left: i128,
        /// The headroom, pages.
        headroom: u64,
        /// Pages missing.
        short: u64,
    },
    /// The kernel's counts cannot be read.
    #[error("cannot read the free huge pages of {page}: {source}")]
    Counts {
        /// The page size, in words.
        page: String,
        /// The error.
        #[source]
        source: guest_mem::pools::PoolError,
    },
}

/// One shared clone: its template, the connection that holds it, that
/// connection's process (the clone's launcher, whose child runs the
/// clone) when known, and the pages still promised to it.
#[derive(Debug)]
struct Hold {
    template: AllocId,
    session: SessionId,
    launcher: Option<u32>,
    promise: Option<Promise>,
    /// The template's files, which the clone's VMM maps.
    files: Vec<FileId>,
}

/// Huge pages a clone was admitted on that its mapping does not show yet.
/// Dropping it (the hold ends) wakes whoever waits on its launcher.
#[derive(Debug)]
struct Promise {
    page_size: PageSize,
    pages: u64,
    _ended: tokio::sync::oneshot::Sender<()>,
}

/// The holds by clone id, the last id given, and the marked templates
/// (see the module docs).
#[derive(Debug, Default)]
struct Book {
    holds: BTreeMap<u64, Hold>,
    last_id: u64,
    marked: BTreeSet<AllocId>,
}

impl Book {
    fn insert(&mut self, hold: Hold) -> u64 {
        self.last_id += 1;
        self.holds.insert(self.last_id, hold);
        self.last_id
    }

    /// Ends the promise of every clone whose VMM (a child of its
    /// launcher) already maps its template's files: the kernel's counts
    /// show that mapping's reservation. Reads `/proc` (a few small files
    /// per clone still starting; only when a CLONE would be refused).
    fn settle_mapped(&mut self) {
        for hold in self.holds.values_mut() {
            let Some(launcher) = hold.launcher else {
                continue;
            };
            if hold.promise.is_some()
                && children(launcher)
                    .into_iter()
                    .any(|vmm| maps_any(vmm, &hold.files))
            {
                hold.promise = None;
            }
        }
    }

    /// Pages of `page_size` promised to clones not yet mapped.
    fn promised(&self, page_size: PageSize) -> u64 {
        self.holds
            .values()
            .filter_map(|h| h.promise.as_ref())
            .filter(|p| p.page_size == page_size)
            .map(|p| p.pages)
            .sum()
    }
}

/// A clone admitted: its id, and an event that fires when its hold ends
/// (`None` when nothing was promised: a template not on huge pages).
#[derive(Debug)]
pub struct Admitted {
    /// The clone's id ([`Clones::release`], [`Clones::mapped`]).
    pub id: u64,
    /// Resolves (with an error) once the clone no longer counts.
    pub ended: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// Every running shared clone, and the headroom their budget keeps.
#[derive(Debug, Default)]
pub struct Clones {
    book: Mutex<Book>,
    headroom_bytes: u64,
}

impl Clones {
    /// No clones yet; free huge pages are kept at `headroom_bytes` at least.
    pub fn new(headroom_bytes: u64) -> Self {
        Self {
            book: Mutex::default(),
            headroom_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a shared clone of `template` (`bytes` of `page_size`,
    /// parked as `name`) for `session` if the budget allows it, its pages
    /// promised until [`Clones::mapped`] or the hold ends.
    ///
    /// # Errors
    ///
    /// [`BudgetError`]: the headroom would be crossed, or the kernel's
    /// counts cannot be read.
    pub fn admit(
        &self,
        (template, files): (AllocId, Vec<FileId>),
        (session, launcher): (SessionId, Option<u32>),
        name: &str,
        (bytes, page_size): (u64, PageSize),
    ) -> Result<Admitted, BudgetError> {
        let mut book = self.lock();
        let mut promise = None;
        let mut ended = None;
        if page_size.is_huge() {
            let page = page_size.to_string();
            let kernel = PoolCounts::read(page_size, None)
                .map_err(|source| BudgetError::Counts {
                    page: page.clone(),
                    source,
                })?
                .map_or(0, |c| c.available());
            let need = bytes.div_ceil(page_size.bytes());
            let headroom = self.headroom_bytes.div_ceil(page_size.bytes());
            let mut promised = book.promised(page_size);
            if promised > 0
                && check_budget(kernel.saturating_sub(promised), need, headroom).is_err()
            {
                book.settle_mapped();
                promised = book.promised(page_size);
            }
            let counts = kernel.saturating_sub(promised);
            check_budget(counts, need, headroom).map_err(|short| BudgetError::Short {
                name: name.to_string(),
                need,
                page,
                available: kernel,
                promised,
                left: i128::from(counts) - i128::from(need),
                headroom,
                short,
            })?;
            let (tx, rx) = tokio::sync::oneshot::channel();
            promise = Some(Promise {
                page_size,
                pages: need,
                _ended: tx,
            });
            ended = Some(rx);
        }
        book.marked.insert(template);
        let id = book.insert(Hold {
            template,
            session,
            launcher,
            promise,
            files,
        });
        Ok(Admitted { id, ended })
    }

    /// The clone `id` has mapped its memory (or its launcher is gone): its
    /// pages show in the kernel's counts and are promised no longer.
    pub fn mapped(&self, id: u64) {
        if let Some(hold) = self.lock().holds.get_mut(&id) {
            hold.promise = None;
        }
    }

    /// The clone `id` no longer counts (its launcher never got it).
    pub fn release(&self, id: u64) {
        self.lock().holds.remove(&id);
    }

    /// Every clone of `session` ends (the connection ended).
    pub fn release_session(&self, session: SessionId) {
        self.lock().holds.retain(|_, h| h.session != session);
    }

    /// The running clones of `template`, and the connections holding them.
    pub fn of(&self, template: AllocId) -> (usize, Vec<SessionId>) {
        let book = self.lock();
        let mine: Vec<SessionId> = book
            .holds
            .values()
            .filter(|h| h.template == template)
            .map(|h| h.session)
            .collect();
        let mut sessions = mine.clone();
        sessions.sort_unstable();
        sessions.dedup();
        (mine.len(), sessions)
    }

    /// The templates `session`'s clones map, one entry a clone (for the
    /// takeover document).
    pub fn templates_of(&self, session: SessionId) -> Vec<AllocId> {
        self.lock()
            .holds
            .values()
            .filter(|h| h.session == session)
            .map(|h| h.template)
            .collect()
    }

    /// Counts again the clones a predecessor counted for `session` (a
    /// takeover passed the connection on): no budget check, they run. A
    /// promise does not cross the takeover: the successor counts each
    /// clone as mapped.
    pub fn resume(&self, (session, launcher): (SessionId, Option<u32>), templates: &[AllocId]) {
        let mut book = self.lock();
        for &template in templates {
            book.insert(Hold {
                template,
                session,
                launcher,
                promise: None,
                files: Vec::new(),
            });
        }
    }

    /// Bytes of huge pages the shared clones of `template` wrote (their
    /// own copies: smaps `Private_Hugetlb` of each launcher's children,
    /// the clones' cloud-hypervisors). Read from `/proc`, outside the
    /// lock; a process gone or unreadable counts 0.
    pub fn written(&self, template: AllocId) -> u64 {
        let mut launchers: Vec<u32> = self
            .lock()
            .holds
            .values()
            .filter(|h| h.template == template)
            .filter_map(|h| h.launcher)
            .collect();
        launchers.sort_unstable();
        launchers.dedup();
        launchers
            .into_iter()
            .flat_map(children)
            .map(private_hugetlb)
            .sum()
    }

    /// Marks `templates`: they may be mapped by clones not counted (a
    /// predecessor's marks, or every VM parked when its document was
    /// written while it served).
    pub fn mark(&self, templates: impl IntoIterator<Item = AllocId>) {
        self.lock().marked.extend(templates);
    }

    /// The marked templates (for the state document).
    pub fn marked(&self) -> Vec<AllocId> {
        self.lock().marked.iter().copied().collect()
    }

    /// Whether `template` is marked: a RESTORE or UNPARK of it looks for
    /// processes that map it first ([`mapped_by`]).
    pub fn is_marked(&self, template: AllocId) -> bool {
        self.lock().marked.contains(&template)
    }

    /// No process maps `template` and no clone counts: its mark is
    /// cleared (a CLONE of it marks it again).
    pub fn clear_mark(&self, template: AllocId) {
        let mut book = self.lock();
        if !book.holds.values().any(|h| h.template == template) {
            book.marked.remove(&template);
        }
    }

    /// Running shared clones in all.
    pub fn running(&self) -> usize {
        self.lock().holds.len()
    }

    /// Huge pages of `page_size` promised to clones not yet mapped.
    pub fn promised(&self, page_size: PageSize) -> u64 {
        self.lock().promised(page_size)
    }
}

/// The children of process `pid` (at most 64; none when unreadable).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    out.truncate(64);
    out
}

/// Bytes of huge pages process `pid` holds privately (`Private_Hugetlb`
/// of `/proc/PID/smaps_rollup`, in kB there); 0 when unreadable.
fn private_hugetlb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("Private_Hugetlb:"))
        .filter_map(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .sum::<u64>()
        .saturating_mul(1024)
}

/// `Ok` when `available` pages less `need` leave `headroom` at least;
/// else the pages missing.
fn check_budget(available: u64, need: u64, headroom: u64) -> Result<(), u64> {
    let want = need.saturating_add(headroom);
    if available >= want {
        Ok(())
    } else {
        Err(want - available)
    }
}

/// The processes (pids, at most 32) other than the daemon, its
/// predecessor still running and its own fault helpers, that map any of
/// `regions`' files: a full `/proc` scan, on a blocking thread.
pub async fn mapped_by(regions: &[Arc<Region>], predecessor: Option<i32>) -> Vec<i32> {
    let targets: Vec<Owned> = regions
        .iter()
        .filter_map(|r| {
            Owned::region(
                r.fd(),
                r.as_ptr() as usize,
                usize::try_from(r.len()).unwrap_or(usize::MAX),
            )
            .ok()
        })
        .collect();
    let skip = move |pid| predecessor == Some(pid) || crate::fault_helpers::is_own_helper(pid);
    tokio::task::spawn_blocking(move || mappers(&targets, &skip))
        .await
        .unwrap_or_default()
}

/// Why a RESTORE or UNPARK of a template that processes still map is
/// refused, naming them.
pub fn still_mapped(name: &str, request: &str, pids: &[i32]) -> String {
    format!(
        "{name:?} is still mapped by process(es) {pids:?}, shared clones of it the daemon no \
         longer counts (their launchers' connections ended: a restart from systemd's fd store, \
         or a launcher gone before its VM): {request} would change or free the memory they map; \
         stop them first"
    )
}

/// Why a RESTORE or UNPARK of a template with running clones is refused.
pub fn has_clones(name: &str, request: &str, (count, sessions): (usize, Vec<SessionId>)) -> String {
    format!(
        "{name:?} is the template of {count} running shared clone(s) (connections {sessions:?}): \
         {request} would change or free the memory they map; stop them first"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_keeps_the_headroom_and_names_the_shortfall() {
        assert_eq!(check_budget(10, 4, 6), Ok(()));
        assert_eq!(check_budget(10, 4, 7), Err(1));
        assert_eq!(check_budget(0, 4, 0), Err(4));
        assert_eq!(check_budget(3, u64::MAX, 1), Err(u64::MAX - 3));
    }

    #[test]
    fn clones_count_per_template_until_their_connection_ends() {
        let clones = Clones::new(0);
        let base = (4 << 10, PageSize::Base4K);
        let a = clones
            .admit((1, Vec::new()), (10, None), "t", base)
            .expect("no budget on 4 KiB");
        clones
            .admit((1, Vec::new()), (11, None), "t", base)
            .expect("admitted");
        clones
            .admit((2, Vec::new()), (11, None), "u", base)
            .expect("admitted");
        assert_eq!(clones.written(1), 0, "no launcher known, nothing read");
        assert_eq!(clones.of(1), (2, vec![10, 11]));
        clones.release_session(11);
        assert_eq!(clones.of(1), (1, vec![10]));
        assert_eq!(clones.of(2).0, 0);
        clones.release(a.id);
        assert_eq!(clones.running(), 0);
        assert!(a.ended.is_none(), "nothing promised on 4 KiB pages");
    }

    #[test]
    fn a_promise_counts_until_mapped_and_its_end_wakes_the_waiter() {
        let clones = Clones::new(0);
        let two_m = PageSize::Huge2M;
        let promise = |pages| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let hold = Hold {
                template: 1,
                session: 10,
                launcher: None,
                promise: Some(Promise {
                    page_size: two_m,
                    pages,
                    _ended: tx,
                }),
                files: Vec::new(),
            };
            (hold, rx)
        };
        let (a, mut a_ended) = promise(3);
        let (b, mut b_ended) = promise(4);
        let (a, b) = {
            let mut book = clones.lock();
            (book.insert(a), book.insert(b))
        };
        assert_eq!(clones.promised(two_m), 7);
        assert_eq!(clones.promised(PageSize::Base4K), 0);
        clones.mapped(a);
        assert_eq!(
            clones.promised(two_m),
            4,
            "A mapped: its pages show in Rsvd"
        );
        assert!(a_ended.try_recv().is_err(), "A mapped: its waiter is woken");
        assert_eq!(clones.running(), 2, "A still counts as a clone");
        assert!(matches!(
            b_ended.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
        ));
        clones.release(b);
        assert_eq!(clones.promised(two_m), 0);
        assert!(
            matches!(
                b_ended.try_recv(),
                Err(tokio::sync::oneshot::error::TryRecvError::Closed)
            ),
            "B's end wakes its waiter"
        );
    }
    #[test]
    fn a_clone_whose_vmm_maps_its_template_is_promised_no_longer() {
        use std::os::fd::AsFd;
        let clones = Clones::new(0);
        let two_m = PageSize::Huge2M;
        // The "VMM": a child of this process (the "launcher") mapping a
        // file, its own executable. Its first line says it runs its own
        // program (a shell, waiting on its stdin until the end).
        let mut vmm = std::process::Command::new("sh")
            .args(["-c", "echo running; read end"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start sh");
        let mut said = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(vmm.stdout.take().expect("its stdout")),
            &mut said,
        )
        .expect("its first line");
        assert_eq!(said.trim(), "running");
        let file = |path: String| {
            let f = std::fs::File::open(&path).expect("open");
            FileId::of(f.as_fd()).expect("fstat")
        };
        let mapped = file(format!("/proc/{}/exe", vmm.id()));
        let not_mapped = file(format!("/proc/{}/exe", std::process::id()));
        let mut receivers = Vec::new();
        let mut hold = |launcher, files, pages| {
            let (tx, rx) = tokio::sync::oneshot::channel();
            receivers.push(rx);
            clones.lock().insert(Hold {
                template: 1,
                session: 10,
                launcher,
                promise: Some(Promise {
                    page_size: two_m,
                    pages,
                    _ended: tx,
                }),
                files,
            })
        };
        let me = Some(std::process::id());
        hold(me, vec![mapped], 3);
        hold(me, vec![not_mapped], 4);
        hold(None, vec![mapped], 5);
        clones.lock().settle_mapped();
        drop(vmm.stdin.take());
        let _ = vmm.wait();
        assert_eq!(
            clones.promised(two_m),
            9,
            "only the clone whose VMM maps its template settles"
        );
        assert_eq!(clones.running(), 3, "settled, it still counts as a clone");
    }
}
