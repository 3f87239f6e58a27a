//! A Controller API client that finds the leader among several controllers and
//! retries while none leads, so that callers survive a failover. Only calls that
//! could not have reached a leader are retried; every API call is idempotent, so a
//! retry after a connection broke mid-call is safe too.

use crate::metadata::{FROM_CONTROLLER, TRY_ANOTHER};
use crate::proto::controller_client::ControllerClient;
use crate::tls::Tls;
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
        Controllers::with_tls(addresses, None)
    }

    /// As `new`, over mutual TLS with `tls` (`https://`) when given.
    pub fn with_tls(addresses: &str, tls: Option<&Tls>) -> Result<Controllers, String> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoints: Vec<String> = addresses
            .split(',')
            .filter(|a| !a.is_empty())
            .map(|a| match a.split_once("://") {
                Some((_, rest)) => format!("{scheme}://{rest}"),
                None => format!("{scheme}://{a}"),
            })
            .collect();
        if endpoints.is_empty() {
            return Err("no controller address given: pass --controller HOST:PORT".into());
        }
        let channels = endpoints
            .iter()
            .map(|e| {
                let ep = Endpoint::from_shared(e.clone())
                    .map_err(|err| format!("controller address {e:?} is not valid: {err}"))?
                    .connect_timeout(Duration::from_secs(1));
                let ep = match tls {
                    Some(t) => ep.tls_config(t.client()).map_err(|err| format!("TLS for {e}: {err}"))?,
                    None => ep,
                };
                Ok::<_, String>(ep.connect_lazy())
            })
            .collect::<Result<_, _>>()?;
        Ok(Controllers { endpoints, channels, preferred: Mutex::new(0), patience: Duration::from_secs(15) })
    }

    pub fn addresses(&self) -> String {
        self.endpoints.join(",")
    }

    /// Whether a failure looks like a TLS mismatch: a certificate refused, or a plain
    /// HTTP/2 connection to a TLS server (which fails inside HTTP/2).
    fn tls_failure(&self, s: &Status) -> bool {
        let m = s.message();
        m.contains("certificate") || m.contains("tls") || m.contains("TLS") || m.contains("h2 protocol error")
    }

    /// A transport failure with what to do about it.
    fn explained(&self, s: Status) -> Status {
        if !s.metadata().contains_key(FROM_CONTROLLER) && self.tls_failure(&s) {
            let tls = self.endpoints.first().is_some_and(|e| e.starts_with("https://"));
            let hint = if tls {
                "the controller refused this client's certificate, or presented one not from --tls-dir's CA"
            } else {
                "the controller may require mutual TLS: pass --tls-dir with the cluster's certificates"
            };
            return Status::new(s.code(), format!("{} ({hint})", s.message()));
        }
        s
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
                // A listing of 100,000 volumes is about 22 MB, past tonic's 4 MiB default.
                let client = ControllerClient::new(self.channels[i].clone()).max_decoding_message_size(usize::MAX);
                match f(client).await {
                    Ok(r) => {
                        *self.preferred.lock().unwrap() = i;
                        return Ok(r.into_inner());
                    }
                    Err(s) if retryable(&s) => last = Some(s),
                    Err(s) => return Err(self.explained(s)),
                }
            }
            let last = last.expect("at least one endpoint");
            if Instant::now() >= deadline {
                let detail = if last.metadata().contains_key(FROM_CONTROLLER) {
                    last.message().to_string()
                } else {
                    format!("cannot reach a controller at {}: {}", self.addresses(), last.message())
                };
                let hint = if self.tls_failure(&last) {
                    "is --tls-dir the cluster's, from the same `nvpool certs init`?"
                } else {
                    "is `nvpool controller` running?"
                };
                return Err(Status::new(last.code(), format!("{detail} ({hint})")));
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
