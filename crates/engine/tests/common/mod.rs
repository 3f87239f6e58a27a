//! What the engine's integration tests share: an engine on a local port that stops
//! when dropped, and a namespace as the configuration names it.

use std::net::SocketAddr;
use std::sync::Arc;

use nvpool_engine::Engine;
use nvpool_engine::config::{EngineConfig, NamespaceConfig};

/// An engine and where it listens.
pub struct TestEngine {
    pub engine: Arc<Engine>,
    pub addr: SocketAddr,
}

impl TestEngine {
    /// Starts an engine; its first listener is the address tests connect to.
    pub fn start(cfg: &EngineConfig) -> TestEngine {
        let engine = Engine::start(cfg).expect("engine starts");
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
