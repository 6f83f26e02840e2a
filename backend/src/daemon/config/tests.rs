//! Tests of the configuration.

use super::*;

#[test]
fn empty_file_is_the_default_and_validates() {
    let c = Config::from_toml_str("").expect("parse");
    assert_eq!(c, Config::default());
    c.validate().expect("valid");
    assert_eq!(c.socket, PathBuf::from(DEFAULT_SOCKET));
    assert!(c.metrics.listen.is_none());
}

#[test]
fn the_example_file_documents_the_defaults() {
    let text = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/hugemem.toml"
    ));
    let c = Config::from_toml_str(text).expect("scripts/hugemem.toml parses");
    assert_eq!(
        c,
        Config::default(),
        "scripts/hugemem.toml must show the defaults"
    );
}

#[test]
fn sizes_parse_from_ints_and_strings() {
    let c = Config::from_toml_str(
        r#"
        socket = "/tmp/x.sock"
        allowed_uids = [0, 1000]
        [pool]
        target = "1G"
        limit = 4294967296
        [[pool.node]]
        id = 1
        limit = "512M"
        target = "256M"
        [scrub]
        batch = "32M"
        [metrics]
        listen = "127.0.0.1:9464"
        "#,
    )
    .expect("parse");
    c.validate().expect("valid");
    assert_eq!(c.pool.limits(0), (1 << 30, 4 << 30));
    assert_eq!(c.pool.limits(1), (256 << 20, 512 << 20));
    assert_eq!(c.scrub.batch, ByteSize(32 << 20));
    assert_eq!(c.effective_uids(), vec![0, 1000]);
}

#[test]
fn per_size_limits_and_waits_are_checked() {
    let c =
        Config::from_toml_str("[pool]\nlimit_1g = \"2G\"\nlimit_2m = \"64M\"\n").expect("parse");
    c.validate().expect("valid");
    assert_eq!(c.pool.size_limit(guest_mem::PageSize::Huge1G), 2 << 30);
    assert_eq!(c.pool.size_limit(guest_mem::PageSize::Huge2M), 64 << 20);
    assert_eq!(c.pool.size_limit(guest_mem::PageSize::Base4K), 0);
    let c = Config::from_toml_str("[pool]\nlimit_1g = \"3M\"\n").expect("parse");
    let e = c.validate().expect_err("3M is not whole 1G pages");
    assert_eq!(
        e.to_string(),
        "pool.limit_1g = 3M is not a multiple of the 1G page size"
    );
    let c = Config::from_toml_str("[pool]\nalloc_wait_ms = 70000\n").expect("parse");
    assert!(matches!(
        c.validate(),
        Err(ValidationError::AllocWait(70_000, 60_000))
    ));
    let d = PoolConfig::default();
    assert_eq!(d.alloc_wait(None), Duration::from_secs(5));
    assert_eq!(d.alloc_wait(Some(250)), Duration::from_millis(250));
    assert_eq!(d.alloc_wait(Some(u32::MAX)), Duration::from_secs(60));
}

#[test]
fn unknown_keys_and_bad_values_are_refused() {
    assert!(Config::from_toml_str("limt = 3").is_err());
    assert!(Config::from_toml_str("[pool]\nlimit = \"lots\"").is_err());
    let err = Config::from_toml_str("[pool]\nlimitt = 1").expect_err("unknown key");
    assert!(format!("{:?}", err).contains("limitt"), "{err:?}");
}

#[test]
fn cli_overrides_win() {
    let mut c =
        Config::from_toml_str("socket = \"/a.sock\"\n[pool]\nlimit = \"1G\"\ntarget = \"1G\"")
            .expect("parse");
    c.apply(&Overrides {
        socket: Some(PathBuf::from("/b.sock")),
        pool_limit: Some(4 << 30),
        allowed_uids: vec![7],
        ..Overrides::default()
    });
    assert_eq!(c.socket, PathBuf::from("/b.sock"));
    assert_eq!(c.pool.limit, ByteSize(4 << 30));
    assert_eq!(c.pool.target, ByteSize(1 << 30));
    // The list adds uid 7; root and the daemon's uid stay allowed.
    let uids = c.effective_uids();
    assert!(uids.contains(&7) && uids.contains(&0), "{uids:?}");
    c.validate().expect("valid");
}

#[test]
fn validation() {
    let mut c = Config::default();
    c.metrics.listen = Some("0.0.0.0:9464".parse().expect("addr"));
    assert!(matches!(
        c.validate(),
        Err(ValidationError::MetricsNotLoopback(_))
    ));
    c.metrics.listen = Some("[::1]:9464".parse().expect("addr"));
    c.validate().expect("ipv6 loopback is fine");
    let mut c = Config::default();
    c.pool.target = ByteSize(9 << 30);
    assert!(matches!(
        c.validate(),
        Err(ValidationError::TargetAboveLimit { .. })
    ));
    let mut c = Config::default();
    c.scrub.threads_per_node = 0;
    assert!(c.validate().is_err());
    let mut c = Config::default();
    c.scrub.batch = ByteSize(3 << 20);
    assert!(c.validate().is_err());
    let c = Config {
        socket: PathBuf::from("rel.sock"),
        ..Config::default()
    };
    assert!(c.validate().is_err());
}
