#!/usr/bin/env python3
"""Development-time helper: assemble guest.S and print src/image.rs.

Not used by `cargo build`. Needs GNU binutils (as, objcopy, objdump, nm):

    python3 microguest/guest/listing.py > microguest/src/image.rs

The output is the guest image as a Rust byte array with the disassembly of
every instruction next to its bytes, plus the symbol offsets the runner and
the PVH generator need. `image::tests` re-assembles guest.S (when binutils
exist) and checks that the array still matches.
"""
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# (start symbol, end symbol, kind): kind is "i386", "x86-64" or "data"
REGIONS = [
    ("pvh_entry32", "gdt", "i386"),
    ("gdt", "main64", "data"),
    ("main64", "msg_pages", "x86-64"),
    ("msg_pages", "params", "data"),
    ("params", "file_end", "data"),
]
# symbols exported as Rust constants: (symbol, Rust type, doc)
EXPORT = [
    ("pvh_entry32", "usize", "Offset of the 32-bit PVH entry point."),
    ("direct64", "usize", "Offset of the long-mode entry point used by the KVM runner."),
    ("gdt", "usize", "Offset of the GDT (null, 0x08 64-bit code, 0x10 data)."),
    ("params", "usize", "Offset of the parameter block."),
    ("file_end", "usize", "Offset of the end of the initialised part of the image."),
    ("image_end", "usize", "Offset of the end of the image (page tables and stack included)."),
    ("stack_top", "usize", "Offset of the top of the guest stack."),
    ("BASE", "u64", "Guest-physical address the image is linked at (PVH load address)."),
    ("PORT_PROGRESS", "u16", "Progress port (Firecracker's boot-timer port)."),
    ("FIRST_MAGIC", "u8", "Progress value written first (Firecracker's boot-complete magic)."),
    ("DONE_MAGIC", "u8", "Progress value written after the last page was touched."),
    ("PORT_DEBUG", "u16", "cloud-hypervisor's debug port; 0x40/0x41 mirror the progress values."),
    ("PORT_RESULT", "u16", "Result port: four 32-bit outs, pages lo/hi then OR lo/hi."),
    ("PORT_SERIAL", "u16", "COM1 data register: the text report."),
    ("PORT_DEBUG_EXIT", "u16", "QEMU isa-debug-exit port (default iobase)."),
    ("PORT_CH_SHUTDOWN", "u16", "cloud-hypervisor's ACPI shutdown port."),
    ("GED_SLEEP_CTL", "u64", "QEMU microvm ACPI GED sleep-control register."),
    ("S5_SLP", "u8", "Value written to the shutdown registers: SLP_TYP=5, SLP_EN."),
    ("START_INFO_MAGIC", "u32", "hvm_start_info magic."),
    ("MAX_RANGES", "usize", "Capacity of the parameter block's range table."),
    ("P_STRIDE", "usize", "Parameter block: stride (power of two)."),
    ("P_MARKER", "usize", "Parameter block: marker."),
    ("P_SKIPLO", "usize", "Parameter block: start of the range never touched (the image)."),
    ("P_SKIPHI", "usize", "Parameter block: end of the range never touched."),
    ("P_NRANGES", "usize", "Parameter block: number of RAM ranges."),
    ("P_PAGES", "usize", "Parameter block: pages touched (written by the guest)."),
    ("P_ORACC", "usize", "Parameter block: OR of all values read (written by the guest)."),
    ("P_MINGPA", "usize", "Parameter block: lowest GPA touched (PVH path)."),
    ("P_FALLBACK", "usize", "Parameter block: RAM size when the loader gives no memmap (PVH path)."),
    ("P_STATUS", "usize", "Parameter block: status bits (bit 0: RAM clipped to the page tables)."),
    ("P_RANGES", "usize", "Parameter block: RAM ranges, `[start, end)` pairs of u64."),
    ("P_SPIN", "usize", "Parameter block: spin mode on when non-zero."),
    ("P_GAPMIN", "usize", "Parameter block: smallest TSC gap recorded in the gap ring."),
    ("P_COUNT", "usize", "Parameter block: spin iterations (written by the guest)."),
    ("P_TSC", "usize", "Parameter block: TSC of the latest spin iteration (written by the guest)."),
    ("P_MAXGAP", "usize", "Parameter block: largest TSC gap between spin iterations (written by the guest)."),
    ("P_BAD", "usize", "Parameter block: re-read pages that lost their value (written by the guest)."),
    ("P_BADGPA", "usize", "Parameter block: the latest such page's GPA (written by the guest)."),
    ("P_NGAPS", "usize", "Parameter block: gaps put into the ring so far (written by the guest)."),
    ("P_SPINTSC", "usize", "Parameter block: TSC when the spin loop started (written by the guest)."),
    ("P_GAPS", "usize", "Parameter block: ring of (end TSC, gap) pairs (written by the guest)."),
    ("GAP_RING", "usize", "Entries in the gap ring (a power of two)."),
]


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def main():
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "guest.o")
        binf = os.path.join(tmp, "guest.bin")
        run("as", "--64", "-o", obj, os.path.join(HERE, "guest.S"))
        relocs = run("objdump", "-r", obj)
        if "R_X86_64" in relocs:
            sys.exit("guest.S needs relocations (a .globl symbol?): the image must be self-contained\n" + relocs)
        run("objcopy", "-O", "binary", "--only-section=.text", obj, binf)
        syms = {}
        for line in run("nm", obj).splitlines():
            addr, _kind, name = line.split()
            syms[name] = int(addr, 16)
        data = open(binf, "rb").read()[: syms["file_end"]]
        labels = {}
        for name, addr in syms.items():
            if addr < syms["file_end"] and not name.isupper() and not name.startswith("P_"):
                labels.setdefault(addr, []).append(name)
        out = []
        w = out.append
        w("// Generated by microguest/guest/listing.py from microguest/guest/guest.S:")
        w("// do not edit by hand. Offsets are relative to the start of the image; the")
        w("// image is linked at `LINK_BASE` (the 32-bit PVH prologue uses absolute")
        w("// addresses, everything from `main64` on is RIP-relative).")
        w("")
        for name, ty, doc in EXPORT:
            const = {"BASE": "LINK_BASE"}.get(name, name.upper())
            w(f"/// {doc}")
            w(f"pub(crate) const {const}: {ty} = {syms[name]:#x};")
        w("")
        w(f"/// The guest image up to `FILE_END` ({len(data)} bytes); the rest up to")
        w("/// `IMAGE_END` is zero-initialised memory (page tables and stack).")
        w("#[rustfmt::skip]")
        w(f"pub(crate) const IMAGE: [u8; {len(data)}] = [")
        for start_sym, end_sym, kind in REGIONS:
            start, end = syms[start_sym], syms[end_sym]
            if kind == "data":
                pos = start
                while pos < end:
                    for lab in labels.get(pos, []):
                        w(f"    // {lab}: ({pos:#06x})")
                    nxt = min([a for a in labels if a > pos] + [end, pos + 8])
                    chunk = data[pos:nxt]
                    txt = "".join(chr(c) if 32 <= c < 127 else "." for c in chunk)
                    w("    " + " ".join(f"0x{c:02x}," for c in chunk) + f" // data {txt!r}")
                    pos = nxt
                continue
            dis = run("objdump", "-D", "-b", "binary", "-m", "i386" if kind == "i386" else "i386:x86-64",
                      f"--start-address={start}", f"--stop-address={end}", binf)
            for line in dis.splitlines():
                m = re.match(r"^\s+([0-9a-f]+):\t([0-9a-f ]+?)\s*\t(.*)$", line)
                if not m:
                    m2 = re.match(r"^\s+([0-9a-f]+):\t([0-9a-f ]+?)\s*$", line)
                    if m2:  # continuation of a long instruction
                        w("    " + " ".join(f"0x{b}," for b in m2.group(2).split()))
                    continue
                addr = int(m.group(1), 16)
                for lab in labels.get(addr, []):
                    w(f"    // {lab}: ({addr:#06x}, {'32-bit' if kind == 'i386' else '64-bit'})")
                code = " ".join(f"0x{b}," for b in m.group(2).split())
                asm = re.sub(r"\s+", " ", m.group(3)).strip()
                w(f"    {code:<48} // {asm}")
        w("];")
        w("")
        w("#[cfg(test)]")
        w("mod tests {")
        w("    /// Re-runs guest/listing.py (python3 + binutils) and compares its output")
        w("    /// with this file, so the bytes cannot drift from guest/guest.S.")
        w("    #[test]")
        w("    fn bytes_match_reference_source() {")
        w("        let dir = env!(\"CARGO_MANIFEST_DIR\");")
        w("        let out = std::process::Command::new(\"python3\")")
        w("            .arg(format!(\"{dir}/guest/listing.py\"))")
        w("            .output();")
        w("        let out = match out {")
        w("            Ok(out) if out.status.success() => out,")
        w("            Ok(out) => {")
        w("                let err = String::from_utf8_lossy(&out.stderr);")
        w("                if err.contains(\"No such file\") || err.contains(\"FileNotFoundError\") {")
        w("                    test_support::skip!(\"binutils missing: {err}\");")
        w("                    return;")
        w("                }")
        w("                panic!(\"listing.py failed: {err}\");")
        w("            }")
        w("            Err(e) => {")
        w("                test_support::skip!(\"cannot run python3: {e}\");")
        w("                return;")
        w("            }")
        w("        };")
        w("        // Comments (the disassembly) differ between binutils versions: compare")
        w("        // the code, i.e. the constants and the bytes.")
        w("        let code = |text: &str| -> Vec<String> {")
        w("            text.lines()")
        w("                .map(|l| l.split(\"//\").next().unwrap_or_default().trim().to_owned())")
        w("                .filter(|l| !l.is_empty())")
        w("                .collect()")
        w("        };")
        w("        let fresh = String::from_utf8_lossy(&out.stdout);")
        w("        assert!(")
        w("            code(&fresh) == code(include_str!(\"image.rs\")),")
        w("            \"src/image.rs is stale: run python3 microguest/guest/listing.py > microguest/src/image.rs\"")
        w("        );")
        w("    }")
        w("}")
        sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
