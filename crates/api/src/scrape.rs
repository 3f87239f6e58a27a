//! The HTTP of a Prometheus scrape, shared by the engine's, the agent's and the
//! controller's `/metrics` servers (each does its own I/O): which answer a request head
//! gets, and the reply's bytes. Only `GET /metrics` is served; the connection closes
//! after each reply.

/// The Content-Type of the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Most bytes of a request head read before answering.
pub const MAX_HEAD: usize = 16 * 1024;

/// Whether `head` holds a whole request head (or as much as will be read).
pub fn head_complete(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.len() >= MAX_HEAD
}

/// The reply to a request whose head is `head`; `metrics` makes the body of a scrape.
pub fn reply(head: &[u8], metrics: impl FnOnce() -> String) -> String {
    let text = String::from_utf8_lossy(head);
    let mut parts = text.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let (status, content_type, body) = match (method, target.split('?').next().unwrap_or_default()) {
        ("GET", "/metrics") => ("200 OK", CONTENT_TYPE, metrics()),
        ("GET", _) => ("404 Not Found", "text/plain", "not found: the metrics are at /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain", "only GET /metrics is served\n".to_string()),
    };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_scrape_gets_the_metrics() {
        let ok = reply(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", || "m 1\n".into());
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nm 1\n"), "{ok}");
        assert!(ok.contains("Content-Length: 4\r\n") && ok.contains(CONTENT_TYPE));
        let never = || -> String { panic!("rendered for a request that is not a scrape") };
        assert!(reply(b"GET / HTTP/1.1\r\n\r\n", never).starts_with("HTTP/1.1 404"));
        assert!(reply(b"POST /metrics HTTP/1.1\r\n\r\n", never).starts_with("HTTP/1.1 405"));
        assert!(reply(b"", never).starts_with("HTTP/1.1 405"));
        assert!(head_complete(b"GET / HTTP/1.1\r\n\r\n") && !head_complete(b"GET / HTTP/1.1\r\n"));
        assert!(head_complete(&vec![b'a'; MAX_HEAD]));
    }
}
