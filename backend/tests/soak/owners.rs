//! HANDOFF and REATTACH in the soak: a tenant hands a live allocation to
//! a second connection or to a second process of its own, takes an
//! orphaned one back with its token (the parent orphans it on request:
//! the stand-in for a restart), and tries tokens and ids that must be
//! refused exactly as an unknown id is.

use std::os::fd::AsFd;

use backend::client::{Client, ClientError};
use backend::proto::{Status, TOKEN_SIZE};
use test_support::tenant::{in_child, say};

use super::image::{check_fd, Image};
use crate::{Held, Op, Step, Tenant};

/// A file's identity (device, inode).
pub fn identity(fd: &impl AsFd) -> Result<(u64, u64), String> {
    let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| format!("fstat: {e}"))?;
    Ok((st.st_dev, st.st_ino))
}

/// True for a NOT_FOUND refusal (an unknown id, someone else's, a wrong
/// token, not orphaned: one answer for all).
fn not_found<T>(r: &Result<T, ClientError>) -> bool {
    matches!(
        r,
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        })
    )
}

impl Tenant {
    /// HANDOFF of a live allocation to a new connection of this tenant, or
    /// (now and then) to a child process that checks it and lets it go.
    pub fn handoff(&mut self) -> Step {
        if self.live.is_empty() {
            self.alloc()?;
        }
        if self.rng.chance(25) {
            return self.handoff_to_process();
        }
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let (id, paths, size) = (self.live[i].id, self.live[i].paths, self.live[i].size);
        let token = self.live[i].token.ok_or("an allocation without a token")?;
        let want_paths = self.rng.chance(25);
        let mut successor = self.connect()?;
        let a = match successor.handoff(id, token, want_paths) {
            Ok(a) => a,
            // PATHS of memfds; a lazy allocation with pages still to clear.
            Err(ClientError::Refused {
                status: Status::Invalid,
                message,
            }) if (want_paths && !paths)
                || (!self.live[i].eager && message.contains("to clear")) =>
            {
                self.count(Op::HandoffRefused);
                return Ok(());
            }
            Err(e) if crate::not_found(&e) && self.dropped_since(self.live[i].grown)? => {
                self.live.swap_remove(i);
                self.count(Op::GrownDropped);
                return Ok(());
            }
            Err(e) => {
                return Err(format!(
                    "HANDOFF {id} (paths {want_paths}): {e}; it was: {}",
                    self.live[i].how
                ))
            }
        };
        if want_paths && !paths {
            return Err(format!("HANDOFF {id} with PATHS of memfds was not refused"));
        }
        let new_token = a.token().ok_or("a HANDOFF reply without a token")?;
        let (Some(info), Some(fd)) = (a.regions.first().copied(), a.fds.into_iter().next()) else {
            return Err("a HANDOFF reply without a region".into());
        };
        if info.region_id != self.live[i].region_id || info.size != size {
            return Err(format!(
                "HANDOFF {id}: region {} of {} bytes, the allocation had {} of {size}",
                info.region_id, info.size, self.live[i].region_id
            ));
        }
        if identity(&fd)? != identity(&self.live[i].fd)? {
            return Err(format!("HANDOFF {id} handed another file"));
        }
        if new_token == token {
            return Err(format!("HANDOFF {id} kept the old token"));
        }
        if !self.live[i].damaged {
            check_fd(&fd, 0, size, Image::Marker(self.own), "the successor's fd")?;
        }
        self.count(Op::Handoff);
        let step = self.steps;
        self.live[i]
            .how
            .push_str(&format!("; handed off (step {step})"));
        let predecessor = self.live[i].conn.replace(successor);
        // The successor keeps no lazy record of it.
        self.live[i].lazy_record = false;
        let old_fd = std::mem::replace(&mut self.live[i].fd, fd);
        self.live[i].token = Some(new_token);
        // The predecessor owns nothing of it, and the old token is dead.
        let freed = match predecessor {
            Some(mut p) => p.free(id),
            None => self.client()?.free(id),
        };
        let stolen = self.connect()?.handoff(id, token, false);
        if !not_found(&freed) || !not_found(&stolen) {
            return Err(format!(
                "after HANDOFF {id}: the predecessor's FREE {freed:?}, the old token's HANDOFF {:?}",
                stolen.map(|a| a.id)
            ));
        }
        self.count(Op::PredecessorRefused);
        // Not kept: the files it keeps are of memory it let go (a PARK of
        // one of its live allocations' files moves that allocation).
        drop(old_fd);
        Ok(())
    }

    /// HANDOFF to a child process (this tenant's uid): it checks the
    /// memory and FREEs it, or exits and lets its connection release it.
    /// This process keeps its fd now and then, as a predecessor VMM would.
    pub fn handoff_to_process(&mut self) -> Step {
        let idx: Vec<usize> = (0..self.live.len())
            .filter(|&i| self.live[i].eager && !self.live[i].damaged)
            .collect();
        if idx.is_empty() {
            return Ok(());
        }
        let i = idx[self.rng.below(idx.len() as u64) as usize];
        let token = self.live[i].token.ok_or("an allocation without a token")?;
        let l = self.live.swap_remove(i);
        let (id, size, own, socket) = (l.id, l.size, self.own, self.socket.clone());
        let free = self.rng.chance(50);
        let code = in_child(None, move || {
            let Ok(mut c) = Client::connect(&socket) else {
                return 10;
            };
            let a = match c.handoff(id, token, false) {
                Ok(a) => a,
                Err(e) => {
                    say(&format!("the successor process's HANDOFF {id}: {e}"));
                    return 11;
                }
            };
            let Some(fd) = a.fds.first() else {
                return 12;
            };
            if let Err(e) = check_fd(
                fd,
                0,
                size,
                Image::Marker(own),
                "the successor process's fd",
            ) {
                say(&e);
                return 13;
            }
            drop(a);
            if free && c.free(id).is_err() {
                return 14;
            }
            0
        });
        if code != 0 {
            return Err(format!(
                "the successor process of allocation {id} ended with {code}"
            ));
        }
        self.count(Op::HandoffProcess);
        let freed = match l.conn {
            Some(mut c) => c.free(id),
            None => self.client()?.free(id),
        };
        if !not_found(&freed) {
            return Err(format!(
                "the predecessor's FREE of {id}, which its successor released: {freed:?}"
            ));
        }
        self.count(Op::PredecessorRefused);
        if self.held.len() < 2 && self.rng.chance(50) {
            self.held.push(Held::Kept { fd: l.fd, size });
        }
        Ok(())
    }

    /// The parent orphans one of this tenant's eager allocations (a
    /// restart, as far as the allocation can tell); the tenant takes it
    /// back with its token on its main connection or a new one and finds
    /// its bytes. Before that, its old connection's FREE and a wrong
    /// token are refused.
    pub fn reattach(&mut self) -> Step {
        let pick = |t: &mut Tenant| {
            let idx: Vec<usize> = (0..t.live.len())
                .filter(|&i| t.live[i].eager && !t.live[i].damaged)
                .collect();
            (!idx.is_empty()).then(|| idx[t.rng.below(idx.len() as u64) as usize])
        };
        let i = match pick(self) {
            Some(i) => i,
            None => {
                self.alloc()?;
                match pick(self) {
                    Some(i) => i,
                    None => return Ok(()),
                }
            }
        };
        let (id, region_id, size) = (self.live[i].id, self.live[i].region_id, self.live[i].size);
        let token = self.live[i].token.ok_or("an allocation without a token")?;
        if !super::daemon::ask_orphan(&mut self.ctl, id)? {
            return Err(format!("the daemon does not know allocation {id}"));
        }
        if self.rng.chance(50) {
            let freed = self.owner_of(i)?.free(id);
            if !not_found(&freed) {
                return Err(format!(
                    "FREE of orphaned {id} by its old connection: {freed:?}"
                ));
            }
            self.count(Op::PredecessorRefused);
        }
        if self.rng.chance(40) {
            let mut wrong = token;
            wrong[self.rng.below(TOKEN_SIZE as u64) as usize] ^= 1 << self.rng.below(8);
            let r = self.connect()?.reattach(id, wrong);
            if !not_found(&r) {
                return Err(format!("REATTACH {id} with a wrong token: {r:?}"));
            }
            self.count(Op::TokenRefused);
        }
        let (regions, conn) = if self.rng.chance(50) {
            (self.client()?.reattach(id, token), None)
        } else {
            let mut c = self.connect()?;
            (c.reattach(id, token), Some(c))
        };
        let regions = regions.map_err(|e| format!("REATTACH {id} with its token: {e}"))?;
        if regions.len() != 1 || regions[0].region_id != region_id || regions[0].size != size {
            return Err(format!(
                "REATTACH {id}: regions {regions:?}, it had {region_id}"
            ));
        }
        let on_new = conn.is_some();
        self.live[i].conn = conn;
        // A lazy one is recorded by the connection that took it back.
        self.live[i].lazy_record = self.live[i].lazy_alloc;
        let step = self.steps;
        self.live[i].how.push_str(&format!(
            "; orphaned, re-attached on a new connection {on_new} (step {step})"
        ));
        check_fd(
            &self.live[i].fd,
            0,
            size,
            Image::Marker(self.own),
            "a re-attached allocation",
        )?;
        self.count(Op::Reattach);
        Ok(())
    }

    /// Tokens and ids that are not this tenant's to use, each on a
    /// connection of its own (refusals count toward the 8 that close a
    /// connection): REATTACH of a live allocation with its own token,
    /// HANDOFF with a wrong token, HANDOFF and REATTACH of ids next to its
    /// own with random tokens. Now and then 8 refusals on one connection,
    /// which the daemon then closes.
    pub fn token_tricks(&mut self) -> Step {
        if self.live.is_empty() {
            self.alloc()?;
        }
        let Some(i) = self.pick_live(false) else {
            return Ok(());
        };
        let (id, token) = (self.live[i].id, self.live[i].token.ok_or("no token")?);
        let mut random = [0u8; TOKEN_SIZE];
        for b in &mut random {
            *b = self.rng.next() as u8;
        }
        let mine: Vec<u64> = self.live.iter().map(|l| l.id).collect();
        let other = (1..=8)
            .map(|k| id + k)
            .find(|x| !mine.contains(x))
            .unwrap_or(u64::MAX);
        let tries = [
            self.connect()?.reattach(id, token).map(|_| ()),
            self.connect()?.handoff(id, random, false).map(|_| ()),
            self.connect()?.handoff(other, random, false).map(|_| ()),
            self.connect()?.reattach(other, random).map(|_| ()),
        ];
        if let Some(bad) = tries.iter().find(|r| !not_found(r)) {
            return Err(format!(
                "a token or id not this tenant's (own {id}, other {other}): {bad:?}"
            ));
        }
        self.count(Op::TokenRefused);
        if self.rng.chance(20) {
            let mut c = self.connect()?;
            let limit = backend::daemon::connections::session::MAX_REATTACH_REFUSALS;
            for n in 0..limit {
                let r = c.reattach(other, random);
                if !not_found(&r) {
                    return Err(format!("refusal {n} of {limit} on one connection: {r:?}"));
                }
            }
            if c.stats().is_ok() {
                return Err(format!(
                    "the daemon still serves a connection after {limit} refused REATTACH"
                ));
            }
            self.count(Op::TokenLimitClosed);
        }
        Ok(())
    }

    /// A new connection of this tenant, with a 60 s reply timeout.
    pub fn connect(&self) -> Result<Client, String> {
        let c = Client::connect(&self.socket).map_err(|e| format!("connect: {e}"))?;
        let _ = c.set_timeout(Some(std::time::Duration::from_secs(60)));
        Ok(c)
    }
}
