//! A real HTTP client (hyper) for the service's API: over its Unix socket, or over TCP with the
//! token.

use std::path::Path;

use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use serde_json::Value;

/// Where a request goes: the Unix socket, or TCP with a token (or none).
pub enum To<'a> {
    Socket(&'a Path),
    Tcp(&'a str, Option<&'a str>),
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Sends a request and returns the response, its body still to read.
pub async fn send(
    to: &To<'_>,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> hyper::Response<hyper::body::Incoming> {
    let mut request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "loopd");
    if body.is_some() {
        request = request.header("content-type", "application/json");
    }
    if let To::Tcp(_, Some(token)) = to {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(Full::new(Bytes::from(body.unwrap_or("").to_owned())))
        .expect("request");
    macro_rules! over {
        ($stream:expr) => {{
            let io = hyper_util::rt::TokioIo::new($stream);
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .expect("handshake");
            tokio::spawn(conn);
            sender.send_request(request).await.expect("send")
        }};
    }
    match to {
        To::Socket(path) => over!(
            tokio::net::UnixStream::connect(path)
                .await
                .expect("connect")
        ),
        To::Tcp(addr, _) => over!(tokio::net::TcpStream::connect(addr).await.expect("connect")),
    }
}

/// A whole request: its status and its body as JSON.
pub fn call(to: &To<'_>, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let body = body.map(|b| b.to_string());
    let (status, text) = fetch(to, method, path, body.as_deref(), &[]);
    let value =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("{method} {path}: not JSON: {text}"));
    (status, value)
}

/// A whole request: its status and its body as text (a stream read until it ends).
pub fn fetch(
    to: &To<'_>,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (u16, String) {
    runtime().block_on(async {
        let response = send(to, method, path, body, headers).await;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    })
}
