//! What a run measured and what the guest reported: [`RunReport`], built
//! only once the guest's port writes, its parameter block and its serial
//! line agree with each other and with what the host expected.

use std::time::Duration;

use super::error::Error;
use super::vcpu::Outcome;
use crate::image;
use crate::layout::get_u64;

/// What a run measured and what the guest reported.
///
/// All durations are host `Instant`s taken when `KVM_RUN` returned with the
/// corresponding exit, measured from the run start: just before the vCPU is
/// created (VM creation and memory-slot registration are in
/// [`RunReport::setup`], not in the run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// VM creation, CPUID query, control-slot fill and slot registration.
    pub setup: Duration,
    /// Run start to the guest's first port write (its first instructions).
    pub first_instruction: Duration,
    /// Run start to the guest's "all pages touched" port write.
    pub all_touched: Duration,
    /// CPU time the vCPU thread used over [`RunReport::all_touched`] (its
    /// own page faults, the kernel's zeroing in them, and any spinning on a
    /// page another thread is faulting in), beside the wall time.
    pub all_touched_vcpu_cpu: Duration,
    /// Run start to the guest's exit port write.
    pub total: Duration,
    /// Pages the guest touched (equal to what the host expected, or [`run`](super::run)
    /// fails).
    pub pages_touched: u64,
    /// Whether any of the first-8-byte reads returned non-zero.
    pub saw_nonzero: bool,
    /// OR of every value the guest read.
    pub or_accumulator: u64,
    /// Returns from `KVM_RUN`, every exit counted.
    pub exits: u64,
    /// Whether the identity map used 1 GiB pages (else 2 MiB).
    pub huge_1g_mappings: bool,
    /// The guest's text report on COM1, e.g. `HUGEMEM-GUEST pages=32 nonzero=0 status=0\n`.
    pub serial: String,
}

/// What the host expects the guest to report.
#[derive(Debug)]
pub(super) struct Expect {
    pub(super) pages: u64,
    pub(super) status: u64,
    pub(super) huge_1g: bool,
}

/// Cross-checks the port reports, the parameter block and the host's
/// expectation, and builds the report.
pub(super) fn check(
    expect: &Expect,
    out: &Outcome,
    params: &[u8],
    setup: Duration,
) -> Result<RunReport, Error> {
    let proto = |m: String| Err(Error::Protocol(m));
    let (Some(first), Some(touched)) = (out.first, out.touched) else {
        return proto(format!(
            "progress signals missing (first: {:?}, done: {:?})",
            out.first, out.touched
        ));
    };
    let &[p_lo, p_hi, o_lo, o_hi] = out.results.as_slice() else {
        return proto(format!("expected 4 result words, got {:?}", out.results));
    };
    let pages = u64::from(p_lo) | u64::from(p_hi) << 32;
    let or = u64::from(o_lo) | u64::from(o_hi) << 32;
    let mem_pages = get_u64(params, image::P_PAGES);
    let mem_or = get_u64(params, image::P_ORACC);
    let status = get_u64(params, image::P_STATUS);
    if (pages, or) != (mem_pages, mem_or) {
        return proto(format!(
            "ports say pages={pages} or={or:#x}, memory says pages={mem_pages} or={mem_or:#x}"
        ));
    }
    if (pages, status) != (expect.pages, expect.status) {
        return proto(format!(
            "guest touched {pages} pages with status {status}, host expected {} with status {}",
            expect.pages, expect.status
        ));
    }
    let nonzero = or != 0;
    if out.exit_value != u8::from(nonzero) {
        return proto(format!("exit value {} but OR is {or:#x}", out.exit_value));
    }
    let serial = String::from_utf8_lossy(&out.serial).into_owned();
    let expected = format!(
        "HUGEMEM-GUEST pages={pages} nonzero={} status={status}\n",
        u8::from(nonzero)
    );
    if serial != expected {
        return proto(format!("serial says {serial:?}, expected {expected:?}"));
    }
    Ok(RunReport {
        setup,
        first_instruction: first,
        all_touched: touched,
        all_touched_vcpu_cpu: out.touched_cpu.unwrap_or_default(),
        total: out.total,
        pages_touched: pages,
        saw_nonzero: nonzero,
        or_accumulator: or,
        exits: out.exits,
        huge_1g_mappings: expect.huge_1g,
        serial,
    })
}
