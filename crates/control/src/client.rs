//! A Controller API client that finds the leader among several controllers and
//! retries while none leads, so that callers survive a failover. Only calls that
//! could not have reached a leader are retried; every API call is idempotent, so a
//! retry after a connection broke mid-call is safe too.

use crate::proto::controller_client::ControllerClient;
use crate::server::{FROM_CONTROLLER, TRY_ANOTHER};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

pub struct Controllers {
    endpoints: Vec<String>,
    channels: Vec<Channel>,
    /// The endpoint that answered last; tried first.
    preferred: Mutex<usize>,
    /// How long to keep trying when no controller leads.
    pub patience: Duration,
}

impl Controllers {
    /// `addresses`: one or more `HOST:PORT` or `http://HOST:PORT`, comma separated.
    pub fn new(addresses: &str) -> Result<Controllers, String> {
        let endpoints: Vec<String> = addresses
            .split(',')
            .filter(|a| !a.is_empty())
            .map(|a| if a.contains("://") { a.to_string() } else { format!("http://{a}") })
            .collect();
        if endpoints.is_empty() {
            return Err("no controller address given: pass --controller HOST:PORT".into());
        }
        let channels = endpoints
            .iter()
            .map(|e| {
                Endpoint::from_shared(e.clone())
                    .map(|ep| ep.connect_timeout(Duration::from_secs(1)).connect_lazy())
                    .map_err(|err| format!("controller address {e:?} is not valid: {err}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Controllers { endpoints, channels, preferred: Mutex::new(0), patience: Duration::from_secs(15) })
    }

    pub fn addresses(&self) -> String {
        self.endpoints.join(",")
    }

    /// Calls `f` on the leader. (`f` returns a plain future rather than being an async
    /// closure so that the call stays `Send` for spawned tasks and gRPC handlers.)
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, Status>
    where
        F: Fn(ControllerClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let deadline = Instant::now() + self.patience;
        let n = self.channels.len();
        loop {
            let first = *self.preferred.lock().unwrap();
            let mut last = None;
            for i in (0..n).map(|k| (first + k) % n) {
                match f(ControllerClient::new(self.channels[i].clone())).await {
                    Ok(r) => {
                        *self.preferred.lock().unwrap() = i;
                        return Ok(r.into_inner());
                    }
                    Err(s) if retryable(&s) => last = Some(s),
                    Err(s) => return Err(s),
                }
            }
            let last = last.expect("at least one endpoint");
            if Instant::now() >= deadline {
                let detail = if last.metadata().contains_key(FROM_CONTROLLER) {
                    last.message().to_string()
                } else {
                    format!("cannot reach a controller at {}: {}", self.addresses(), last.message())
                };
                return Err(Status::new(last.code(), format!("{detail} (is `nvpool controller` running?)")));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Transport failures and standby answers: another controller (or a later try) may serve.
fn retryable(s: &Status) -> bool {
    let from_controller = s.metadata().contains_key(FROM_CONTROLLER);
    s.metadata().contains_key(TRY_ANOTHER)
        || (!from_controller
            && matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled))
}
