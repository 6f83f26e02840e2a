use super::super::{Code, Request, TOKEN_SIZE};
use super::FdRule;

/// The request table of `docs/protocol.md`: (code, name, payload cell) per row.
fn protocol_table() -> Vec<(u32, String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md");
    let doc = std::fs::read_to_string(path).expect("docs/protocol.md");
    let table = doc
        .split("\n## Requests\n")
        .nth(1)
        .expect("a \"## Requests\" section");
    table
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|row| {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let code = cells.get(1)?.parse().ok()?;
            Some((code, cells[2].to_string(), cells[3].to_string()))
        })
        .collect()
}

/// The name the protocol gives a code. No `_` arm: a variant added to
/// `Code` fails to compile here; name it, and add it to `Code::ALL` (a code
/// left out of ALL is refused on the wire and never fuzzed).
fn name(code: Code) -> &'static str {
    match code {
        Code::Handshake => "HANDSHAKE",
        Code::Alloc => "ALLOC",
        Code::Free => "FREE",
        Code::Lock => "LOCK",
        Code::Unlock => "UNLOCK",
        Code::Rebalance => "REBALANCE",
        Code::Stats => "STATS",
        Code::Uffd => "UFFD",
        Code::Reattach => "REATTACH",
        Code::Handoff => "HANDOFF",
        Code::Park => "PARK",
        Code::Restore => "RESTORE",
        Code::Unpark => "UNPARK",
        Code::Export => "EXPORT",
        Code::Clone => "CLONE",
    }
}

#[test]
fn code_list_and_fd_rules_are_the_protocol_table() {
    let rows = protocol_table();
    let listed: Vec<(u32, &str)> = Code::ALL.iter().map(|c| (*c as u32, name(*c))).collect();
    let documented: Vec<(u32, &str)> = rows.iter().map(|(c, n, _)| (*c, n.as_str())).collect();
    assert_eq!(listed, documented, "Code::ALL against the protocol's table");
    for (code, (_, name, payload)) in Code::ALL.iter().zip(&rows) {
        let rule = code.request_fds();
        // The payload cell says which requests carry fds ("exactly one
        // fd", "one fd"), and a flag that adds one ("two with POSTCOPY").
        assert_eq!(
            rule.base > 0,
            payload.contains(" fd"),
            "{name}: {rule:?} against \"{payload}\""
        );
        assert_eq!(
            rule.per_flag != 0,
            payload.contains("**two**") || payload.contains("second fd"),
            "{name}: {rule:?} against \"{payload}\""
        );
    }
}

/// Every flags word a request with a name (PARK, RESTORE, UNPARK, EXPORT) or
/// HANDOFF can carry, flags known now or added later: whatever decodes
/// expects the fds its code's rule gives for its flags.
#[test]
fn expected_fds_follow_the_rule_for_every_flag() {
    let flag_words = (0..=0xffu32).chain((8..32).map(|bit| 1 << bit));
    let mut decoded = Vec::new();
    for flags in flag_words {
        let mut named = 4u32.to_le_bytes().to_vec();
        named.extend_from_slice(b"vm-1");
        named.extend_from_slice(&flags.to_le_bytes());
        let mut handoff = 9u64.to_le_bytes().to_vec();
        handoff.extend_from_slice(&[0x5b; TOKEN_SIZE]);
        handoff.extend_from_slice(&flags.to_le_bytes());
        handoff.extend_from_slice(&0u32.to_le_bytes());
        let cases = [
            (Code::Park, &named),
            (Code::Restore, &named),
            (Code::Unpark, &named),
            (Code::Export, &named),
            (Code::Handoff, &handoff),
        ];
        for (code, payload) in cases {
            let Ok(req) = Request::decode(code, payload) else {
                continue;
            };
            decoded.push(code);
            assert_eq!(req.flags(), flags, "{code:?} keeps its flags");
            assert_eq!(&req.encode(), payload, "{code:?} re-encodes");
            assert_eq!(
                req.expected_fds(),
                code.request_fds().count(flags),
                "{code:?} with flags {flags:#x}"
            );
        }
    }
    for code in [
        Code::Park,
        Code::Restore,
        Code::Unpark,
        Code::Export,
        Code::Handoff,
    ] {
        assert!(decoded.contains(&code), "no {code:?} decoded");
    }
}

#[test]
fn a_rule_counts_its_flags() {
    let rule = FdRule {
        base: 1,
        per_flag: 0b1010,
    };
    assert_eq!(rule.count(0), 1);
    assert_eq!(rule.count(0b0101), 1);
    assert_eq!(rule.count(0b0010), 2);
    assert_eq!(rule.count(u32::MAX), 3);
    assert_eq!(rule.most(), 3);
    assert_eq!(FdRule::NONE.most(), 0);
}
