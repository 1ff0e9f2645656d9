//! TLS for the native listeners (`gateway/transports.py` is the reference): a server
//! configuration built from the `--tls-cert`/`--tls-key`/`--tls-ca` files, rebuilt when
//! they change on disk, and the identity a verified client certificate stands for
//! (`--tls-username-from cn|san`).
//!
//! The same promises as Python's `ReloadingContext`: the files are looked at (mtime,
//! size, inode) on each new connection, so a renewed certificate is used without a
//! restart while open connections keep theirs; a file that does not load (half
//! written, a key that is not the certificate's) keeps the old configuration, and says
//! so once per change. TLS 1.2 and 1.3 only, AEAD suites with ephemeral keys only
//! (rustls's ring suites: a strict subset of what Python's default context offers,
//! which also has CBC and finite-field DHE suites); client certificates are checked
//! against `--tls-ca` alone, never the system's store.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

/// Ciphertext (and plaintext waiting to be encrypted) rustls may hold for one
/// connection; past it a write takes nothing more until the socket took some.
pub const BUFFER_LIMIT: usize = 64 * 1024;

/// `--tls-client-auth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    None,
    Optional,
    Required,
}

impl ClientAuth {
    pub fn parse(word: &str) -> Result<ClientAuth, String> {
        match word {
            "none" => Ok(ClientAuth::None),
            "optional" => Ok(ClientAuth::Optional),
            "required" => Ok(ClientAuth::Required),
            _ => Err(format!(
                "TLS client auth must be none, optional or required, not {word:?}"
            )),
        }
    }
}

/// `--tls-username-from`: what of a verified client certificate names its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsernameFrom {
    None,
    Cn,
    San,
}

impl UsernameFrom {
    pub fn parse(word: &str) -> Result<UsernameFrom, String> {
        match word {
            "none" => Ok(UsernameFrom::None),
            "cn" => Ok(UsernameFrom::Cn),
            "san" => Ok(UsernameFrom::San),
            _ => Err(format!(
                "TLS username source must be none, cn or san, not {word:?}"
            )),
        }
    }
}

/// The files and choices a listener's TLS is made of.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    pub username_from: UsernameFrom,
}

impl TlsSettings {
    /// The files the configuration is read from: the CA only when it is used.
    fn files(&self) -> Vec<&Path> {
        let mut files = vec![self.cert.as_path(), self.key.as_path()];
        if self.client_auth != ClientAuth::None {
            if let Some(ca) = &self.ca {
                files.push(ca.as_path());
            }
        }
        files
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// A server configuration from the files, or why they do not make one.
pub fn build(s: &TlsSettings) -> Result<Arc<ServerConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(&s.cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", s.cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", s.cert.display()));
    }
    let key = PrivateKeyDer::from_pem_slice(&read(&s.key)?)
        .map_err(|e| format!("{}: no private key in it ({e})", s.key.display()))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| e.to_string())?;
    let builder = match s.client_auth {
        ClientAuth::None => builder.with_no_client_auth(),
        auth => {
            // Never the system's store: any public certificate would then log in.
            let Some(ca) = &s.ca else {
                return Err(format!(
                    "TLS client auth {:?} needs a CA file (--tls-ca)",
                    if auth == ClientAuth::Optional {
                        "optional"
                    } else {
                        "required"
                    }
                ));
            };
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read(ca)?) {
                let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
                roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("{}: no CA certificate in it", ca.display()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if auth == ClientAuth::Optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| e.to_string())?)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(config))
}

/// (mtime in ns, size, inode) of each file, None for one that cannot be stat'ed: an
/// atomic rename and a rewrite in place both show.
type Signature = Vec<Option<(i128, u64, u64)>>;

fn signature(s: &TlsSettings) -> Signature {
    s.files()
        .into_iter()
        .map(|p| {
            fs::metadata(p).ok().map(|m| {
                (
                    i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
                    m.size(),
                    m.ino(),
                )
            })
        })
        .collect()
}

/// What a reload has to say, for the owner's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The files changed and made a new configuration (INFO).
    Reloaded(String),
    /// The files changed and did not load: the old one stays (ERROR).
    Failed(String),
}

/// The current server configuration, rebuilt when its files change.
pub struct TlsFiles {
    pub settings: TlsSettings,
    signature: Signature,
    config: Arc<ServerConfig>,
}

impl TlsFiles {
    /// Load the files; a bad file at start is the caller's error.
    pub fn load(settings: TlsSettings) -> Result<TlsFiles, String> {
        let signature = signature(&settings);
        let config = build(&settings)?;
        Ok(TlsFiles {
            settings,
            signature,
            config,
        })
    }

    /// The configuration for a new connection, rebuilt first if a file changed; and
    /// what to log about it (once per change, not per connection).
    pub fn current(&mut self) -> (Arc<ServerConfig>, Option<Reload>) {
        let now = signature(&self.settings);
        if now == self.signature {
            return (Arc::clone(&self.config), None);
        }
        self.signature = now;
        let said = match build(&self.settings) {
            Ok(config) => {
                self.config = config;
                Reload::Reloaded(format!(
                    "reloaded TLS certificate from {}",
                    self.settings.cert.display()
                ))
            }
            Err(e) => Reload::Failed(format!(
                "TLS certificate {} did not load, keeping the previous one: {e}",
                self.settings.cert.display()
            )),
        };
        (Arc::clone(&self.config), Some(said))
    }
}

/// The username a verified client certificate (DER) stands for: its first commonName
/// (`Cn`) or its first DNS or email subjectAltName (`San`); None if it has none, or
/// for `None`. As `transports.cert_identity`: only a verified certificate is ever
/// given here (rustls hands out the peer's certificates only once they verified).
pub fn identity(der: &[u8], from: UsernameFrom) -> Option<String> {
    use x509_parser::extensions::GeneralName;
    if from == UsernameFrom::None {
        return None;
    }
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    match from {
        UsernameFrom::None => None,
        UsernameFrom::Cn => cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok())
            .find(|v| !v.is_empty())
            .map(str::to_owned),
        UsernameFrom::San => {
            let san = cert.subject_alternative_name().ok()??;
            san.value.general_names.iter().find_map(|name| match name {
                GeneralName::DNSName(v) | GeneralName::RFC822Name(v) if !v.is_empty() => {
                    Some((*v).to_owned())
                }
                _ => None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/tls")
            .join(name)
    }

    fn settings(dir: &Path, auth: ClientAuth) -> TlsSettings {
        TlsSettings {
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            ca: Some(dir.join("ca.pem")),
            client_auth: auth,
            username_from: UsernameFrom::None,
        }
    }

    fn copy(from: &str, to: &Path) {
        fs::copy(fixture(from), to).unwrap();
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lg-tls-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        for f in ["server.pem", "server.key", "ca.pem"] {
            copy(f, &dir.join(f));
        }
        dir
    }

    #[test]
    fn the_files_load_in_every_client_auth_mode() {
        let dir = scratch("modes");
        for auth in [ClientAuth::None, ClientAuth::Optional, ClientAuth::Required] {
            assert!(build(&settings(&dir, auth)).is_ok(), "{auth:?}");
        }
        let mut no_ca = settings(&dir, ClientAuth::Required);
        no_ca.ca = None;
        assert!(build(&no_ca).unwrap_err().contains("needs a CA file"));
        // Without client auth the CA is neither needed nor read.
        no_ca.client_auth = ClientAuth::None;
        assert!(build(&no_ca).is_ok());
    }

    #[test]
    fn a_key_that_is_not_the_certificates_does_not_load() {
        let dir = scratch("mismatch");
        copy("other-server.key", &dir.join("server.key"));
        assert!(build(&settings(&dir, ClientAuth::None)).is_err());
        let mut key_as_cert = settings(&dir, ClientAuth::None);
        key_as_cert.cert = dir.join("server.key");
        assert!(build(&key_as_cert)
            .unwrap_err()
            .contains("no certificate in it"));
    }

    #[test]
    fn a_rename_or_a_rewrite_reloads_and_a_bad_file_keeps_the_old_one() {
        let dir = scratch("reload");
        let mut files = TlsFiles::load(settings(&dir, ClientAuth::Required)).unwrap();
        let first = files.current().0;
        assert!(files.current().1.is_none(), "nothing changed: no reload");
        // Half written: the old configuration stays, said once.
        fs::write(
            dir.join("server.pem"),
            b"-----BEGIN CERTIFICATE-----\nbroken\n",
        )
        .unwrap();
        let (kept, said) = files.current();
        assert!(Arc::ptr_eq(&kept, &first));
        assert!(matches!(said, Some(Reload::Failed(t)) if t.contains("keeping the previous")));
        assert!(
            files.current().1.is_none(),
            "one error per change, not per connection"
        );
        // A renewal by rename (a temporary file, then a rename): a new one.
        let tmp = dir.join("new.tmp");
        fs::copy(fixture("other-server.pem"), &tmp).unwrap();
        fs::rename(&tmp, dir.join("server.pem")).unwrap();
        let tmp = dir.join("new.tmp");
        fs::copy(fixture("other-server.key"), &tmp).unwrap();
        fs::rename(&tmp, dir.join("server.key")).unwrap();
        let (renewed, said) = files.current();
        assert!(!Arc::ptr_eq(&renewed, &first));
        assert!(matches!(said, Some(Reload::Reloaded(_))));
        // A rewrite in place (same inode), back to the first pair.
        fs::write(
            dir.join("server.key"),
            fs::read(fixture("server.key")).unwrap(),
        )
        .unwrap();
        fs::write(
            dir.join("server.pem"),
            fs::read(fixture("server.pem")).unwrap(),
        )
        .unwrap();
        let (again, said) = files.current();
        assert!(!Arc::ptr_eq(&again, &renewed));
        assert!(matches!(said, Some(Reload::Reloaded(_))), "{said:?}");
        // The CA file is watched too when client certificates are asked for.
        fs::write(dir.join("ca.pem"), b"garbage").unwrap();
        assert!(matches!(files.current().1, Some(Reload::Failed(_))));
    }

    fn der(name: &str) -> Vec<u8> {
        CertificateDer::from_pem_file(fixture(name))
            .unwrap()
            .as_ref()
            .to_vec()
    }

    #[test]
    fn identity_from_cn_or_san() {
        let client = der("client.pem");
        assert_eq!(
            identity(&client, UsernameFrom::Cn).as_deref(),
            Some("device-1")
        );
        assert_eq!(
            identity(&client, UsernameFrom::San).as_deref(),
            Some("sensor-9.devices.example")
        );
        assert_eq!(identity(&client, UsernameFrom::None), None);
        assert_eq!(identity(b"not a certificate", UsernameFrom::Cn), None);
    }
}
