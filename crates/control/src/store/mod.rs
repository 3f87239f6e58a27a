//! The controller's persistent state: a small transactional key-value interface with
//! two backends, `redb` (embedded, one file) and `etcd` (shared by several controllers
//! for HA). The controller stores JSON records under string keys; everything above
//! this module is the same for both backends.

mod embedded;
mod etcd;

pub use embedded::RedbStore;
pub use etcd::{EtcdStore, Leadership, Mirror};

use async_trait::async_trait;
use std::fmt;

/// The store could not be reached or failed; the operation did not happen.
#[derive(Debug, Clone)]
pub struct StoreError(pub String);

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StoreError {}

/// A condition a transaction checks before it applies its writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// The key has no value.
    Absent(String),
    /// The key holds exactly these bytes.
    Equals(String, Vec<u8>),
}

/// One write of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    Put(String, Vec<u8>),
    Delete(String),
}

/// Writes applied all together, and only when every condition holds.
#[derive(Debug, Clone, Default)]
pub struct Txn {
    pub conditions: Vec<Condition>,
    pub writes: Vec<Write>,
}

impl Txn {
    pub fn put(mut self, key: impl Into<String>, value: Vec<u8>) -> Self {
        self.writes.push(Write::Put(key.into(), value));
        self
    }

    pub fn delete(mut self, key: impl Into<String>) -> Self {
        self.writes.push(Write::Delete(key.into()));
        self
    }

    pub fn when(mut self, condition: Condition) -> Self {
        self.conditions.push(condition);
        self
    }
}

/// A transactional key-value store.
#[async_trait]
pub trait Store: Send + Sync {
    /// What the store is, for messages: `redb:/path` or `etcd:http://...`.
    fn describe(&self) -> String;
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Every key starting with `prefix`, in key order.
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// Applies the writes if every condition holds. Returns whether it did.
    async fn commit(&self, txn: Txn) -> Result<bool, StoreError>;
}

/// Every key under a prefix as one read saw them: what a controller loads when it
/// takes over.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Snapshot(std::collections::BTreeMap<String, Vec<u8>>);

impl Snapshot {
    /// Reads every key under `prefix` from `store`.
    pub async fn read(store: &dyn Store, prefix: &str) -> Result<Snapshot, StoreError> {
        Ok(Snapshot(store.list(prefix).await?.into_iter().collect()))
    }

    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.0.get(key).map(Vec::as_slice)
    }

    /// The values of the keys that start with `prefix`, in key order.
    pub fn under<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        use std::ops::Bound;
        self.0
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.as_slice())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Opens a store from its address: `redb:PATH` or `etcd:URL[,URL...]`.
pub async fn open(address: &str) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    if let Some(path) = address.strip_prefix("redb:") {
        Ok(std::sync::Arc::new(RedbStore::open(std::path::Path::new(path))?))
    } else if let Some(urls) = address.strip_prefix("etcd:") {
        let endpoints: Vec<String> = urls.split(',').map(str::to_string).collect();
        Ok(std::sync::Arc::new(EtcdStore::connect(&endpoints).await?))
    } else {
        Err(StoreError(format!("store {address:?} is not understood: use redb:PATH or etcd:http://HOST:PORT[,...]")))
    }
}

/// The behaviour every backend must show; run by the tests against both (only with
/// the `testkit` feature, so the library itself carries no test code).
#[cfg(feature = "testkit")]
#[doc(hidden)]
pub mod conformance {
    use super::*;

    /// Runs every check against an empty store. Keys are made unique with `ns`.
    pub async fn run(store: &dyn Store, ns: &str) {
        let k = |s: &str| format!("/{ns}/{s}");
        assert_eq!(store.get(&k("a")).await.unwrap(), None, "a new store is empty");
        assert!(store.list(&k("")).await.unwrap().is_empty());

        // Unconditional writes and reads.
        assert!(store.commit(Txn::default().put(k("a"), b"1".to_vec())).await.unwrap());
        assert_eq!(store.get(&k("a")).await.unwrap(), Some(b"1".to_vec()));

        // Absent: create-if-missing succeeds once.
        let create_b = || Txn::default().when(Condition::Absent(k("b"))).put(k("b"), b"2".to_vec());
        assert!(store.commit(create_b()).await.unwrap());
        assert!(!store.commit(create_b()).await.unwrap(), "a second create must fail its condition");

        // Equals: compare-and-swap.
        let cas = |from: &[u8], to: &[u8]| {
            Txn::default().when(Condition::Equals(k("b"), from.to_vec())).put(k("b"), to.to_vec())
        };
        assert!(!store.commit(cas(b"x", b"3")).await.unwrap());
        assert_eq!(store.get(&k("b")).await.unwrap(), Some(b"2".to_vec()), "a failed condition writes nothing");
        assert!(store.commit(cas(b"2", b"3")).await.unwrap());
        assert_eq!(store.get(&k("b")).await.unwrap(), Some(b"3".to_vec()));
        assert!(
            !store.commit(Txn::default().when(Condition::Equals(k("missing"), b"".to_vec()))).await.unwrap(),
            "Equals on a missing key fails, even for an empty value"
        );

        // Several writes are all-or-nothing.
        let failing = Txn::default().when(Condition::Absent(k("a"))).put(k("c"), b"4".to_vec()).delete(k("b"));
        assert!(!store.commit(failing).await.unwrap());
        assert_eq!(store.get(&k("c")).await.unwrap(), None);
        assert_eq!(store.get(&k("b")).await.unwrap(), Some(b"3".to_vec()));
        let passing = Txn::default()
            .when(Condition::Equals(k("a"), b"1".to_vec()))
            .when(Condition::Absent(k("c")))
            .put(k("c"), b"4".to_vec())
            .delete(k("b"));
        assert!(store.commit(passing).await.unwrap());
        assert_eq!(store.get(&k("b")).await.unwrap(), None);

        // Prefix listing is ordered and does not leak neighbours.
        store.commit(Txn::default().put(k("d/2"), b"x".to_vec()).put(k("d/1"), b"y".to_vec())).await.unwrap();
        store.commit(Txn::default().put(k("d0"), b"z".to_vec())).await.unwrap();
        let listed = store.list(&k("d/")).await.unwrap();
        assert_eq!(listed, vec![(k("d/1"), b"y".to_vec()), (k("d/2"), b"x".to_vec())]);
        assert_eq!(store.list(&k("")).await.unwrap().len(), 5);

        // A listing longer than a backend's page is whole and in order (etcd reads
        // 500 keys at a time), and a key just past the prefix stays out.
        let many: Vec<(String, Vec<u8>)> = (0..1234).map(|i| (k(&format!("e/{i:05}")), vec![i as u8; 3])).collect();
        for chunk in many.chunks(100) {
            let txn = chunk.iter().fold(Txn::default(), |t, (key, v)| t.put(key.clone(), v.clone()));
            assert!(store.commit(txn).await.unwrap());
        }
        store.commit(Txn::default().put(k("e0"), b"past".to_vec())).await.unwrap();
        assert_eq!(store.list(&k("e/")).await.unwrap(), many);

        // Deleting a missing key is not an error.
        assert!(store.commit(Txn::default().delete(k("nothing"))).await.unwrap());

        // Values of any size and content survive.
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        store.commit(Txn::default().put(k("big"), big.clone())).await.unwrap();
        assert_eq!(store.get(&k("big")).await.unwrap(), Some(big));
    }
}
