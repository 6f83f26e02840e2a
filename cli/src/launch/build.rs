//! The pure part of a launch: checking the user's VMM arguments, and the
//! VMM's full argument list for a region table, by the builder of each VMM.

use std::ffi::OsString;

use super::command_line::{BuildError, BuildOptions, MemoryRegion, Vmm};
use super::{cloud_hypervisor, qemu};

/// Checks the user's VMM arguments before anything is allocated, for an
/// allocation of `regions` regions.
///
/// # Errors
///
/// [`BuildError::Conflict`] naming the first option that sets guest RAM,
/// [`BuildError::LandlockNeedsPaths`], [`BuildError::MicrovmRegions`].
pub fn check_args(
    vmm: Vmm,
    args: &[OsString],
    opts: &BuildOptions,
    regions: usize,
) -> Result<(), BuildError> {
    match vmm {
        Vmm::CloudHypervisor => cloud_hypervisor::check(args, opts),
        Vmm::Qemu => match qemu::check(args)? {
            m if m.microvm && regions > 1 => Err(BuildError::MicrovmRegions(regions)),
            _ => Ok(()),
        },
    }
}

/// The VMM's arguments (without the program): hugemem's memory options
/// followed by the user's arguments.
///
/// # Errors
///
/// As [`check_args`], plus [`BuildError::NoRegions`],
/// [`BuildError::MicrovmRegions`], [`BuildError::BadPath`].
pub fn build_args(
    vmm: Vmm,
    args: &[OsString],
    regions: &[MemoryRegion],
    opts: &BuildOptions,
) -> Result<Vec<OsString>, BuildError> {
    if regions.is_empty() {
        return Err(BuildError::NoRegions);
    }
    match vmm {
        Vmm::CloudHypervisor => cloud_hypervisor::build(args, regions, opts),
        Vmm::Qemu => qemu::build(args, regions),
    }
}
