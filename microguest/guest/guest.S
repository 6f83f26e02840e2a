# hugemem micro-guest: reference source of the bytes in src/image.rs.
# Symbols must stay local (no .globl): the image has to assemble without
# relocations, which listing.py checks.
#
# NOT used at build time. Assemble at development time only:
#   python3 microguest/guest/listing.py > microguest/src/image.rs
# The unit test `image::tests::bytes_match_reference_source` re-assembles this
# file when binutils are installed and compares it with the embedded bytes.
#
# Linked at BASE (1 MiB), the PVH load address. The 32-bit PVH prologue uses
# absolute addresses; everything from main64 on is position independent
# (RIP-relative), so the KVM runner can load the same image at any GPA and
# enter it at direct64 in long mode.

        .set BASE,          0x100000
        .set PORT_PROGRESS, 0x3f0     # Firecracker boot-timer port
        .set FIRST_MAGIC,   123       # Firecracker MAGIC_VALUE_SIGNAL_GUEST_BOOT_COMPLETE
        .set DONE_MAGIC,    124
        .set PORT_DEBUG,    0x80      # cloud-hypervisor debug port (0x40..0x5f = "Kernel")
        .set PORT_RESULT,   0x3f4
        .set PORT_SERIAL,   0x3f8
        .set PORT_DEBUG_EXIT, 0x501   # QEMU isa-debug-exit default iobase
        .set PORT_CH_SHUTDOWN, 0x600  # cloud-hypervisor ACPI shutdown device
        .set GED_SLEEP_CTL, 0xfea00200 # QEMU microvm ACPI GED sleep control register
        .set S5_SLP,        0x34      # SLP_TYP=5 (S5) << 2 | SLP_EN (1 << 5)
        .set START_INFO_MAGIC, 0x336ec578
        .set MAX_RANGES,    32

        # parameter block offsets (struct Params in src/guest.rs)
        .set P_STRIDE,  0x00
        .set P_MARKER,  0x08
        .set P_SKIPLO,  0x10
        .set P_SKIPHI,  0x18
        .set P_NRANGES, 0x20
        .set P_PAGES,   0x28
        .set P_ORACC,   0x30
        .set P_MINGPA,  0x38
        .set P_FALLBACK,0x40
        .set P_STATUS,  0x48
        .set P_RANGES,  0x50
        # spin mode (after the range table, so the offsets above stay put)
        .set P_SPIN,    0x250                   # in: non-zero = count forever instead of powering off
        .set P_GAPMIN,  0x258                   # in: gaps of at least this many TSC ticks go to the ring
        .set P_COUNT,   0x260                   # out: iterations of the spin loop
        .set P_TSC,     0x268                   # out: TSC read by the latest iteration
        .set P_MAXGAP,  0x270                   # out: largest TSC gap between consecutive iterations
        .set P_BAD,     0x278                   # out: pages whose value was not marker ^ gpa
        .set P_BADGPA,  0x280                   # out: the latest such page
        .set P_NGAPS,   0x288                   # out: gaps recorded in the ring so far
        .set P_SPINTSC, 0x290                   # out: TSC when the spin loop started
        .set P_GAPS,    0x298                   # out: ring of 16 (end TSC, gap) pairs
        .set GAP_RING,  16

        .text
        .code32
pvh_entry32:
        mov     $FIRST_MAGIC, %al
        mov     $PORT_PROGRESS, %dx
        out     %al, %dx
        mov     $0x40, %al
        out     %al, $PORT_DEBUG
        cld
        mov     %ebx, %ebp                      # ebp = hvm_start_info (PVH ABI: ebx)
        mov     $0x80000001, %eax
        cpuid
        mov     %edx, %esi                      # esi = extended features (bit 26: 1 GiB pages)
        mov     $(BASE + pt_pml4 - pvh_entry32), %edi
        xor     %eax, %eax
        mov     $(6 * 4096 / 4), %ecx           # PML4 + PDPT + 4 PDs
        rep stosl
        movl    $(BASE + pt_pdpt - pvh_entry32 + 3), (BASE + pt_pml4 - pvh_entry32)
        mov     $(BASE + pt_pdpt - pvh_entry32), %edi
        mov     $(BASE + pt_pd - pvh_entry32 + 3), %eax
        mov     $4, %ecx
1:      mov     %eax, (%edi)                    # PDPT[0..4] -> 4 PDs
        add     $4096, %eax
        add     $8, %edi
        loop    1b
        mov     $(BASE + pt_pd - pvh_entry32), %edi
        mov     $0x83, %eax                     # present | writable | 2 MiB page
        mov     $2048, %ecx
2:      mov     %eax, (%edi)                    # identity map [0, 4 GiB) with 2 MiB pages
        add     $0x200000, %eax
        add     $8, %edi
        loop    2b
        bt      $26, %esi
        jnc     4f
        mov     $(BASE + pt_pdpt - pvh_entry32 + 4 * 8), %edi
        mov     $4, %eax
3:      mov     %eax, %edx                      # PDPT[4..512] = 1 GiB pages [4 GiB, 512 GiB)
        shl     $30, %edx
        or      $0x83, %edx
        mov     %edx, (%edi)
        mov     %eax, %edx
        shr     $2, %edx
        mov     %edx, 4(%edi)
        add     $8, %edi
        inc     %eax
        cmp     $512, %eax
        jb      3b
4:      mov     %cr4, %eax
        or      $0x20, %eax                     # CR4.PAE
        mov     %eax, %cr4
        mov     $(BASE + pt_pml4 - pvh_entry32), %eax
        mov     %eax, %cr3
        mov     $0xc0000080, %ecx               # IA32_EFER
        rdmsr
        or      $0x100, %eax                    # EFER.LME
        wrmsr
        mov     %cr0, %eax
        or      $0x80000001, %eax               # CR0.PG | CR0.PE
        mov     %eax, %cr0
        lgdt    (BASE + gdt_desc - pvh_entry32)
        ljmp    $0x08, $(BASE + main64 - pvh_entry32)

        .p2align 3
gdt:    .quad   0
        .quad   0x00af9a000000ffff              # 0x08: 64-bit code
        .quad   0x00cf92000000ffff              # 0x10: flat data
gdt_desc:
        .word   gdt_desc - gdt - 1
        .long   BASE + gdt - pvh_entry32

        .code64
main64:
        mov     $0x10, %eax
        mov     %eax, %ds
        mov     %eax, %es
        mov     %eax, %ss
        lea     stack_top(%rip), %rsp
        mov     $0x100000000, %r15              # map limit: 4 GiB without 1 GiB pages
        bt      $26, %esi
        jnc     5f
        mov     $0x8000000000, %r15             # 512 GiB with them
5:      lea     params(%rip), %rsi
        mov     %ebp, %ebx                      # rbx = hvm_start_info, zero-extended
        xor     %ecx, %ecx                      # ranges found
        cmpl    $START_INFO_MAGIC, (%rbx)
        jne     8f
        cmpl    $1, 4(%rbx)
        jb      8f
        mov     0x28(%rbx), %rdi                # memmap_paddr
        mov     0x30(%rbx), %edx                # memmap_entries
        test    %edx, %edx
        jz      8f
6:      cmpl    $1, 16(%rdi)                    # type 1 = RAM
        jne     7f
        mov     (%rdi), %rax                    # start
        mov     8(%rdi), %r8
        add     %rax, %r8                       # end
        call    add_range
7:      add     $24, %rdi
        dec     %edx
        jnz     6b
        jmp     9f
8:      xor     %eax, %eax                      # no memmap: [0, fallback)
        mov     P_FALLBACK(%rsi), %r8
        call    add_range
9:      mov     %rcx, P_NRANGES(%rsi)
        jmp     body64

# add_range: rax = start, r8 = end; clips to [min_gpa, r15) and appends.
add_range:
        cmp     P_MINGPA(%rsi), %rax
        jae     1f
        mov     P_MINGPA(%rsi), %rax
1:      cmp     %r15, %r8
        jbe     2f
        mov     %r15, %r8
        orl     $1, P_STATUS(%rsi)              # status bit 0: RAM clipped to the map
2:      cmp     %r8, %rax
        jae     3f
        cmp     $MAX_RANGES, %ecx
        jae     3f
        mov     %ecx, %r9d
        shl     $4, %r9d
        mov     %rax, P_RANGES(%rsi,%r9)
        mov     %r8, P_RANGES + 8(%rsi,%r9)
        inc     %ecx
3:      ret

direct64:                                       # KVM runner entry: long mode, rsi = params, rsp set
        mov     $FIRST_MAGIC, %al
        mov     $PORT_PROGRESS, %dx
        out     %al, %dx
        mov     $0x40, %al
        out     %al, $PORT_DEBUG

body64:
        xor     %r12d, %r12d                    # r12 = pages touched
        xor     %r13d, %r13d                    # r13 = OR of everything read
        mov     P_STRIDE(%rsi), %r8             # r8 = stride (power of two)
        mov     P_MARKER(%rsi), %r9             # r9 = marker
        lea     -1(%r8), %r10                   # r10 = stride - 1
        mov     %r10, %r11
        not     %r11                            # r11 = ~(stride - 1)
        mov     P_NRANGES(%rsi), %rcx
        lea     P_RANGES(%rsi), %rbx
10:     test    %rcx, %rcx
        jz      15f
        mov     (%rbx), %rax
        mov     8(%rbx), %rdx                   # rdx = end
        add     %r10, %rax
        and     %r11, %rax                      # rax = start rounded up to stride
11:     lea     8(%rax), %rdi
        cmp     %rdx, %rdi
        ja      14f                             # first 8 bytes must fit below end
        cmp     P_SKIPHI(%rsi), %rax
        jae     12f
        cmp     P_SKIPLO(%rsi), %rdi
        ja      13f                             # overlaps [skip_lo, skip_hi): our own image
12:     mov     (%rax), %rdi
        or      %rdi, %r13
        mov     %r9, %rdi
        xor     %rax, %rdi
        mov     %rdi, (%rax)                    # *page = marker ^ gpa
        inc     %r12
13:     add     %r8, %rax
        jnc     11b
14:     add     $16, %rbx
        dec     %rcx
        jmp     10b
15:     mov     %r12, P_PAGES(%rsi)
        mov     %r13, P_ORACC(%rsi)
        mov     $DONE_MAGIC, %al
        mov     $PORT_PROGRESS, %dx
        out     %al, %dx
        mov     $0x41, %al
        out     %al, $PORT_DEBUG
        mov     $PORT_RESULT, %dx
        mov     %r12, %rax
        out     %eax, %dx                       # pages, low half
        shr     $32, %rax
        out     %eax, %dx                       # pages, high half
        mov     %r13, %rax
        out     %eax, %dx                       # OR, low half
        shr     $32, %rax
        out     %eax, %dx                       # OR, high half
        lea     msg_pages(%rip), %rdi
        call    puts
        mov     %r12, %rax
        call    putdec
        lea     msg_nonzero(%rip), %rdi
        call    puts
        xor     %ebx, %ebx
        test    %r13, %r13
        setnz   %bl                             # rbx = saw non-zero
        lea     0x30(%rbx), %eax
        mov     $PORT_SERIAL, %dx
        out     %al, %dx
        lea     msg_status(%rip), %rdi
        call    puts
        mov     P_STATUS(%rsi), %rax
        call    putdec
        mov     $0x0a, %al
        mov     $PORT_SERIAL, %dx
        out     %al, %dx
        cmpq    $0, P_SPIN(%rsi)
        jne     spin
        mov     %ebx, %eax
        mov     $PORT_DEBUG_EXIT, %dx
        out     %al, %dx                        # QEMU isa-debug-exit: status (v << 1) | 1
        mov     $S5_SLP, %al
        mov     $PORT_CH_SHUTDOWN, %dx
        out     %al, %dx                        # cloud-hypervisor ACPI shutdown
        mov     $GED_SLEEP_CTL, %edi
        mov     %al, (%rdi)                     # QEMU microvm GED sleep control
16:     cli
        hlt
        jmp     16b

# spin: forever re-read every touched page (each must still hold
# marker ^ gpa; a page that does not is counted in P_BAD) and tick once per
# page. r8..r11 still hold stride, marker, stride - 1, ~(stride - 1).
spin:   rdtsc
        shl     $32, %rdx
        or      %rdx, %rax
        mov     %rax, %r14                      # r14 = TSC of the previous tick
        mov     %rax, P_SPINTSC(%rsi)
        mov     %rax, P_TSC(%rsi)
20:     mov     P_NRANGES(%rsi), %rcx
        lea     P_RANGES(%rsi), %rbx
21:     test    %rcx, %rcx
        jnz     22f
        call    tick                            # no range left (or none at all)
        jmp     20b
22:     mov     (%rbx), %rax
        mov     8(%rbx), %rdx                   # rdx = end
        add     %r10, %rax
        and     %r11, %rax
23:     lea     8(%rax), %rdi
        cmp     %rdx, %rdi
        ja      27f
        cmp     P_SKIPHI(%rsi), %rax
        jae     24f
        cmp     P_SKIPLO(%rsi), %rdi
        ja      26f
24:     mov     %r9, %rdi
        xor     %rax, %rdi
        cmp     (%rax), %rdi
        je      25f
        incq    P_BAD(%rsi)
        mov     %rax, P_BADGPA(%rsi)
25:     call    tick
26:     add     %r8, %rax
        jnc     23b
27:     add     $16, %rbx
        dec     %rcx
        jmp     21b

# tick: one spin iteration: count, read the TSC, keep the largest gap and
# put gaps of at least P_GAPMIN ticks into the ring. Preserves all but rdi.
tick:   push    %rax
        push    %rdx
        incq    P_COUNT(%rsi)
        rdtsc
        shl     $32, %rdx
        or      %rdx, %rax                      # rax = TSC
        mov     %rax, %rdx
        sub     %r14, %rdx                      # rdx = gap since the previous tick
        mov     %rax, %r14
        mov     %rax, P_TSC(%rsi)
        cmp     P_MAXGAP(%rsi), %rdx
        jbe     1f
        mov     %rdx, P_MAXGAP(%rsi)
1:      cmp     P_GAPMIN(%rsi), %rdx
        jb      2f
        mov     P_NGAPS(%rsi), %rdi
        and     $(GAP_RING - 1), %edi
        shl     $4, %edi
        mov     %rax, P_GAPS(%rsi,%rdi)
        mov     %rdx, P_GAPS + 8(%rsi,%rdi)
        incq    P_NGAPS(%rsi)
2:      pop     %rdx
        pop     %rax
        ret

# puts: rdi = NUL-terminated string; clobbers rax, rdx, rdi
puts:   mov     $PORT_SERIAL, %dx
1:      mov     (%rdi), %al
        test    %al, %al
        jz      2f
        out     %al, %dx
        inc     %rdi
        jmp     1b
2:      ret

# putdec: rax = value, printed in decimal; clobbers rax, rcx, rdx, rdi
putdec: sub     $32, %rsp
        lea     31(%rsp), %rdi
        movb    $0, (%rdi)
        mov     $10, %ecx
1:      xor     %edx, %edx
        div     %rcx
        add     $0x30, %dl
        dec     %rdi
        mov     %dl, (%rdi)
        test    %rax, %rax
        jnz     1b
        call    puts
        add     $32, %rsp
        ret

msg_pages:   .asciz "HUGEMEM-GUEST pages="
msg_nonzero: .asciz " nonzero="
msg_status:  .asciz " status="

        .p2align 6
params:
        .quad   0x200000                         # stride
        .quad   0                                # marker
        .quad   BASE                             # skip_lo: our own image
        .quad   BASE + image_end - pvh_entry32   # skip_hi
        .quad   0                                # nranges
        .quad   0                                # pages (out)
        .quad   0                                # OR (out)
        .quad   0                                # min_gpa
        .quad   0                                # fallback RAM size
        .quad   0                                # status (out)
        .fill   MAX_RANGES * 2, 8, 0             # ranges
        .quad   0                                # spin
        .quad   0                                # gap_min
        .quad   0                                # count (out)
        .quad   0                                # tsc (out)
        .quad   0                                # max_gap (out)
        .quad   0                                # bad (out)
        .quad   0                                # bad_gpa (out)
        .quad   0                                # ngaps (out)
        .quad   0                                # spin_tsc (out)
        .fill   GAP_RING * 2, 8, 0               # gap ring (out)
file_end:

        .p2align 12
pt_pml4: .fill 4096, 1, 0
pt_pdpt: .fill 4096, 1, 0
pt_pd:   .fill 4 * 4096, 1, 0
stack:   .fill 4096, 1, 0
stack_top:
image_end:
