//! Mutual TLS for the control plane: the controller, the agents, the CLI and the CSI
//! driver each present a certificate from one cluster CA and check the other side's.
//! A certificate's common name says who holds it: `controller`, `node:NAME` (an
//! agent) or `client:NAME` (the CLI, the CSI driver). `nvpool certs init` makes a CA
//! and these certificates for a test cluster.
//!
//! A directory holds `ca.pem` and, per identity, `NAME.pem` and `NAME.key` (0600).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The controller's identity.
pub const CONTROLLER: &str = "controller";
/// The prefix of an agent's identity: `node:NAME`.
pub const NODE_PREFIX: &str = "node:";

/// One side's TLS material: the CA it trusts and its own certificate and key.
#[derive(Clone)]
pub struct Tls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls(redacted)")
    }
}

/// Refuses a caller whose certificate is not `wanted` (where TLS is on).
pub fn require_identity<T>(request: &tonic::Request<T>, wanted: &str) -> Result<(), tonic::Status> {
    match peer_identity(request) {
        Some(who) if who == wanted => Ok(()),
        Some(who) => Err(tonic::Status::permission_denied(format!(
            "the caller's certificate is for {who}, and this call needs {wanted}"
        ))),
        None => Err(tonic::Status::unauthenticated(format!("this call needs a client certificate for {wanted}"))),
    }
}

/// The file name an identity's certificate and key have (`node:n1` → `node-n1`).
pub fn file_stem(identity: &str) -> String {
    identity.replace(':', "-")
}

impl Tls {
    /// Reads `ca.pem` and the certificate and key of `identity` from `dir`.
    pub fn load(dir: &Path, identity: &str) -> Result<Tls, String> {
        let read = |name: String| {
            let path = dir.join(&name);
            std::fs::read(&path).map_err(|e| {
                format!(
                    "cannot read {}: {e} (make the files with `nvpool certs init --dir {}`)",
                    path.display(),
                    dir.display()
                )
            })
        };
        let stem = file_stem(identity);
        Ok(Tls { ca: read("ca.pem".into())?, cert: read(format!("{stem}.pem"))?, key: read(format!("{stem}.key"))? })
    }

    /// For a server: its certificate, and client certificates required from the CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
    }

    /// For a server outside gRPC (the dashboard): its certificate, and a client
    /// certificate required from the CA.
    pub fn rustls_server(&self) -> Result<std::sync::Arc<rustls::ServerConfig>, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &str, e: &dyn std::fmt::Display| format!("the TLS {what} cannot be used: {e}");
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&self.ca) {
            roots.add(ca.map_err(|e| bad("CA", &e))?).map_err(|e| bad("CA", &e))?;
        }
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(&self.cert).collect::<Result<_, _>>().map_err(|e| bad("certificate", &e))?;
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| bad("key", &e))?;
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
            .build()
            .map_err(|e| bad("CA", &e))?;
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?
            .with_client_cert_verifier(clients)
            .with_single_cert(certs, key)
            .map_err(|e| bad("certificate", &e))?;
        Ok(std::sync::Arc::new(config))
    }

    /// For a client: the CA the server's certificate must come from, and its own.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key))
    }
}

/// The common name of the certificate a caller presented, if any.
pub fn peer_identity<T>(request: &tonic::Request<T>) -> Option<String> {
    let certs = request.peer_certs()?;
    let (_, cert) = x509_parser::parse_x509_certificate(certs.first()?.as_ref()).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?.to_string();
    Some(cn)
}

/// Makes a CA and certificates for `identities` in `dir`: keys 0600, each certificate
/// valid for `names` (host names and IP addresses the servers are reached by, beside
/// localhost and the loopback addresses).
pub fn init(dir: &Path, identities: &[String], names: &[String]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let fail = |e: rcgen::Error| format!("cannot make a certificate: {e}");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
    ca_params.distinguished_name.push(DnType::CommonName, "nvpool cluster CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(fail)?;
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key).map_err(fail)?;
    write(&dir.join("ca.pem"), ca.pem().as_bytes(), 0o644)?;
    for identity in identities {
        let mut sans: Vec<SanType> = vec![SanType::DnsName("localhost".try_into().map_err(fail)?)];
        sans.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        sans.push(SanType::IpAddress(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        for n in names {
            sans.push(match n.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(n.clone().try_into().map_err(fail)?),
            });
        }
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        params.distinguished_name.push(DnType::CommonName, identity.as_str());
        let key = KeyPair::generate().map_err(fail)?;
        let cert = params.signed_by(&key, &ca).map_err(fail)?;
        let stem = file_stem(identity);
        write(&dir.join(format!("{stem}.pem")), cert.pem().as_bytes(), 0o644)?;
        write(&dir.join(format!("{stem}.key")), key.serialize_pem().as_bytes(), 0o600)?;
    }
    Ok(())
}

/// Writes a file created with `mode` (a key is never readable by others, not even for
/// a moment).
fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
