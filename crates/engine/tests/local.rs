//! Local devices through the management API, where the machine's kernel decides what
//! can be shown: every refusal says what was wrong and what to do, and leaves nothing
//! behind. Serving a real `/dev/ublkbN` needs the ublk driver, which this build
//! machine's kernel lacks: `tests/kernel/local-e2e` does that in the test guest.

use std::sync::Arc;

use nvpool_engine::config::{EngineConfig, LocalDeviceConfig, NamespaceConfig, SubsystemConfig};
use nvpool_engine::error::{Error, ErrorKind};
use nvpool_engine::{Engine, mgmt};
use serde_json::{Value, json};

const NQN: &str = "nqn.2024-01.io.nvpool:local";

fn config() -> EngineConfig {
    let namespace = NamespaceConfig {
        nsid: Some(1),
        backend: "memory:16MiB".into(),
        block_size: 4096,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: Default::default(),
    };
    let subsystem = SubsystemConfig {
        nqn: NQN.into(),
        serial: None,
        model: "nvpool".into(),
        allow_any_host: true,
        hosts: vec![],
        dhchap: vec![],
        tls_psk: vec![],
        namespaces: vec![namespace],
    };
    EngineConfig { reactors: Some(1), subsystems: vec![subsystem], ..EngineConfig::default() }
}

fn call(engine: &Arc<Engine>, method: &str, params: Value) -> Result<Value, Error> {
    mgmt::handle(engine, &json!({ "method": method, "params": params }).to_string())
}

fn add(engine: &Arc<Engine>, target: &str) -> Error {
    call(engine, "local_add", json!({ "device": { "target": target } })).expect_err(target)
}

#[test]
fn targets_that_name_no_namespace_are_refused_with_what_to_do() {
    let engine = Engine::start(&config()).expect("engine starts");
    let e = add(&engine, "no-slash");
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("NQN/NSID or volume:POOL/NAME"), "{e}");
    let e = add(&engine, &format!("{NQN}/9"));
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("no namespace 9") && e.message.contains("subsystem list"), "{e}");
    let e = add(&engine, "nqn.2024-01.io.nvpool:other/1");
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    let e = add(&engine, "volume:fast/db");
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("export the volume first"), "{e}");
    assert_eq!(call(&engine, "local_list", json!({})).unwrap(), json!([]));
    engine.stop();
}

#[test]
fn without_the_ublk_driver_a_device_is_refused_and_nothing_changes() {
    if std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!("this kernel has the ublk driver: the guest test covers it (tests/kernel/local-e2e)");
        return;
    }
    let engine = Engine::start(&config()).expect("engine starts");
    let e = add(&engine, &format!("{NQN}/1"));
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert!(e.message.contains("modprobe ublk_drv") && e.message.contains("NVMe/TCP"), "{e}");
    assert_eq!(call(&engine, "local_list", json!({})).unwrap(), json!([]));
    let e = call(&engine, "local_remove", json!({ "ublk_id": 3 })).expect_err("nothing to remove");
    assert_eq!(e.kind, ErrorKind::Unavailable, "{e}");
    // The namespace is untouched and can go.
    call(&engine, "namespace_remove", json!({ "nqn": NQN, "nsid": 1 })).expect("namespace removed");
    engine.stop();

    // A configuration that asks for a device the kernel cannot make does not start.
    let mut cfg = config();
    cfg.local.push(LocalDeviceConfig {
        target: format!("{NQN}/1"),
        ublk_id: Some(0),
        read_only: false,
        queue_depth: None,
        vhost_user_blk: None,
    });
    let e = Engine::start(&cfg).err().expect("refused");
    assert!(e.message.contains("modprobe ublk_drv"), "{e}");
}

#[test]
fn local_devices_in_the_configuration_are_checked_when_it_is_read() {
    let text = format!(
        "[[subsystem]]\nnqn = \"{NQN}\"\n[[subsystem.namespace]]\nbackend = \"null:1GiB\"\n\
         [[local]]\ntarget = \"{NQN}/1\"\nublk_id = 2\nread_only = true\n"
    );
    let cfg = EngineConfig::from_toml(&text).expect("parses");
    assert_eq!(
        cfg.local,
        vec![LocalDeviceConfig {
            target: format!("{NQN}/1"),
            ublk_id: Some(2),
            read_only: true,
            queue_depth: None,
            vhost_user_blk: None
        }]
    );
    let e = EngineConfig::from_toml(&format!("{text}bogus = 1\n")).expect_err("unknown field");
    assert!(e.contains("bogus"), "{e}");
}
