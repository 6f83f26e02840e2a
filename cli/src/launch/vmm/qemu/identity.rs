//! What of a QEMU VM's command line a clone cannot hold beside its
//! template's other clones, or at all on a private mapping of its memory.
//!
//! A clone is a second QEMU process on the same command line. What names
//! something only one process can hold is refused, each with what to do
//! instead:
//!
//! * a tap of a fixed name (`ifname=`) or on fds passed to the process
//!   (`fd=`, `fds=`); a tap without either is the clone's own (QEMU makes
//!   a new one per process), which is said;
//! * a host port forward (`hostfwd=`), a listening socket at a fixed path
//!   or port (`-chardev socket,…,server=on`, `-qmp`/`-monitor`/`-serial
//!   unix:…,server`, `-gdb`, `-vnc`), and `-pidfile`;
//! * a VFIO or vDPA device, and a vsock CID (`vhost-vsock*`), which the
//!   host has once.
//!
//! A shared clone maps its template privately, so what needs the guest's
//! memory shared with another process (vhost-user) is refused too, and,
//! on a QEMU that opens the template read-write (7.2, `command_line::Sharing`),
//! a balloon: QEMU before 8.2 discards a page of a file-backed block by
//! punching a hole in the file, which here is the template's.

/// Arguments as text (lossy: a non-UTF-8 value names no option).
pub(super) fn text(args: &[std::ffi::OsString]) -> Vec<String> {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// What a clone of a VM run with `args` gets in place of its template's,
/// one line a device; or why it cannot be cloned (`shared`: a
/// copy-on-write clone; `writable_template`: QEMU opens the template's
/// file read-write).
pub(super) fn clone_identity(
    args: &[String],
    shared: bool,
    writable_template: bool,
) -> Result<Vec<String>, String> {
    let mut replaced = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        let Some(name) = crate::launch::command_line::option_name(arg) else {
            continue;
        };
        // A value is inline (`--opt=v`) or the next argument; an option
        // without one is followed by the next option.
        let value = match arg.split_once('=') {
            Some((_, v)) => v.to_owned(),
            None => it
                .next_if(|v| !v.starts_with('-'))
                .cloned()
                .unwrap_or_default(),
        };
        if let Some(line) = check_option(name, &value, shared, writable_template)? {
            replaced.push(line);
        }
    }
    Ok(replaced)
}

/// `key=value` items of an option's value (the first may be a bare type).
fn items(value: &str) -> impl Iterator<Item = (&str, Option<&str>)> {
    value.split(',').map(|kv| match kv.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (kv, None),
    })
}

fn item<'a>(value: &'a str, key: &str) -> Option<&'a str> {
    items(value).find_map(|(k, v)| (k == key).then_some(v.unwrap_or("on")))
}

fn on(v: Option<&str>) -> bool {
    matches!(v, Some("on" | "yes" | "true") | None)
}

/// A listening socket in a character-device-like value (`-chardev
/// socket,…,server=on`, `unix:P,server`, `tcp::PORT,server`).
fn listens(value: &str) -> bool {
    items(value).any(|(k, v)| k == "server" && on(v))
}

fn check_option(
    name: &str,
    value: &str,
    shared: bool,
    writable_template: bool,
) -> Result<Option<String>, String> {
    let kind = value.split(',').next().unwrap_or_default();
    let id = item(value, "id").unwrap_or(kind);
    let one = |what: String, instead: &str| -> Result<Option<String>, String> {
        Err(format!(
            "the VM holds {what}, which a second QEMU cannot hold, so it cannot be cloned \
             ({instead})"
        ))
    };
    match name {
        "netdev" | "nic" => {
            if kind == "tap" {
                if let Some(tap) = item(value, "ifname") {
                    return one(
                        format!("{id} on the tap {tap}"),
                        "park it without ifname=: each clone then gets a tap of its own",
                    );
                }
                if item(value, "fd").is_some() || item(value, "fds").is_some() {
                    return one(
                        format!("{id} on fds passed to its process"),
                        "a new tap would put the clone on another network",
                    );
                }
                return Ok(Some(format!(
                    "{id}: a tap of its own, which QEMU creates for the clone"
                )));
            }
            if kind == "vhost-user" || kind == "vhost-vdpa" {
                return one(format!("{id} ({kind})"), "its backend serves one VM");
            }
            if let Some(fwd) = item(value, "hostfwd") {
                return one(
                    format!("{id} forwarding the host port of {fwd}"),
                    "a host port is bound once; park it without hostfwd=",
                );
            }
        }
        "chardev" if kind == "socket" && listens(value) => {
            return one(
                format!("the socket chardev {id} listening at a fixed address"),
                "give the clone its own command line without it, or connect as a client",
            );
        }
        "qmp" | "qmp-pretty" | "monitor" | "serial" | "parallel" if listens(value) => {
            return one(
                format!("-{name} {value}, listening at a fixed address"),
                "give the clone its own command line with another address",
            );
        }
        "gdb" | "s" => {
            return one(
                "a gdb server on a fixed port".into(),
                "leave -gdb/-s out of the clone's command line",
            )
        }
        "vnc" | "spice" if value != "none" => {
            return one(
                format!("-{name} {value}, a display on a fixed address"),
                "give the clone its own command line without it",
            )
        }
        "pidfile" => {
            return one(
                format!("the pid file {value}"),
                "give the clone its own command line without it",
            )
        }
        "device" => return check_device(kind, value, shared, writable_template),
        _ => {}
    }
    Ok(None)
}

fn check_device(
    kind: &str,
    value: &str,
    shared: bool,
    writable_template: bool,
) -> Result<Option<String>, String> {
    let id = item(value, "id").unwrap_or(kind);
    if kind.starts_with("vfio") {
        return Err(format!(
            "the VM has the VFIO device {id}, which belongs to one VM: it cannot be cloned"
        ));
    }
    if kind.starts_with("vhost-vsock") {
        return Err(format!(
            "the VM has the vsock device {id} (guest-cid={}), which the host has once: it \
             cannot be cloned",
            item(value, "guest-cid").unwrap_or("?")
        ));
    }
    if shared && kind.starts_with("vhost-user") {
        return Err(format!(
            "the VM has {id} ({kind}), which needs its memory mapped shared: a shared \
             (copy-on-write) clone maps it privately; clone it with --clone-mode copy"
        ));
    }
    if shared && writable_template && kind.starts_with("virtio-balloon") {
        return Err(format!(
            "the VM has the balloon {id}: this QEMU (before 8.2) frees a ballooned page of a \
             private file mapping by punching a hole in the file, the template's; clone it \
             with --clone-mode copy"
        ));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn what_a_second_qemu_cannot_hold_is_refused_and_a_new_tap_said() {
        let fine = args(&[
            "-M",
            "microvm",
            "-enable-kvm",
            "-netdev",
            "tap,id=n0,script=no",
            "-chardev",
            "socket,id=c0,path=/run/x.sock",
            "-display",
            "none",
        ]);
        let replaced = clone_identity(&fine, true, true).expect("clonable");
        assert_eq!(replaced.len(), 1, "{replaced:?}");
        assert!(
            replaced[0].starts_with("n0: a tap of its own"),
            "{replaced:?}"
        );
        for (bad, says) in [
            (&["-netdev", "tap,id=n1,ifname=tap7"][..], "the tap tap7"),
            (&["--netdev=tap,id=n2,fd=5"][..], "n2 on fds"),
            (&["-nic", "user,hostfwd=tcp::2222-:22"][..], "host port"),
            (
                &["-chardev", "socket,id=m,path=/tmp/m,server=on,wait=off"][..],
                "chardev m",
            ),
            (&["-qmp", "unix:/tmp/q,server,nowait"][..], "-qmp"),
            (&["-device", "vfio-pci,host=01:00.0"][..], "VFIO"),
            (
                &["-device", "vhost-vsock-pci,guest-cid=3"][..],
                "guest-cid=3",
            ),
            (&["-pidfile", "/run/vm.pid"][..], "pid file"),
        ] {
            let err = clone_identity(&args(bad), false, false).expect_err(says);
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    #[test]
    fn what_needs_shared_memory_is_refused_only_for_a_shared_clone() {
        let user = args(&["-device", "vhost-user-fs-pci,chardev=c,tag=t"]);
        assert!(clone_identity(&user, false, false).is_ok());
        let err = clone_identity(&user, true, false).expect_err("shared");
        assert!(err.contains("--clone-mode copy"), "{err}");
        let balloon = args(&["-device", "virtio-balloon-device"]);
        assert!(clone_identity(&balloon, true, false).is_ok(), "QEMU 8.2 on");
        assert!(clone_identity(&balloon, false, true).is_ok(), "a copy");
        let err = clone_identity(&balloon, true, true).expect_err("QEMU 7.2");
        assert!(err.contains("punching a hole"), "{err}");
    }
}
