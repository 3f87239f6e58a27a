//! What the engine's integration tests share: an engine on a local port that stops
//! when dropped, and a namespace as the configuration names it.

use std::net::SocketAddr;
use std::sync::Arc;

use nvpool_engine::Engine;
use nvpool_engine::config::{EngineConfig, ListenerConfig, NamespaceConfig};

/// An engine and where it listens.
pub struct TestEngine {
    pub engine: Arc<Engine>,
    pub addr: SocketAddr,
}

impl TestEngine {
    /// Starts an engine; its first listener is the address tests connect to (a free
    /// port of 127.0.0.1 if the configuration names none).
    pub fn start(cfg: &EngineConfig) -> TestEngine {
        let mut cfg = cfg.clone();
        if cfg.listeners.is_empty() {
            cfg.listeners.push(ListenerConfig {
                address: "127.0.0.1:0".parse().unwrap(),
                tls: Default::default(),
                transport: Default::default(),
            });
        }
        let engine = Engine::start(&cfg).expect("engine starts");
        let l = &engine.listeners()[0];
        let addr = SocketAddr::new(l.addr, l.port);
        TestEngine { engine, addr }
    }
}

impl Drop for TestEngine {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

/// A namespace on `backend` with the next free NSID.
pub fn namespace(backend: &str, block_size: u32) -> NamespaceConfig {
    NamespaceConfig {
        nsid: None,
        backend: backend.into(),
        block_size,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: Default::default(),
    }
}
