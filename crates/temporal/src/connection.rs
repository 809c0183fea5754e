//! How loopd reaches a Temporal service: the address, namespace, TLS and API key from loopd's own
//! settings (`[temporal]`, the command line), with what they leave empty taken from the Temporal
//! CLI's environment variables and then its config profile, as the `temporal` CLI reads them; and
//! a failed connection told in one line that names what failed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use temporalio_client::envconfig::{
    ClientConfigProfile, DataSource, LoadClientConfigProfileOptions,
};
use temporalio_client::{ClientTlsOptions, ConnectionOptions, TlsOptions, Url};
use temporalio_common::envconfig::load_client_config_profile;

use crate::TemporalConfig;

/// The address of a dev server on this machine, when nothing names another.
pub const DEFAULT_ADDRESS: &str = "127.0.0.1:7233";
pub const DEFAULT_NAMESPACE: &str = "default";

/// Where and how to connect, every setting resolved.
pub struct Endpoint {
    /// As the user wrote it (`host:port`, or a URL): what messages name.
    pub address: String,
    pub namespace: String,
    url: Url,
    tls: Option<TlsOptions>,
    /// Never printed: [`Endpoint`] has no `Debug`.
    api_key: Option<String>,
    /// The profile's `grpc_meta` and `$TEMPORAL_GRPC_META_*`: headers sent with every call.
    headers: HashMap<String, String>,
}

impl Endpoint {
    /// Resolves `config` over the Temporal CLI's environment and profile.
    pub fn resolve(config: &TemporalConfig) -> Result<Endpoint> {
        Self::resolve_over(config, temporal_profile(config)?)
    }

    /// `config`'s settings where it has them, else `profile`'s (the environment over the file).
    fn resolve_over(config: &TemporalConfig, profile: ClientConfigProfile) -> Result<Endpoint> {
        let set = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        let address = set(&config.address)
            .or(profile.address)
            .unwrap_or_else(|| DEFAULT_ADDRESS.to_owned());
        let namespace = set(&config.namespace)
            .or(profile.namespace)
            .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
        let api_key = match set(&config.api_key_file) {
            Some(file) => Some(read_api_key(Path::new(&file))?),
            None => profile.api_key.filter(|k| !k.is_empty()),
        };
        let from_profile = profile.tls.unwrap_or_default();
        let source = |path: &str, profile: Option<DataSource>, what: &str| -> Result<_> {
            match set(path) {
                Some(path) => read_pem(Path::new(&path), what).map(Some),
                None => profile.map(|source| pem_of(source, what)).transpose(),
            }
        };
        let ca = source(&config.ca_cert, from_profile.server_ca_cert, "ca_cert")?;
        let cert = source(&config.client_cert, from_profile.client_cert, "client_cert")?;
        let key = source(&config.client_key, from_profile.client_key, "client_key")?;
        let server_name = set(&config.server_name).or(from_profile.server_name);
        let host = host_of(&address)?;
        let tls = config
            .tls
            .or(from_profile.disabled.map(|disabled| !disabled))
            .unwrap_or_else(|| {
                api_key.is_some()
                    || ca.is_some()
                    || cert.is_some()
                    || server_name.is_some()
                    || !is_loopback(&host)
            });
        let client = match (cert, key) {
            (Some(cert), Some(key)) => Some(
                ClientTlsOptions::builder()
                    .client_cert(cert)
                    .client_private_key(key)
                    .build(),
            ),
            (None, None) => None,
            _ => return Err(anyhow!("client_cert and client_key go together: give both")),
        };
        if !tls && (client.is_some() || ca.is_some()) {
            return Err(anyhow!(
                "tls = false, yet a CA or a client certificate is given: TLS is needed for them"
            ));
        }
        let url = url_of(&address, tls)?;
        Ok(Endpoint {
            address,
            namespace,
            url,
            tls: tls.then(|| {
                TlsOptions::builder()
                    .maybe_server_root_ca_cert(ca)
                    .maybe_domain(server_name)
                    .maybe_client_tls_options(client)
                    .build()
            }),
            api_key,
            headers: profile.grpc_meta,
        })
    }

    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    fn client_certificate(&self) -> bool {
        self.tls
            .as_ref()
            .is_some_and(|t| t.client_tls_options.is_some())
    }

    /// The SDK's options for this endpoint.
    pub fn options(&self, identity: String, timeout: std::time::Duration) -> ConnectionOptions {
        ConnectionOptions::new(self.url.clone())
            .identity(identity)
            .connect_timeout(timeout)
            .maybe_tls_options(self.tls.clone())
            .maybe_api_key(self.api_key.clone())
            .maybe_headers((!self.headers.is_empty()).then(|| self.headers.clone()))
            .build()
    }

    /// What a failed connection or first call means, in one line that says what to change;
    /// `error` is the SDK's, with its causes.
    /// Whether a failure to connect may pass by itself: nothing listens yet, or the server
    /// answers that it is not ready (a server that is starting).
    pub fn may_pass(error: &(dyn std::error::Error + 'static)) -> bool {
        let chain = chain_of(error);
        [
            "connection refused",
            "code: unavailable",
            "status: unavailable",
        ]
        .iter()
        .any(|n| chain.contains(n))
    }

    pub fn explain(&self, error: &(dyn std::error::Error + 'static)) -> anyhow::Error {
        let at = &self.address;
        let chain = chain_of(error);
        let has = |needle: &str| chain.contains(&needle.to_lowercase());
        let closed = || {
            [
                "BrokenPipe",
                "broken pipe",
                "ConnectionReset",
                "connection reset",
                "connection closed",
                "UnexpectedEof",
                // hyper's word when the connection ended before the request could go out
                "connection was not ready",
            ]
            .iter()
            .any(|n| has(n))
        };
        let why = if has("UnknownIssuer") || has("unknown issuer") {
            "the server's certificate is not trusted (unknown issuer): give the CA that signed \
             it as ca_cert (--tls-ca-path, $TEMPORAL_TLS_SERVER_CA_CERT_PATH)"
                .to_owned()
        } else if has("NotValidForName") || has("not valid for name") {
            format!(
                "the server's certificate is not for {:?}: set server_name to the name it \
                 carries (--tls-server-name)",
                self.url.host_str().unwrap_or_default()
            )
        } else if has("CertificateRequired") || has("certificate required") {
            "the server asks for a client certificate: give client_cert and client_key \
             (--tls-cert-path, --tls-key-path)"
                .to_owned()
        } else if has("BadCertificate") || has("UnknownCA") || has("DecryptError") {
            "the server refused the client certificate (not signed by a CA it trusts)".to_owned()
        } else if self.tls() && !self.client_certificate() && closed() {
            // TLS 1.3 servers check the client's certificate after the handshake, and many
            // just close the connection when there is none.
            "the server closed the connection after the TLS handshake: it asks for a client \
             certificate, it seems: give client_cert and client_key (--tls-cert-path, \
             --tls-key-path)"
                .to_owned()
        } else if has("Unauthenticated") || has("PermissionDenied") {
            match &self.api_key {
                Some(_) => "the server refused the API key".to_owned(),
                None => "the server wants credentials: an API key (api_key_file, \
                         $TEMPORAL_API_KEY) or a client certificate"
                    .to_owned(),
            }
        } else if self.tls() && (has("InvalidContentType") || has("CorruptMessage")) {
            "the server does not speak TLS: set tls = false (--no-tls, TEMPORAL_TLS=false)"
                .to_owned()
        } else if !self.tls() && (closed() || has("frame with invalid size")) {
            "the server closed a plaintext connection: if it speaks TLS, set tls = true \
             (--tls, TEMPORAL_TLS=true)"
                .to_owned()
        } else if has("Connection refused") || has("ConnectionRefused") {
            "nothing listens there (connection refused)".to_owned()
        } else if has("dns error") || has("failed to lookup") {
            "its host name does not resolve".to_owned()
        } else if has("timed out") || has("Elapsed") {
            "no answer within the connect timeout".to_owned()
        } else if has("code: unavailable") || has("status: unavailable") {
            "the server is not ready (it answers \"unavailable\"; is it still starting?)".to_owned()
        } else {
            plain_words(&format!("{error}"))
        };
        anyhow!("cannot connect to Temporal at {at}: {why}")
    }
}

/// The whole chain of `error`, its words and its debug form, in lower case, to look in.
fn chain_of(error: &(dyn std::error::Error + 'static)) -> String {
    let mut chain = String::new();
    let mut next = Some(error);
    while let Some(e) = next {
        chain.push_str(&format!("{e} {e:?} "));
        next = e.source();
    }
    chain.to_lowercase()
}

/// An error's text for a person, on one line: a gRPC status said in words rather than dumped.
pub fn plain_words(text: &str) -> String {
    loopd_exec::result::one_line(&loopd_exec::result::without_dumps(text))
}

/// The Temporal CLI's profile: its config file's (the profile `config` names, else
/// `$TEMPORAL_PROFILE`'s, else `default`), with the environment's settings over it.
fn temporal_profile(config: &TemporalConfig) -> Result<ClientConfigProfile> {
    let options = LoadClientConfigProfileOptions::builder()
        .maybe_config_file_profile((!config.profile.is_empty()).then(|| config.profile.clone()))
        .build();
    load_client_config_profile(options, None)
        .map_err(|e| anyhow!("the Temporal CLI's profile: {e}"))
}

fn read_api_key(file: &Path) -> Result<String> {
    let key = loopd_fs::read_text(file)
        .with_context(|| format!("cannot read api_key_file {}", file.display()))?;
    let key = key.trim();
    if key.is_empty() {
        return Err(anyhow!("api_key_file {} is empty", file.display()));
    }
    Ok(key.to_owned())
}

fn read_pem(file: &Path, what: &str) -> Result<Vec<u8>> {
    let pem = loopd_fs::read_user_file(file, loopd_fs::USER_FILE_CAP)
        .with_context(|| format!("cannot read {what} {}", file.display()))?;
    if !pem.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(anyhow!("{what} {} is not a PEM file", file.display()));
    }
    Ok(pem)
}

fn pem_of(source: DataSource, what: &str) -> Result<Vec<u8>> {
    match source {
        DataSource::Path(path) => read_pem(Path::new(&path), what),
        DataSource::Data(data) => Ok(data),
        _ => Err(anyhow!(
            "the profile's {what}: a source loopd does not know"
        )),
    }
}

/// `address` as a URL: kept when it is one, else `host:port` under the scheme TLS asks for.
fn url_of(address: &str, tls: bool) -> Result<Url> {
    let scheme = if tls { "https" } else { "http" };
    let url = match Url::parse(address) {
        Ok(url) if url.host().is_some() && matches!(url.scheme(), "http" | "https") => {
            let mut url = url;
            url.set_scheme(scheme)
                .map_err(|()| anyhow!("bad Temporal address {address:?}"))?;
            url
        }
        _ => Url::parse(&format!("{scheme}://{address}"))
            .with_context(|| format!("bad Temporal address {address:?}"))?,
    };
    if url.host().is_none() {
        return Err(anyhow!("bad Temporal address {address:?}: no host"));
    }
    Ok(url)
}

fn host_of(address: &str) -> Result<String> {
    let url = url_of(address, false)?;
    Ok(url
        .host_str()
        .unwrap_or_default()
        .trim_matches(['[', ']'])
        .to_owned())
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;
    use temporalio_client::envconfig::ClientConfigProfile;
    use temporalio_common::envconfig::ClientConfigTLS;

    fn config(address: &str) -> TemporalConfig {
        TemporalConfig {
            address: address.into(),
            ..Default::default()
        }
    }

    fn resolve(config: &TemporalConfig, profile: ClientConfigProfile) -> Endpoint {
        Endpoint::resolve_over(config, profile).expect("resolves")
    }

    #[test]
    fn tls_is_on_away_from_loopback_and_off_on_it() {
        let none = ClientConfigProfile::default;
        let local = resolve(&config("127.0.0.1:7233"), none());
        assert!(!local.tls());
        assert_eq!(local.url.as_str(), "http://127.0.0.1:7233/");
        assert!(!resolve(&config("localhost:7233"), none()).tls());
        assert!(!resolve(&config("[::1]:7233"), none()).tls());
        let cloud = resolve(&config("ns.acct.tmprl.cloud:7233"), none());
        assert!(cloud.tls());
        assert_eq!(cloud.url.as_str(), "https://ns.acct.tmprl.cloud:7233/");
        let plain = TemporalConfig {
            tls: Some(false),
            ..config("temporal.internal:7233")
        };
        assert!(!resolve(&plain, none()).tls());
        let asked = TemporalConfig {
            tls: Some(true),
            ..config("127.0.0.1:7233")
        };
        assert!(resolve(&asked, none()).tls());
    }

    #[test]
    fn loopds_settings_come_first_then_the_profile_then_the_defaults() {
        let profile = ClientConfigProfile::builder()
            .address("from-profile:7233")
            .namespace("prof-ns")
            .api_key("KEY")
            .build();
        let from_profile = resolve(&TemporalConfig::default(), profile.clone());
        assert_eq!(from_profile.address, "from-profile:7233");
        assert_eq!(from_profile.namespace, "prof-ns");
        assert_eq!(from_profile.api_key.as_deref(), Some("KEY"));
        assert!(from_profile.tls(), "an API key never travels in plaintext");
        let own = TemporalConfig {
            namespace: "mine".into(),
            ..config("127.0.0.1:1234")
        };
        let over = resolve(&own, profile);
        assert_eq!(
            (over.address.as_str(), over.namespace.as_str()),
            ("127.0.0.1:1234", "mine")
        );
        let bare = resolve(&TemporalConfig::default(), ClientConfigProfile::default());
        assert_eq!(
            (bare.address.as_str(), bare.namespace.as_str()),
            (DEFAULT_ADDRESS, DEFAULT_NAMESPACE)
        );
        let disabled = ClientConfigProfile::builder()
            .tls(ClientConfigTLS::builder().disabled(true).build())
            .build();
        assert!(!resolve(&config("temporal.internal:7233"), disabled).tls());
    }

    #[test]
    fn a_half_pair_or_a_missing_file_is_one_clear_error() {
        let dir = tempfile::tempdir().expect("a directory");
        let cert = dir.path().join("c.pem");
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\n").expect("write");
        let half = TemporalConfig {
            client_cert: cert.display().to_string(),
            ..config("127.0.0.1:7233")
        };
        let e = Endpoint::resolve_over(&half, ClientConfigProfile::default())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("client_cert and client_key"), "{e}");
        let missing = TemporalConfig {
            ca_cert: dir.path().join("nope.pem").display().to_string(),
            ..config("127.0.0.1:7233")
        };
        let e = Endpoint::resolve_over(&missing, ClientConfigProfile::default())
            .err()
            .expect("refused");
        assert!(format!("{e:#}").contains("cannot read ca_cert"), "{e:#}");
        let key = dir.path().join("key");
        std::fs::write(&key, "  secret-key\n").expect("write");
        let keyed = TemporalConfig {
            api_key_file: key.display().to_string(),
            ..config("127.0.0.1:7233")
        };
        let endpoint = resolve(&keyed, ClientConfigProfile::default());
        assert_eq!(endpoint.api_key.as_deref(), Some("secret-key"));
        assert!(endpoint.tls());
    }

    #[test]
    fn a_grpc_status_is_said_in_words_and_a_starting_server_is_waited_for() {
        let dump = "`get_system_info` call error after connection: Status { code: Internal, \
                    message: \"boom\", source: None }";
        let said = plain_words(dump);
        assert_eq!(
            said,
            "`get_system_info` call error after connection: the server answered internal (boom)"
        );
        assert!(!said.contains("Status {"));
        let starting = std::io::Error::other(
            "`get_system_info` call error after connection: Status { code: Unavailable, \
             message: \"not ready\", source: None }",
        );
        assert!(Endpoint::may_pass(&starting));
        let plain = resolve(&config("127.0.0.1:7233"), ClientConfigProfile::default());
        let said = plain.explain(&starting).to_string();
        assert!(said.contains("not ready"), "{said}");
        assert!(!said.contains("Status {"), "{said}");
        assert!(!Endpoint::may_pass(&std::io::Error::other(
            "invalid certificate"
        )));
    }

    #[test]
    fn each_way_a_connection_is_hung_up_on_reads_as_closed() {
        // What the SDK said when the server closed the connection in the handshake, on the
        // first write, or between the handshake and the first call (a CI run's own words).
        let forms = [
            "transport error: Connection reset by peer (os error 104)",
            "transport error: Broken pipe (os error 32)",
            "`get_system_info` call error after connection: Status { code: Cancelled, message: \
             \"operation was canceled\", source: Some(tonic::transport::Error(Transport, \
             hyper::Error(Canceled, \"connection was not ready\"))) }",
        ];
        let tls = resolve(
            &TemporalConfig {
                tls: Some(true),
                ..config("127.0.0.1:7233")
            },
            ClientConfigProfile::default(),
        );
        let plain = resolve(&config("127.0.0.1:7233"), ClientConfigProfile::default());
        for form in forms {
            let error = std::io::Error::other(form);
            let said = tls.explain(&error).to_string();
            assert!(
                said.contains("asks for a client certificate"),
                "{form}: {said}"
            );
            let said = plain.explain(&error).to_string();
            assert!(
                said.contains("if it speaks TLS, set tls = true"),
                "{form}: {said}"
            );
        }
    }
}
