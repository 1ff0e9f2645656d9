//! The native TLS listener over loopback, with rustls clients: the handshake (and the
//! client certificate's identity), the relay both ways whatever the records' sizes, an
//! end with or without close_notify, a silent client closed at the deadline, plain
//! bytes on the TLS port refused, the cap on handshakes in flight, and hostile bytes
//! into the handshake (no panic, nothing left held).

#[path = "common/links.rs"]
mod links;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lightgate_native::reactor::{Command, Counters, Listener, LogTarget, Reactor};
use lightgate_native::tls::{ClientAuth, TlsFiles, TlsSettings, UsernameFrom};
use links::Collect;
use proptest::prelude::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/tls")
        .join(name)
}

struct Server {
    reactor: Option<Reactor>,
    sink: Arc<Collect>,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.reactor.take() {
            r.stop();
        }
    }
}

impl Server {
    fn start(auth: ClientAuth, from: UsernameFrom, timeout: f64, max_handshakes: usize) -> Server {
        let sink = Arc::new(Collect::default());
        let reactor = Reactor::start(2, sink.clone()).unwrap();
        let files = TlsFiles::load(TlsSettings {
            cert: fixture("server.pem"),
            key: fixture("server.key"),
            ca: Some(fixture("ca.pem")),
            client_auth: auth,
            username_from: from,
        })
        .unwrap();
        let socket = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let listener = Listener::new(
            0,
            "MQTT over TLS".into(),
            socket,
            Arc::new(Mutex::new(files)),
            usize::MAX,
            timeout,
        )
        .unwrap();
        reactor
            .handle()
            .links()
            .max_handshakes
            .store(max_handshakes, Ordering::SeqCst);
        reactor.send(Command::Listen(Box::new(listener)));
        Server {
            reactor: Some(reactor),
            sink,
            port,
        }
    }

    fn counters(&self) -> &Counters {
        self.reactor.as_ref().unwrap().handle_ref().counters()
    }

    fn send(&self, conn: u64, data: &[u8]) {
        self.reactor.as_ref().unwrap().send(Command::Send {
            conn,
            data: data.to_vec(),
        });
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }
}

fn client_config(with_cert: bool) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(fixture("ca.pem")).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(if with_cert {
        builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_file(fixture("client.pem")).unwrap()],
                PrivateKeyDer::from_pem_file(fixture("client.key")).unwrap(),
            )
            .unwrap()
    } else {
        builder.with_no_client_auth()
    })
}

type TlsClient = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

fn tls_client(server: &Server, with_cert: bool) -> TlsClient {
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(client_config(with_cert), name).unwrap();
    let mut s = rustls::StreamOwned::new(conn, server.connect());
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).unwrap();
    }
    s
}

#[test]
fn a_handshake_then_bytes_both_ways_and_an_end_with_close_notify() {
    let server = Server::start(ClientAuth::Required, UsernameFrom::Cn, 10.0, 64);
    let mut client = tls_client(&server, true);
    client.write_all(b"hello over tls").unwrap();
    client.flush().unwrap();
    let (conn, identity) = server.sink.opened();
    assert_eq!(identity.as_deref(), Some("device-1"));
    assert_eq!(server.sink.data(conn, 14), b"hello over tls");
    server.send(conn, b"and back");
    let mut got = [0u8; 8];
    client.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"and back");
    client.conn.send_close_notify();
    client.flush().unwrap();
    assert_eq!(
        server.sink.ended(conn),
        (true, "connection closed by the client".into())
    );
    assert_eq!(server.counters().tls_handshakes.load(Ordering::SeqCst), 1);
}

#[test]
fn records_split_at_every_byte_and_an_end_without_close_notify() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 10.0, 64);
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = rustls::ClientConnection::new(client_config(false), name).unwrap();
    let mut sock = server.connect();
    let payload: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
    tls.writer().write_all(&payload).unwrap(); // sent once the handshake is done
                                               // Every byte of every record the client writes goes in a write of its own.
    while tls.is_handshaking() || tls.wants_write() {
        let mut wire = Vec::new();
        while tls.wants_write() {
            tls.write_tls(&mut wire).unwrap();
        }
        for b in &wire {
            sock.write_all(&[*b]).unwrap();
        }
        if tls.is_handshaking() {
            tls.read_tls(&mut sock).unwrap();
            tls.process_new_packets().unwrap();
        }
    }
    let (conn, identity) = server.sink.opened();
    assert_eq!(identity, None, "no client certificate asked for");
    assert_eq!(server.sink.data(conn, payload.len()), payload);
    // TCP closed, no close_notify: an end all the same (a FIN: the session tickets the
    // server sent after the handshake are unread here, and a close would be a reset).
    sock.shutdown(std::net::Shutdown::Write).unwrap();
    let (eof, why) = server.sink.ended(conn);
    assert!(eof, "{why}");
}

#[test]
fn a_client_without_the_certificate_required_is_refused() {
    let server = Server::start(ClientAuth::Required, UsernameFrom::Cn, 10.0, 64);
    let name = ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(client_config(false), name).unwrap();
    let mut s = rustls::StreamOwned::new(conn, server.connect());
    // TLS 1.3: the client learns of the refusal on its first read.
    let _ = s.write_all(b"x");
    let mut buf = [0u8; 16];
    assert!(matches!(s.read(&mut buf), Err(_) | Ok(0)));
    let text = server.sink.logged(5, LogTarget::Handshake);
    assert!(text.starts_with("TLS handshake with 127.0.0.1:"), "{text}");
    assert_eq!(
        server
            .counters()
            .tls_handshake_failures
            .load(Ordering::SeqCst),
        1
    );
}

#[test]
fn plain_mqtt_on_the_tls_port_is_refused_and_closed() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 10.0, 64);
    let mut s = server.connect();
    // An MQTT CONNECT, not a ClientHello.
    s.write_all(b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04abcd")
        .unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got); // an alert at most, then the close
    assert!(got.len() < 16, "{got:?}");
    let text = server.sink.logged(5, LogTarget::Handshake);
    assert!(text.contains("failed"), "{text}");
    assert_eq!(
        server
            .reactor
            .as_ref()
            .unwrap()
            .handle()
            .links()
            .handshakes
            .load(Ordering::SeqCst),
        0
    );
}

#[test]
fn a_silent_client_is_closed_at_the_handshake_deadline() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 0.3, 64);
    let mut s = server.connect();
    let began = Instant::now();
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).unwrap(), 0, "closed");
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let text = server.sink.logged(5, LogTarget::Handshake);
    assert!(text.ends_with("timed out"), "{text}");
    assert_eq!(
        server
            .counters()
            .tls_handshake_timeouts
            .load(Ordering::SeqCst),
        1
    );
}

#[test]
fn handshakes_in_flight_are_capped_and_the_rest_wait_in_the_backlog() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 0.5, 2);
    let links = server.reactor.as_ref().unwrap().handle();
    let silent: Vec<TcpStream> = (0..5).map(|_| server.connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        links.links().handshakes.load(Ordering::SeqCst),
        2,
        "two at a time"
    );
    // As the first ones time out, the next ones are taken; all five end so.
    let deadline = Instant::now() + Duration::from_secs(10);
    while server
        .counters()
        .tls_handshake_timeouts
        .load(Ordering::SeqCst)
        < 5
    {
        assert!(links.links().handshakes.load(Ordering::SeqCst) <= 2);
        assert!(
            Instant::now() < deadline,
            "not all handshakes came and went"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // And a real client is served after them.
    let mut client = tls_client(&server, false);
    client.write_all(b"after").unwrap();
    client.flush().unwrap();
    let (conn, _) = server.sink.opened();
    assert_eq!(server.sink.data(conn, 5), b"after");
    drop(silent);
}

#[test]
fn many_writes_of_python_go_out_in_order_through_a_small_send_buffer() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 10.0, 64);
    let mut client = tls_client(&server, false);
    client.write_all(b"x").unwrap();
    client.flush().unwrap();
    let (conn, _) = server.sink.opened();
    server.sink.data(conn, 1);
    let mut expected = Vec::new();
    for i in 0..200u32 {
        let chunk: Vec<u8> = (0..4096u32).map(|j| ((i * 7 + j) % 253) as u8).collect();
        server.send(conn, &chunk);
        expected.extend(chunk);
    }
    let mut got = vec![0u8; expected.len()];
    client.read_exact(&mut got).unwrap();
    assert!(got == expected, "the bytes came out of order or altered");
}

#[test]
fn a_handshake_message_announced_past_the_limit_is_refused_before_it_is_held() {
    let server = Server::start(ClientAuth::None, UsernameFrom::None, 10.0, 64);
    let mut s = server.connect();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    // A ClientHello announcing 16 MiB, then full records of it: rustls takes at most
    // 64 KiB of one handshake message, so the connection ends long before 16 MiB.
    let mut first = vec![0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0xff, 0xff, 0xff];
    first.resize(5 + 0x4000, 0x41);
    let mut sent = 0usize;
    let mut refused = false;
    for i in 0..1024 {
        let record: &[u8] = if i == 0 { &first } else { &first[..5] };
        let mut data = record.to_vec();
        if i > 0 {
            data.resize(5 + 0x4000, 0x41);
        }
        if s.write_all(&data).is_err() {
            refused = true;
            break;
        }
        sent += data.len();
    }
    assert!(refused, "16 MiB of one handshake message taken");
    assert!(
        sent < 8 * 1024 * 1024,
        "{sent} bytes taken before the refusal"
    );
    let text = server.sink.logged(5, LogTarget::Handshake);
    assert!(text.contains("failed"), "{text}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Hostile bytes where a ClientHello belongs (random, or a real one cut and bent):
    /// the listener survives, the connection is closed, no handshake is left counted.
    #[test]
    fn hostile_bytes_into_the_handshake(
        junk in proptest::collection::vec(any::<u8>(), 0..4096),
        cut in 0usize..600,
        flip in 0usize..600,
        real in any::<bool>(),
    ) {
        let server = shared();
        let mut bytes = junk;
        if real {
            let name = ServerName::try_from("localhost").unwrap();
            let mut tls = rustls::ClientConnection::new(client_config(false), name).unwrap();
            let mut hello = Vec::new();
            tls.write_tls(&mut hello).unwrap();
            if flip < hello.len() {
                hello[flip] ^= 0x5a;
            }
            hello.truncate(cut.max(1));
            hello.extend(bytes);
            bytes = hello;
        }
        let mut s = server.connect();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
        let links = server.reactor.as_ref().unwrap().handle();
        let deadline = Instant::now() + Duration::from_secs(5);
        while links.links().handshakes.load(Ordering::SeqCst) != 0 {
            prop_assert!(Instant::now() < deadline, "a handshake stays counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn shared() -> &'static Server {
    static SERVER: std::sync::OnceLock<Server> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| Server::start(ClientAuth::Optional, UsernameFrom::San, 2.0, 64))
}
