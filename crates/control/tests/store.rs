//! The store conformance suite against both backends: redb in a file, and a real etcd.

use nvpool_control::store::{self, EtcdStore, RedbStore, Snapshot, Store, Txn};
use nvpool_control::testkit::Etcd;
use std::time::Duration;

#[tokio::test]
async fn redb_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state/controller.redb");
    let s = RedbStore::open(&path).unwrap();
    store::conformance::run(&s, "conformance").await;
    // What was committed is there after reopening.
    drop(s);
    let s = RedbStore::open(&path).unwrap();
    assert_eq!(s.get("/conformance/a").await.unwrap(), Some(b"1".to_vec()));
}

#[tokio::test]
async fn redb_file_is_for_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.redb");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    drop(RedbStore::open(&path).unwrap());
    assert_eq!(mode(&path), 0o600, "the store holds secrets");
    // A file an older build made readable to others is narrowed.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    drop(RedbStore::open(&path).unwrap());
    assert_eq!(mode(&path), 0o600);
}

#[tokio::test]
async fn redb_refuses_a_second_opener() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.redb");
    let _first = RedbStore::open(&path).unwrap();
    let e = RedbStore::open(&path).err().expect("a second open fails");
    assert!(e.0.contains("another controller"), "{e}");
}

#[tokio::test]
async fn etcd_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().to_path_buf());
    let s = EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap();
    store::conformance::run(&s, "conformance").await;
}

#[tokio::test]
async fn etcd_leadership_passes_on_when_the_leader_stops() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().to_path_buf());
    let a = EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap();
    let b = EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap();
    let ttl = Duration::from_secs(1);
    let lead_a = a.campaign("/t/leader", b"a", ttl).await.unwrap();
    // b waits while a keeps its lease alive.
    let b_campaign = tokio::spawn(async move { b.campaign("/t/leader", b"b", ttl).await.map(|l| (b, l)) });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!b_campaign.is_finished(), "b must not lead while a's lease is kept");
    assert!(!*lead_a.lost.borrow());
    // a's fenced writes work; then a dies (its process, and so its keep-alive, ends).
    let fence = |who: &[u8]| nvpool_control::store::Condition::Equals("/t/leader".into(), who.to_vec());
    assert!(a.commit(Txn::default().when(fence(b"a")).put("/t/x", b"a".to_vec())).await.unwrap());
    drop(lead_a);
    drop(a);
    let (b, _lead_b) = tokio::time::timeout(Duration::from_secs(10), b_campaign).await.unwrap().unwrap().unwrap();
    assert_eq!(b.get("/t/leader").await.unwrap(), Some(b"b".to_vec()));
    // A write fenced on the old leader now fails.
    assert!(!b.commit(Txn::default().when(fence(b"a")).put("/t/x", b"stale".to_vec())).await.unwrap());
}

/// A standby's copy of the store holds, once it reached the revision at which the
/// standby took the lead, exactly what the store holds: keys listed over several
/// pages, and every put, overwrite and deletion made after the listing.
#[tokio::test]
async fn etcd_standby_copy_is_the_store_at_the_claim() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(dir.path().to_path_buf());
    let standby = std::sync::Arc::new(EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap());
    let leader = EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap();
    let key = |i: usize| format!("/m/records/{i:05}");
    for batch in 0..12 {
        let txn = (batch * 100..(batch + 1) * 100).fold(Txn::default(), |t, i| t.put(key(i), vec![b'a'; 200]));
        assert!(leader.commit(txn).await.unwrap());
    }
    let mirror = standby.mirror("/m/");
    for i in (0..1200).step_by(7) {
        assert!(leader.commit(Txn::default().put(key(i), b"changed".to_vec())).await.unwrap());
        assert!(leader.commit(Txn::default().delete(key(i + 3))).await.unwrap());
        assert!(leader.commit(Txn::default().put(key(2000 + i), b"new".to_vec())).await.unwrap());
    }
    // Outside the prefix: not copied.
    assert!(leader.commit(Txn::default().put("/m2/other", b"x".to_vec())).await.unwrap());
    let claim = standby.campaign("/m/leader", b"standby", Duration::from_secs(5)).await.unwrap();
    let copy = mirror.take_at(claim.revision, Duration::from_secs(10)).await.expect("the copy reaches the claim");
    let stored = Snapshot::read(&leader, "/m/").await.unwrap();
    let (deleted, added) = ((0..1200).step_by(7).filter(|i| i + 3 < 1200).count(), (0..1200).step_by(7).count());
    assert_eq!(stored.len(), 1200 - deleted + added + 1, "kept, new and the leader key");
    assert!(copy == stored, "the copy holds {} keys, the store {}", copy.len(), stored.len());
    // A copy that cannot reach a revision gives way to a read of the store.
    let mirror = standby.mirror("/m/");
    assert!(mirror.take_at(claim.revision + 1_000, Duration::from_millis(500)).await.is_none());
}

#[tokio::test]
async fn an_unreachable_etcd_is_an_error_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = Etcd::start(dir.path().to_path_buf());
    let s = EtcdStore::connect(std::slice::from_ref(&etcd.client_url)).await.unwrap();
    etcd.stop();
    let started = std::time::Instant::now();
    let e = s.commit(Txn::default().put("/t/y", b"1".to_vec())).await.expect_err("etcd is down");
    assert!(e.0.contains("is etcd running"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(15));
    etcd.resume();
    // The client reconnects on its own; the first calls may still time out. The limit
    // only bounds a hang: on a machine busy with builds, reconnecting took over 20 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while let Err(e) = s.commit(Txn::default().put("/t/y", b"1".to_vec())).await {
        if std::time::Instant::now() >= deadline {
            let log = std::fs::read_to_string(dir.path().join("etcd.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            panic!(
                "the store must work again once etcd is back; last error: {e}; etcd log, last lines first:\n{}",
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
