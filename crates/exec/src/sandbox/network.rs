//! The network by name: an attempt whose `sandbox_network` lists hosts has a network namespace of
//! its own with nothing in it but loopback, and reaches the outside only through loopd's proxy,
//! which allows the listed hosts and ports and nothing else.
//!
//! Theory of operation: the kept sandbox's network namespace (see `super::cache`) holds, on its
//! loopback, the proxy's listener (`HTTPS_PROXY`, `HTTP_PROXY` and `ALL_PROXY` name it) and, for
//! each listed loopback address, a listener on the same address and port that forwards to it (a
//! client that goes to `127.0.0.1:8080` straight, as many do for loopback whatever the proxy
//! variables say, reaches it the same way). loopd makes the listeners from a thread that joins
//! the namespace for that, and serves them from its own namespace: a connection accepted there is
//! the attempt's, the one loopd makes on its behalf is loopd's. The proxy speaks HTTP CONNECT and
//! plain HTTP (one request a connection); it resolves names itself (through the system's
//! resolver, or a hosts file `LOOPD_HOSTS_FILE` names, for tests), refuses an address written as
//! such unless it is listed as such, never relays to another proxy, and tells each refusal
//! ([`Refusal`]). A program that ignores the proxy gets nowhere: there is no route out, and no
//! resolver answers a name.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// The longest request head the proxy reads.
const MAX_HEAD: usize = 16 << 10;
/// How long a connection may take to send its request head, and loopd to reach the host.
const HEAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A host an attempt may reach, with its port: a name (`api.anthropic.com`), every name under a
/// domain (`*.npmjs.org`: `registry.npmjs.org`, not `npmjs.org`), or an address (`127.0.0.1`,
/// `[::1]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostRule {
    pub host: HostPattern,
    pub port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HostPattern {
    Name(String),
    /// `*.` and the domain, kept with its leading dot (`.npmjs.org`).
    Under(String),
    Address(IpAddr),
}

impl HostRule {
    /// `host:port`, `*.domain:port`, `1.2.3.4:port` or `[::1]:port`; names are lowercase.
    pub fn parse(text: &str) -> Result<HostRule, String> {
        let bad = |why: &str| format!("{text:?}: {why} (give host:port, *.domain:port or ip:port)");
        let (host, port) = text.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("not a port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(address) = host.parse::<IpAddr>() {
            return Ok(HostRule {
                host: HostPattern::Address(address),
                port,
            });
        }
        let name = host.to_ascii_lowercase();
        let valid = |n: &str| {
            !n.is_empty()
                && n.split('.').all(|label| {
                    !label.is_empty()
                        && label
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                })
        };
        match name.strip_prefix("*.") {
            Some(domain) if valid(domain) => Ok(HostRule {
                host: HostPattern::Under(format!(".{domain}")),
                port,
            }),
            None if valid(&name) => Ok(HostRule {
                host: HostPattern::Name(name),
                port,
            }),
            _ => Err(bad("not a host name")),
        }
    }

    /// Whether a request for `host` (a name or an address as the client wrote it) and `port` is
    /// one this rule allows.
    fn allows(&self, host: &Target, port: u16) -> bool {
        if port != self.port {
            return false;
        }
        match (&self.host, host) {
            (HostPattern::Name(n), Target::Name(h)) => n == h,
            (HostPattern::Under(d), Target::Name(h)) => h.ends_with(d.as_str()),
            (HostPattern::Address(a), Target::Address(h)) => a == h,
            _ => false,
        }
    }

    /// The loopback address and port this rule names, if it names one (`127.0.0.1:8080`,
    /// `localhost:8080`): forwarded inside the attempt's namespace as it is.
    pub fn loopback(&self) -> Option<SocketAddr> {
        match &self.host {
            HostPattern::Address(a) if a.is_loopback() => Some(SocketAddr::new(*a, self.port)),
            HostPattern::Name(n) if n == "localhost" => {
                Some(SocketAddr::new(IpAddr::from([127, 0, 0, 1]), self.port))
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for HostRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.host {
            HostPattern::Name(n) => write!(f, "{n}:{}", self.port),
            HostPattern::Under(d) => write!(f, "*{d}:{}", self.port),
            HostPattern::Address(IpAddr::V6(a)) => write!(f, "[{a}]:{}", self.port),
            HostPattern::Address(a) => write!(f, "{a}:{}", self.port),
        }
    }
}

/// What a client asked for.
#[derive(Clone, Debug, PartialEq)]
enum Target {
    Name(String),
    Address(IpAddr),
}

impl Target {
    fn parse(host: &str) -> Target {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match host.parse::<IpAddr>() {
            Ok(address) => Target::Address(address),
            Err(_) => Target::Name(host.trim_end_matches('.').to_ascii_lowercase()),
        }
    }
}

/// A connection the proxy refused: where to, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub host: String,
    pub port: u16,
    pub why: String,
}

/// The refusals of a kept sandbox's proxy since they were last taken (by the attempt that ends).
#[derive(Clone, Default)]
pub struct Refusals(Arc<Mutex<Vec<Refusal>>>);

/// How many refusals are kept until taken.
const REFUSALS_KEPT: usize = 256;

impl Refusals {
    fn push(&self, refusal: Refusal) {
        let mut list = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if list.len() < REFUSALS_KEPT {
            list.push(refusal);
        }
    }

    /// The refusals since the last take.
    pub fn take(&self) -> Vec<Refusal> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Serves an attempt's network: the proxy on `proxy`, each loopback rule's forwarder on its
/// listener, until the runtime ends or the listeners fail.
pub fn serve(
    proxy: std::net::TcpListener,
    forwards: Vec<(std::net::TcpListener, SocketAddr)>,
    rules: Arc<Vec<HostRule>>,
    refusals: Refusals,
) -> io::Result<()> {
    proxy.set_nonblocking(true)?;
    let proxy = TcpListener::from_std(proxy)?;
    let resolver = Arc::new(Resolver::from_env());
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = proxy.accept().await else {
                break;
            };
            let (rules, refusals, resolver) = (rules.clone(), refusals.clone(), resolver.clone());
            tokio::spawn(async move {
                let _ = proxied(client, &rules, &refusals, &resolver).await;
            });
        }
    });
    for (listener, to) in forwards {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    break;
                };
                tokio::spawn(async move {
                    if let Ok(mut upstream) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
            }
        });
    }
    Ok(())
}

/// One proxied connection: its request head read, checked, and either refused (`403`, told) or
/// connected and relayed.
async fn proxied(
    mut client: TcpStream,
    rules: &[HostRule],
    refusals: &Refusals,
    resolver: &Resolver,
) -> io::Result<()> {
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(head)) => head,
        _ => return Ok(()),
    };
    let Some(request) = Request::parse(&head) else {
        client
            .write_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await?;
        return Ok(());
    };
    let target = Target::parse(&request.host);
    let refuse = async |client: &mut TcpStream, why: String| -> io::Result<()> {
        refusals.push(Refusal {
            host: request.host.clone(),
            port: request.port,
            why: why.clone(),
        });
        let body = format!(
            "loopd's sandbox refused {}:{}: {why}\n",
            request.host, request.port
        );
        let response = format!(
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        client.write_all(response.as_bytes()).await
    };
    if !rules.iter().any(|r| r.allows(&target, request.port)) {
        return refuse(&mut client, "not in sandbox_network".to_owned()).await;
    }
    let address = match &target {
        Target::Address(address) => SocketAddr::new(*address, request.port),
        Target::Name(name) => match resolver.resolve(name, request.port).await {
            Some(address) => address,
            None => return refuse(&mut client, "its name does not resolve".to_owned()).await,
        },
    };
    let connected = tokio::time::timeout(HEAD_TIMEOUT, TcpStream::connect(address)).await;
    let mut upstream = match connected {
        Ok(Ok(upstream)) => upstream,
        _ => {
            client
                .write_all(
                    b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await?;
            return Ok(());
        }
    };
    match &request.forward {
        // CONNECT: the tunnel is the client's.
        None => {
            client
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await?;
            upstream.write_all(&head[request.head_len..]).await?;
        }
        // Plain HTTP: the request in origin form, one a connection.
        Some(rewritten) => {
            upstream.write_all(rewritten).await?;
            upstream.write_all(&head[request.head_len..]).await?;
        }
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    Ok(())
}

/// Reads until the end of a request head (`\r\n\r\n`), at most [`MAX_HEAD`]: what was read.
async fn read_head(client: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    loop {
        let n = client.read(&mut buf).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            return Err(io::ErrorKind::InvalidData.into());
        }
    }
}

/// A request to the proxy.
#[derive(Debug, PartialEq)]
struct Request {
    host: String,
    port: u16,
    /// The length of its head in what was read (what follows is its body, or the tunnel's).
    head_len: usize,
    /// For plain HTTP, its head in origin form, with `Connection: close`; `None` for CONNECT.
    forward: Option<Vec<u8>>,
}

impl Request {
    fn parse(read: &[u8]) -> Option<Request> {
        let end = read.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let head = std::str::from_utf8(&read[..end]).ok()?;
        let mut lines = head.split("\r\n");
        let mut first = lines.next()?.split(' ');
        let (method, target, version) = (first.next()?, first.next()?, first.next()?);
        if method == "CONNECT" {
            let (host, port) = split_host_port(target, None)?;
            return Some(Request {
                host,
                port,
                head_len: end,
                forward: None,
            });
        }
        // Absolute form only: `http://host[:port]/path` (a proxy is asked so).
        let rest = target.strip_prefix("http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let authority = authority.rsplit('@').next()?;
        let (host, port) = split_host_port(authority, Some(80))?;
        let mut forward = format!("{method} {path} {version}\r\n");
        for line in lines.filter(|l| !l.is_empty()) {
            let name = line
                .split(':')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            if !matches!(
                name.as_str(),
                "connection" | "proxy-connection" | "proxy-authorization" | "keep-alive"
            ) {
                forward.push_str(line);
                forward.push_str("\r\n");
            }
        }
        forward.push_str("Connection: close\r\n\r\n");
        Some(Request {
            host,
            port,
            head_len: end,
            forward: Some(forward.into_bytes()),
        })
    }
}

/// `host:port` (`[v6]:port`), or `host` alone with `default`.
fn split_host_port(text: &str, default: Option<u16>) -> Option<(String, u16)> {
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().ok()?,
            None => default?,
        };
        return Some((host.to_owned(), port));
    }
    match text.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => Some((host.to_owned(), port.parse().ok()?)),
        _ => Some((text.to_owned(), default?)),
    }
}

/// Brings the loopback interface of the calling process's network namespace up (a new one has
/// it down): called in a child between fork and exec, with system calls alone.
#[allow(unsafe_code)]
pub(super) fn loopback_up() -> io::Result<()> {
    use nix::libc;
    // SAFETY: a socket made and closed here; `ifreq` is a plain C struct, zeroed, its name set
    // within its bounds, passed to the two ioctls that read and set an interface's flags.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut request: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            request.ifr_name[i] = *b as libc::c_char;
        }
        let mut done = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut request);
        if done == 0 {
            request.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            done = libc::ioctl(fd, libc::SIOCSIFFLAGS, &request);
        }
        let error = io::Error::last_os_error();
        libc::close(fd);
        if done != 0 {
            return Err(error);
        }
    }
    Ok(())
}

/// The proxy's own resolver: the system's, or the hosts file `LOOPD_HOSTS_FILE` names (lines of
/// `ADDRESS NAME...`, as `/etc/hosts`), which tests point at their servers.
struct Resolver {
    hosts: Option<Vec<(IpAddr, Vec<String>)>>,
}

impl Resolver {
    fn from_env() -> Resolver {
        let hosts = std::env::var_os("LOOPD_HOSTS_FILE")
            .and_then(|path| std::fs::read_to_string(path).ok())
            .map(|text| {
                text.lines()
                    .filter_map(|line| {
                        let line = line.split('#').next()?;
                        let mut words = line.split_whitespace();
                        let address = words.next()?.parse().ok()?;
                        Some((address, words.map(str::to_ascii_lowercase).collect()))
                    })
                    .collect()
            });
        Resolver { hosts }
    }

    async fn resolve(&self, name: &str, port: u16) -> Option<SocketAddr> {
        if let Some(hosts) = &self.hosts {
            return hosts
                .iter()
                .find(|(_, names)| names.iter().any(|n| n == name))
                .map(|(address, _)| SocketAddr::new(*address, port));
        }
        tokio::net::lookup_host((name, port)).await.ok()?.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_are_parsed_and_allow_only_what_they_name() {
        let rule = |t: &str| HostRule::parse(t).unwrap();
        let name = |n: &str| Target::parse(n);
        assert!(rule("api.anthropic.com:443").allows(&name("API.anthropic.com"), 443));
        assert!(!rule("api.anthropic.com:443").allows(&name("api.anthropic.com"), 80));
        assert!(!rule("api.anthropic.com:443").allows(&name("evil.com"), 443));
        let under = rule("*.npmjs.org:443");
        assert!(under.allows(&name("registry.npmjs.org"), 443));
        assert!(!under.allows(&name("npmjs.org"), 443));
        assert!(!under.allows(&name("evilnpmjs.org"), 443));
        // An address is allowed only as an address, a name only as a name.
        assert!(rule("127.0.0.1:8080").allows(&name("127.0.0.1"), 8080));
        assert!(!rule("localhost:8080").allows(&name("127.0.0.1"), 8080));
        assert!(!rule("api.anthropic.com:443").allows(&name("160.79.104.10"), 443));
        assert!(rule("[::1]:8080").allows(&name("[::1]"), 8080));
        assert_eq!(rule("[::1]:8080").to_string(), "[::1]:8080");
        assert_eq!(rule("*.npmjs.org:443").to_string(), "*.npmjs.org:443");
        assert_eq!(
            rule("localhost:8080").loopback(),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(rule("example.com:80").loopback(), None);
        for bad in [
            "example.com",
            "example.com:0",
            "exa mple.com:80",
            "*.:443",
            ":443",
            "a..b:1",
        ] {
            assert!(HostRule::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn requests_are_read_in_connect_and_absolute_form() {
        let connect =
            Request::parse(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\nTLS").unwrap();
        assert_eq!(
            (connect.host.as_str(), connect.port),
            ("api.example.com", 443)
        );
        assert_eq!(connect.forward, None);
        let get = Request::parse(
            b"GET http://model.test:8080/v1/messages?x=1 HTTP/1.1\r\nHost: model.test:8080\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive\r\n\r\n{}",
        )
        .unwrap();
        assert_eq!((get.host.as_str(), get.port), ("model.test", 8080));
        let forward = String::from_utf8(get.forward.unwrap()).unwrap();
        assert_eq!(
            forward,
            "GET /v1/messages?x=1 HTTP/1.1\r\nHost: model.test:8080\r\nConnection: close\r\n\r\n"
        );
        let plain = Request::parse(b"GET http://example.com HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!((plain.host.as_str(), plain.port), ("example.com", 80));
        // Origin form is no request to a proxy.
        assert_eq!(Request::parse(b"GET / HTTP/1.1\r\n\r\n"), None);
    }
}
