//! The embedded store: one redb file, for a single controller.

use super::{Condition, Store, StoreError, Txn, Write};
use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("nvpool");

pub struct RedbStore {
    db: Arc<Database>,
    path: PathBuf,
}

fn err(path: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError(format!("store redb:{}: {e}", path.display()))
}

impl RedbStore {
    /// Opens the file, creating it (and its directory) when missing. The file holds
    /// hosts' DH-HMAC-CHAP secrets: only its owner may read it (0600).
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| err(path, format!("cannot create its directory: {e}")))?;
        }
        // Made here with mode 0600 before redb opens it; an older, wider file is narrowed.
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .and_then(|f| f.set_permissions(std::fs::Permissions::from_mode(0o600)))
            .map_err(|e| err(path, format!("cannot create it with mode 0600: {e}")))?;
        let db = Database::create(path).map_err(|e| {
            err(path, format!("{e} (is another controller using this file? each needs its own, or use etcd)"))
        })?;
        // Create the table so that reads of a new store see an empty table.
        let w = db.begin_write().map_err(|e| err(path, e))?;
        w.open_table(TABLE).map_err(|e| err(path, e))?;
        w.commit().map_err(|e| err(path, e))?;
        Ok(RedbStore { db: Arc::new(db), path: path.to_path_buf() })
    }

    /// Runs redb's blocking calls off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, String> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = self.db.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || f(&db)).await.map_err(|e| err(&path, e))?.map_err(|e| err(&path, e))
    }
}

#[async_trait]
impl Store for RedbStore {
    fn describe(&self) -> String {
        format!("redb:{}", self.path.display())
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = key.to_string();
        self.blocking(move |db| {
            let r = db.begin_read().map_err(|e| e.to_string())?;
            let t = r.open_table(TABLE).map_err(|e| e.to_string())?;
            Ok(t.get(key.as_str()).map_err(|e| e.to_string())?.map(|v| v.value().to_vec()))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let prefix = prefix.to_string();
        self.blocking(move |db| {
            let r = db.begin_read().map_err(|e| e.to_string())?;
            let t = r.open_table(TABLE).map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            for item in t.range(prefix.as_str()..).map_err(|e| e.to_string())? {
                let (k, v) = item.map_err(|e| e.to_string())?;
                if !k.value().starts_with(prefix.as_str()) {
                    break;
                }
                out.push((k.value().to_string(), v.value().to_vec()));
            }
            Ok(out)
        })
        .await
    }

    async fn commit(&self, txn: Txn) -> Result<bool, StoreError> {
        self.blocking(move |db| {
            let w = db.begin_write().map_err(|e| e.to_string())?;
            {
                let mut t = w.open_table(TABLE).map_err(|e| e.to_string())?;
                for c in &txn.conditions {
                    let holds = match c {
                        Condition::Absent(k) => t.get(k.as_str()).map_err(|e| e.to_string())?.is_none(),
                        Condition::Equals(k, v) => {
                            t.get(k.as_str()).map_err(|e| e.to_string())?.is_some_and(|cur| cur.value() == v.as_slice())
                        }
                    };
                    if !holds {
                        return Ok(false); // dropping the transaction aborts it
                    }
                }
                for write in &txn.writes {
                    match write {
                        Write::Put(k, v) => {
                            t.insert(k.as_str(), v.as_slice()).map_err(|e| e.to_string())?;
                        }
                        Write::Delete(k) => {
                            t.remove(k.as_str()).map_err(|e| e.to_string())?;
                        }
                    }
                }
            }
            w.commit().map_err(|e| e.to_string())?;
            Ok(true)
        })
        .await
    }
}
