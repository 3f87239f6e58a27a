//! The little of the Kubernetes API the driver uses: Secrets, to hand a host its
//! DH-HMAC-CHAP secrets from the Controller service to the Node service.
//!
//! In a pod it finds the API server and its credentials as every in-cluster client
//! does (`KUBERNETES_SERVICE_HOST`/`_PORT`, the service account's token and CA);
//! outside one (tests, a driver run by hand) it takes them from flags.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::TlsConnector;

/// Where a pod's service account credentials are.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// How long one API call may take.
const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// A Kubernetes API server, and how to call it.
#[derive(Clone)]
pub struct KubeApi {
    host: String,
    port: u16,
    /// Read at each call: projected service account tokens are rotated.
    token_file: PathBuf,
    tls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for KubeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KubeApi(https://{}:{})", self.host, self.port)
    }
}

impl KubeApi {
    /// The API server of the pod this runs in, or `None` outside a pod.
    pub fn in_cluster() -> Result<Option<KubeApi>, String> {
        let (Ok(host), Ok(port)) = (std::env::var("KUBERNETES_SERVICE_HOST"), std::env::var("KUBERNETES_SERVICE_PORT"))
        else {
            return Ok(None);
        };
        let dir = Path::new(SERVICE_ACCOUNT);
        let url =
            if host.contains(':') { format!("https://[{host}]:{port}") } else { format!("https://{host}:{port}") };
        KubeApi::new(&url, &dir.join("token"), &dir.join("ca.crt")).map(Some)
    }

    /// The API server at `url` (`https://HOST:PORT`), trusted through the CA
    /// certificates in `ca_file`, called with the bearer token in `token_file`.
    pub fn new(url: &str, token_file: &Path, ca_file: &Path) -> Result<KubeApi, String> {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("the Kubernetes API URL {url:?} must start with https://"))?
            .trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => {
                (h, p.parse().map_err(|_| format!("the Kubernetes API URL {url:?} has a bad port"))?)
            }
            _ => (rest, 443),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(ca_file)
            .map_err(|e| format!("cannot read the Kubernetes CA {}: {e}", ca_file.display()))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("the Kubernetes CA {} is not PEM: {e}", ca_file.display()))?;
            roots.add(cert).map_err(|e| format!("the Kubernetes CA {}: {e}", ca_file.display()))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(KubeApi { host, port, token_file: token_file.to_path_buf(), tls: Arc::new(tls) })
    }

    /// Creates Secret `namespace/name` with `data`, or replaces the one there.
    pub async fn put_secret(
        &self,
        namespace: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        data: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        let encoded: BTreeMap<&String, String> = data.iter().map(|(k, v)| (k, STANDARD.encode(v))).collect();
        let secret = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "type": "Opaque",
            "data": encoded,
        });
        let body = secret.to_string().into_bytes();
        let path = format!("/api/v1/namespaces/{namespace}/secrets");
        let (status, reply) = self.call(Method::POST, &path, Some(body.clone())).await?;
        match status {
            s if s.is_success() => Ok(()),
            StatusCode::CONFLICT => {
                let (status, reply) = self.call(Method::PUT, &format!("{path}/{name}"), Some(body)).await?;
                if status.is_success() { Ok(()) } else { Err(refusal("replace", namespace, name, status, &reply)) }
            }
            _ => Err(refusal("create", namespace, name, status, &reply)),
        }
    }

    /// The data of Secret `namespace/name`.
    pub async fn get_secret(&self, namespace: &str, name: &str) -> Result<BTreeMap<String, String>, String> {
        let (status, reply) =
            self.call(Method::GET, &format!("/api/v1/namespaces/{namespace}/secrets/{name}"), None).await?;
        if !status.is_success() {
            return Err(refusal("read", namespace, name, status, &reply));
        }
        let secret: serde_json::Value =
            serde_json::from_slice(&reply).map_err(|e| format!("Secret {namespace}/{name} is not JSON: {e}"))?;
        let mut data = BTreeMap::new();
        if let Some(fields) = secret["data"].as_object() {
            for (k, v) in fields {
                let decoded = v.as_str().and_then(|s| STANDARD.decode(s).ok()).and_then(|b| String::from_utf8(b).ok());
                let value = decoded.ok_or_else(|| format!("Secret {namespace}/{name} field {k} is not base64 text"))?;
                data.insert(k.clone(), value);
            }
        }
        Ok(data)
    }

    /// Deletes Secret `namespace/name`; one that is not there is fine.
    pub async fn delete_secret(&self, namespace: &str, name: &str) -> Result<(), String> {
        let (status, reply) =
            self.call(Method::DELETE, &format!("/api/v1/namespaces/{namespace}/secrets/{name}"), None).await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            Ok(())
        } else {
            Err(refusal("delete", namespace, name, status, &reply))
        }
    }

    /// One request on a connection of its own: the driver makes a few calls per
    /// attachment, so no connection is kept.
    async fn call(&self, method: Method, path: &str, body: Option<Vec<u8>>) -> Result<(StatusCode, Bytes), String> {
        let token = std::fs::read_to_string(&self.token_file)
            .map_err(|e| format!("cannot read the Kubernetes token {}: {e}", self.token_file.display()))?;
        let api = format!("{}:{}", self.host, self.port);
        let unreachable = |e: &dyn std::fmt::Display| format!("the Kubernetes API server at {api}: {e}");
        let exchange = async {
            let tcp =
                tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await.map_err(|e| unreachable(&e))?;
            let name = ServerName::try_from(self.host.clone()).map_err(|e| unreachable(&e))?;
            let tls = TlsConnector::from(self.tls.clone()).connect(name, tcp).await.map_err(|e| unreachable(&e))?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| unreachable(&e))?;
            tokio::spawn(connection);
            let request = Request::builder()
                .method(method)
                .uri(path)
                .header(hyper::header::HOST, &api)
                .header(hyper::header::AUTHORIZATION, format!("Bearer {}", token.trim()))
                .header(hyper::header::ACCEPT, "application/json")
                .header(hyper::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body.unwrap_or_default())))
                .map_err(|e| unreachable(&e))?;
            let response = sender.send_request(request).await.map_err(|e| unreachable(&e))?;
            let status = response.status();
            let reply = response.into_body().collect().await.map_err(|e| unreachable(&e))?.to_bytes();
            Ok((status, reply))
        };
        tokio::time::timeout(CALL_TIMEOUT, exchange).await.map_err(|_| unreachable(&"no answer in 20 s"))?
    }
}

/// An API server's refusal, with its own message (`Status.message`).
fn refusal(what: &str, namespace: &str, name: &str, status: StatusCode, reply: &[u8]) -> String {
    let message = serde_json::from_slice::<serde_json::Value>(reply)
        .ok()
        .and_then(|v| v["message"].as_str().map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(reply).chars().take(200).collect());
    let hint = match status {
        StatusCode::FORBIDDEN => " (the driver's service account needs that right on Secrets: see deploy/kubernetes)",
        StatusCode::UNAUTHORIZED => " (the driver's token was not accepted)",
        _ => "",
    };
    format!("cannot {what} Secret {namespace}/{name}: {status}: {message}{hint}")
}
