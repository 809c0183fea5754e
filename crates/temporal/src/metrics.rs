//! A worker's metrics endpoint (`loopd worker --metrics ADDR`): the Temporal SDK's worker
//! metrics (`temporal_*`, its Prometheus exporter) and loopd's own ([`loopd_exec::metrics`]) in
//! one scrape.
//!
//! The SDK's exporter serves its registry on a listener of its own and offers no way to read it
//! otherwise, so it listens on a port of loopback that only this process knows, and each scrape
//! of ADDR reads it there and serves it after loopd's own metrics.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use temporalio_common::telemetry::metrics::CoreMeter;
use temporalio_common::telemetry::{PrometheusExporterOptions, start_prometheus_metric_exporter};

/// How long a scrape waits for the SDK's exporter.
const SDK_TIMEOUT: Duration = Duration::from_secs(2);

/// The endpoint, bound; [`Exporter::serve`] serves it.
pub struct Exporter {
    listener: tokio::net::TcpListener,
    /// Where the SDK's exporter listens.
    sdk: SocketAddr,
    /// The meter the worker's runtime records the SDK's metrics with.
    pub meter: Arc<dyn CoreMeter>,
}

impl Exporter {
    /// Binds `addr` and starts the SDK's exporter on loopback; in a Tokio runtime.
    pub async fn bind(addr: SocketAddr) -> Result<Exporter> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for metrics on {addr}"))?;
        let options = PrometheusExporterOptions::builder()
            .socket_addr(SocketAddr::from(([127, 0, 0, 1], 0)))
            // Prometheus' conventions: counters end in `_total`, durations are seconds.
            .counters_total_suffix(true)
            .use_seconds_for_durations(true)
            .unit_suffix(true)
            .build();
        let sdk = start_prometheus_metric_exporter(options)
            .map_err(|e| anyhow!("cannot start the Temporal SDK's metrics exporter: {e}"))?;
        Ok(Exporter {
            listener,
            sdk: sdk.bound_addr,
            meter: sdk.meter,
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves `GET /metrics` until the process ends.
    pub async fn serve(self) -> Result<()> {
        let sdk = self.sdk;
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || async move {
                let ours = loopd_exec::metrics::metrics().encode();
                let theirs = tokio::task::spawn_blocking(move || read_sdk(sdk)).await;
                match theirs {
                    Ok(Ok(theirs)) => (
                        [(header::CONTENT_TYPE, loopd_exec::metrics::CONTENT_TYPE)],
                        ours + &theirs,
                    )
                        .into_response(),
                    Ok(Err(e)) => {
                        tracing::warn!("metrics: {e:#}");
                        (StatusCode::BAD_GATEWAY, format!("{e:#}\n")).into_response()
                    }
                    Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
                }
            }),
        );
        axum::serve(self.listener, app)
            .await
            .context("the metrics endpoint stopped")
    }
}

/// The SDK exporter's text.
fn read_sdk(at: SocketAddr) -> Result<String> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(SDK_TIMEOUT))
        .build()
        .new_agent();
    agent
        .get(&format!("http://{at}/metrics"))
        .call()
        .and_then(|mut r| r.body_mut().read_to_string())
        .context("cannot read the Temporal SDK's metrics")
}
