//! The page, embedded in the binary, and the OpenAPI document.

use axum::http::header;
use axum::response::{IntoResponse, Response};

/// The OpenAPI document of this API, kept in the repository beside this file.
pub const OPENAPI: &str = include_str!("../openapi.json");

/// The dashboard, embedded in the binary.
pub(super) const INDEX: &str = include_str!("../web/index.html");
pub(super) const APP_JS: &str = include_str!("../web/app.js");
pub(super) const APP_CSS: &str = include_str!("../web/app.css");

pub(super) fn page(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; frame-ancestors 'none'",
            ),
        ],
        body,
    )
        .into_response()
}

pub(super) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}
