//! Who may call: the bearer token of every request (or the page's session cookie), compared in
//! constant time.

use std::sync::Arc;

use anyhow::{Context as _, Result};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::shared::ApiError;

/// 32 random bytes from the kernel, in hex.
pub(super) fn new_token() -> Result<String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot make a token")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The cookie a browser logged in with the token holds.
pub(super) const SESSION_COOKIE: &str = "loopd_token";
/// The header every state-changing request of the dashboard sends: a cross-site form cannot.
pub(super) const REQUEST_HEADER: &str = "x-loopd-request";

/// Every request over TCP shows the token: `Authorization: Bearer TOKEN`, or the session cookie
/// a browser got from the login link (`/?token=TOKEN`, which sets it and leaves the token out of
/// the address). A request on the cookie that changes anything must also carry
/// `X-Loopd-Request`, which no cross-site form or image can send.
pub(super) async fn require_token(
    State(token): State<Arc<str>>,
    request: Request,
    next: Next,
) -> Response {
    let valid = |given: &str| same(given.as_bytes(), token.as_bytes());
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer.is_some_and(valid) {
        return next.run(request).await;
    }
    let login = request
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("token=")));
    if request.uri().path() == "/" && login.is_some_and(valid) {
        let cookie = format!("{SESSION_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/");
        return (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, "/"),
                (header::SET_COOKIE, cookie.as_str()),
            ],
        )
            .into_response();
    }
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='));
    if cookie.is_some_and(valid) {
        let safe = matches!(
            *request.method(),
            axum::http::Method::GET | axum::http::Method::HEAD
        );
        if safe || headers.contains_key(REQUEST_HEADER) {
            return next.run(request).await;
        }
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "a change from the dashboard must carry X-Loopd-Request (cross-site requests are refused)",
        )
        .into_response();
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "a token is required: open the login link the service printed (http://ADDR/?token=...), \
         or send Authorization: Bearer TOKEN",
    )
    .into_response()
}

/// Compares in time that does not depend on where the two differ.
pub(super) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}
