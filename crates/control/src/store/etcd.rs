//! The HA store: etcd, shared by several controllers. One of them leads: it holds a
//! key bound to an etcd lease, keeps the lease alive, and fences every write with a
//! condition on that key, so a controller that lost the lease can no longer write.

use super::{Condition, Store, StoreError, Txn, Write};
use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, TxnOp};
use std::time::Duration;
use tokio::sync::watch;

pub struct EtcdStore {
    /// Replaced after a call that could not reach etcd (see `failed`).
    client: std::sync::Mutex<Client>,
    endpoints: Vec<String>,
}

/// Keys per page of a listing: a page of volume records stays well under a megabyte.
const LIST_PAGE: i64 = 500;

/// The first key after every key that starts with `prefix` (etcd's range end).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xff (or the prefix was empty): to the end of the keys.
    vec![0]
}

fn options() -> ConnectOptions {
    ConnectOptions::new().with_connect_timeout(Duration::from_secs(2)).with_timeout(Duration::from_secs(5))
}

impl EtcdStore {
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore, StoreError> {
        let client = Client::connect(endpoints, Some(options())).await.map_err(|e| {
            StoreError(format!("cannot reach etcd at {}: {e} (is etcd running there?)", endpoints.join(",")))
        })?;
        Ok(EtcdStore { client: std::sync::Mutex::new(client), endpoints: endpoints.to_vec() })
    }

    fn client(&self) -> Client {
        self.client.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn err(&self, e: etcd_client::Error) -> StoreError {
        StoreError(format!("store etcd:{}: {e} (is etcd running and reachable?)", self.endpoints.join(",")))
    }

    /// A call failed. When etcd could not be reached, the client is made anew for the
    /// next call: a channel whose endpoints all failed while etcd was down does not
    /// always come back by itself once etcd does.
    async fn failed(&self, e: etcd_client::Error) -> StoreError {
        let unreachable = match &e {
            etcd_client::Error::GRpcStatus(s) => {
                matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown)
            }
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
            _ => false,
        };
        if unreachable && let Ok(fresh) = Client::connect(&self.endpoints, Some(options())).await {
            *self.client.lock().unwrap_or_else(|p| p.into_inner()) = fresh;
        }
        self.err(e)
    }

    /// Waits until this controller holds `key`, then keeps it. `value` identifies the
    /// controller; other controllers read it to find the leader.
    pub async fn campaign(&self, key: &str, value: &[u8], ttl: Duration) -> Result<Leadership, StoreError> {
        let mut client = self.client();
        let ttl_s = ttl.as_secs().max(1) as i64;
        loop {
            // A standby only reads while someone leads: a claim (a lease, a
            // transaction, a revocation) is three writes on every member's disk, and
            // trying one every 300 ms was most of what etcd wrote at rest.
            if !client.get(key, None).await.map_err(|e| self.err(e))?.kvs().is_empty() {
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
            let lease = client.lease_grant(ttl_s, None).await.map_err(|e| self.err(e))?.id();
            let claim = etcd_client::Txn::new()
                .when([Compare::version(key, CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)))]);
            if client.txn(claim).await.map_err(|e| self.err(e))?.succeeded() {
                let (lost_tx, lost) = watch::channel(false);
                let keeper = tokio::spawn(keep_alive(client.clone(), lease, ttl, lost_tx));
                return Ok(Leadership { lost, keeper });
            }
            let _ = client.lease_revoke(lease).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// Held by the leading controller. `lost` turns true when the lease could not be kept.
/// Dropping it stops renewing the lease, which then expires as if the leader had died.
pub struct Leadership {
    pub lost: watch::Receiver<bool>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

async fn keep_alive(mut client: Client, lease: i64, ttl: Duration, lost: watch::Sender<bool>) {
    let kept = async {
        let (mut keeper, mut replies) = client.lease_keep_alive(lease).await.ok()?;
        loop {
            tokio::time::sleep(ttl / 3).await;
            tokio::time::timeout(ttl / 3, keeper.keep_alive()).await.ok()?.ok()?;
            let reply = tokio::time::timeout(ttl / 3, replies.message()).await.ok()?.ok()??;
            if reply.ttl() <= 0 {
                return Some(());
            }
        }
    };
    kept.await;
    let _ = lost.send(true);
}

#[async_trait]
impl Store for EtcdStore {
    fn describe(&self) -> String {
        format!("etcd:{}", self.endpoints.join(","))
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let r = match self.client().get(key, None).await {
            Ok(r) => r,
            Err(e) => return Err(self.failed(e).await),
        };
        Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Reads the prefix in pages, all at the revision of the first page: one answer
    /// for 100,000 volumes would be hundreds of megabytes, past the client's message
    /// limit and its call timeout.
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let end = prefix_end(prefix.as_bytes());
        // etcd has no empty key: the whole key space starts at "\0".
        let mut from = if prefix.is_empty() { vec![0] } else { prefix.as_bytes().to_vec() };
        let mut revision = 0;
        let mut listed = Vec::new();
        loop {
            let page = GetOptions::new().with_range(end.clone()).with_limit(LIST_PAGE).with_revision(revision);
            let r = match self.client().get(from.clone(), Some(page)).await {
                Ok(r) => r,
                Err(e) => return Err(self.failed(e).await),
            };
            if revision == 0 {
                revision = r.header().map_or(0, |h| h.revision());
            }
            for kv in r.kvs() {
                listed.push((kv.key_str().map_err(|e| self.err(e))?.to_string(), kv.value().to_vec()));
            }
            match (r.more(), r.kvs().last()) {
                (true, Some(last)) => {
                    // The next page starts just after the last key read.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(listed),
            }
        }
    }

    async fn commit(&self, txn: Txn) -> Result<bool, StoreError> {
        let compares: Vec<Compare> = txn
            .conditions
            .iter()
            .map(|c| match c {
                Condition::Absent(k) => Compare::version(k.as_str(), CompareOp::Equal, 0),
                // etcd fails a value comparison on a missing key, as the trait requires.
                Condition::Equals(k, v) => Compare::value(k.as_str(), CompareOp::Equal, v.clone()),
            })
            .collect();
        let ops: Vec<TxnOp> = txn
            .writes
            .iter()
            .map(|w| match w {
                Write::Put(k, v) => TxnOp::put(k.as_str(), v.clone(), None),
                Write::Delete(k) => TxnOp::delete(k.as_str(), None),
            })
            .collect();
        match self.client().txn(etcd_client::Txn::new().when(compares).and_then(ops)).await {
            Ok(r) => Ok(r.succeeded()),
            Err(e) => Err(self.failed(e).await),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_where_its_last_byte_below_0xff_grows() {
        assert_eq!(prefix_end(b"/v/"), b"/v0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }
}
