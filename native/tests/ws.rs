//! The native WebSocket listeners over loopback, with a client written here (every
//! frame chosen): the upgrade read and handed to the owner, its answer (the 101, or a
//! refusal), frames both ways however they are cut, a ping answered, the client's close
//! echoed, a message past its limit closed with 1009 and said, a close of ours that
//! waits a moment for the client's; what is no upgrade refused here, a silent client
//! closed at the upgrade's deadline; the same over TLS. And hostile bytes, into the
//! codec and into a real listener: no panic, nothing held past its bound.

#[path = "common/links.rs"]
mod links;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lightgate_native::link::LinkShare;
use lightgate_native::reactor::{Command, LinkEvent, Listener, LogTarget, Reactor};
use lightgate_native::tls::{ClientAuth, TlsFiles, TlsSettings, UsernameFrom};
use lightgate_native::ws;
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
    tls: bool,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.reactor.take() {
            r.stop();
        }
    }
}

impl Server {
    /// A WebSocket listener (over TLS, client certificates optional, named by their CN,
    /// when `tls`) whose upgrades may take `timeout` seconds.
    fn start(tls: bool, timeout: f64) -> Server {
        let sink = Arc::new(Collect::default());
        let reactor = Reactor::start(2, sink.clone()).unwrap();
        let files = tls.then(|| {
            let files = TlsFiles::load(TlsSettings {
                cert: fixture("server.pem"),
                key: fixture("server.key"),
                ca: Some(fixture("ca.pem")),
                client_auth: ClientAuth::Optional,
                username_from: UsernameFrom::Cn,
            })
            .unwrap();
            Arc::new(Mutex::new(files))
        });
        let socket = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let listener = Listener::websocket(
            1,
            "MQTT over WebSocket".into(),
            socket,
            files,
            usize::MAX,
            10.0,
            timeout,
        )
        .unwrap();
        reactor.send(Command::Listen(Box::new(listener)));
        Server {
            reactor: Some(reactor),
            sink,
            port,
            tls,
        }
    }

    fn command(&self, command: Command) {
        self.reactor.as_ref().unwrap().send(command);
    }

    fn connect(&self) -> Client {
        let s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_nodelay(true).unwrap();
        if !self.tls {
            return Client::Plain(s);
        }
        let name = ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(client_config(), name).unwrap();
        let mut s = rustls::StreamOwned::new(conn, s);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock).unwrap();
        }
        Client::Tls(Box::new(s))
    }

    /// The next connection Python hears of, with its upgrade request.
    fn opened(&self) -> (u64, Arc<LinkShare>, Option<String>, (String, Vec<String>)) {
        self.sink.wait(5, |e| match e {
            LinkEvent::Opened {
                conn,
                share,
                identity,
                upgrade: Some(up),
                ..
            } => Some((*conn, share.clone(), identity.clone(), up.clone())),
            _ => None,
        })
    }

    /// Accept the next upgrade with "mqtt"; messages may hold `limit` bytes.
    fn accept(&self, limit: usize) -> u64 {
        let (conn, share, _, _) = self.opened();
        share.set_message_limit(limit, "--max-connect-packet");
        self.command(Command::Upgrade {
            conn,
            subprotocol: Some("mqtt".into()),
        });
        conn
    }
}

fn client_config() -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(fixture("ca.pem")).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            vec![CertificateDer::from_pem_file(fixture("client.pem")).unwrap()],
            PrivateKeyDer::from_pem_file(fixture("client.key")).unwrap(),
        )
        .unwrap();
    Arc::new(config)
}

enum Client {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Read for Client {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Client::Plain(s) => s.read(buf),
            Client::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Client {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Client::Plain(s) => s.write(buf),
            Client::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Client::Plain(s) => s.flush(),
            Client::Tls(s) => s.flush(),
        }
    }
}

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

fn head(protocols: &str) -> Vec<u8> {
    format!(
        "GET /mqtt?x=1 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Protocol: {protocols}\r\n\r\n"
    )
    .into_bytes()
}

/// A masked client frame.
fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x5a, 0x01, 0xc3, 0x7e];
    let mut out = vec![first];
    match payload.len() {
        n if n <= 125 => out.push(0x80 | n as u8),
        n if n <= 0xFFFF => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// The server's answer to the upgrade: its head.
fn read_answer(c: &mut Client) -> String {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        if c.read(&mut byte).unwrap() == 0 {
            break;
        }
        got.push(byte[0]);
    }
    String::from_utf8(got).unwrap()
}

/// The server's next frame: (first byte, payload). Its frames are never masked.
fn read_frame(c: &mut Client) -> (u8, Vec<u8>) {
    let mut two = [0u8; 2];
    c.read_exact(&mut two).unwrap();
    assert_eq!(two[1] & 0x80, 0, "a server's frame is never masked");
    let n = match two[1] & 0x7f {
        126 => {
            let mut b = [0u8; 2];
            c.read_exact(&mut b).unwrap();
            u16::from_be_bytes(b) as usize
        }
        127 => {
            let mut b = [0u8; 8];
            c.read_exact(&mut b).unwrap();
            u64::from_be_bytes(b) as usize
        }
        n => n as usize,
    };
    let mut payload = vec![0u8; n];
    c.read_exact(&mut payload).unwrap();
    (two[0], payload)
}

/// Whether the server closes the connection within `secs` (what it sends meanwhile
/// read and dropped).
fn closed_within(c: &mut Client, secs: f64) -> bool {
    let began = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => return began.elapsed().as_secs_f64() < secs,
            Ok(_) => {}
        }
    }
}

fn upgrade_and_frames(tls: bool) {
    let server = Server::start(tls, 10.0);
    let mut c = server.connect();
    let mut first = head("chat, mqtt");
    first.extend(frame(0x82, b"pipelined")); // behind the request, before the 101
    c.write_all(&first[..40]).unwrap();
    c.flush().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    c.write_all(&first[40..]).unwrap();
    c.flush().unwrap();
    let (conn, share, identity, (target, offered)) = server.opened();
    assert_eq!(target, "/mqtt?x=1");
    assert_eq!(offered, vec!["chat", "mqtt"]);
    assert_eq!(identity.as_deref(), tls.then_some("device-1"));
    share.set_message_limit(100_000, "--max-packet-size");
    server.command(Command::Upgrade {
        conn,
        subprotocol: Some("mqtt".into()),
    });
    assert_eq!(
        read_answer(&mut c),
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
    );
    assert_eq!(server.sink.data(conn, 9), b"pipelined");
    // A fragmented message, a ping between its frames, a large one cut in odd places.
    let mut wire = frame(0x02, b"frag");
    wire.extend(frame(0x89, b"hi"));
    wire.extend(frame(0x80, b"mented"));
    // (Within the relay's window: Python is not there to say it consumed any.)
    let big: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    wire.extend(frame(0x82, &big));
    for piece in wire.chunks(997) {
        c.write_all(piece).unwrap();
        c.flush().unwrap();
    }
    let mut expected = b"fragmented".to_vec();
    expected.extend(&big);
    assert_eq!(server.sink.data(conn, expected.len()), expected);
    assert_eq!(read_frame(&mut c), (0x8a, b"hi".to_vec()), "the pong");
    // Python's bytes, each write a binary message (a large one in frames of 64 KiB).
    server.command(Command::Send {
        conn,
        data: b"\x20\x02\x00\x00".to_vec(),
    });
    assert_eq!(read_frame(&mut c), (0x82, b"\x20\x02\x00\x00".to_vec()));
    let big: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
    server.command(Command::Send {
        conn,
        data: big.clone(),
    });
    let (a, b) = (read_frame(&mut c), read_frame(&mut c));
    assert_eq!((a.0, b.0), (0x82, 0x82));
    assert_eq!(a.1.len(), ws::FRAME_PAYLOAD);
    assert_eq!([a.1, b.1].concat(), big);
    // The client's close: echoed, and the end of the stream.
    c.write_all(&frame(0x88, b"\x03\xe8bye")).unwrap();
    c.flush().unwrap();
    assert_eq!(read_frame(&mut c), (0x88, b"\x03\xe8bye".to_vec()));
    assert!(server.sink.ended(conn).0, "an end, not a break");
}

#[test]
fn an_upgrade_is_answered_then_frames_go_both_ways() {
    upgrade_and_frames(false);
}

#[test]
fn the_same_over_tls_with_the_certificates_identity() {
    upgrade_and_frames(true);
}

#[test]
fn what_is_no_upgrade_is_refused_here_and_said() {
    let server = Server::start(false, 10.0);
    for bad in [
        &b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00"[..],
        b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        let mut c = server.connect();
        c.write_all(bad).unwrap();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        assert_eq!(got, b"HTTP/1.1 400 \r\ncontent-length: 0\r\n\r\n");
        let text = server.sink.logged(5, LogTarget::Upgrade);
        assert!(text.ends_with("failed: no upgrade request"), "{text}");
    }
    // The listener is unharmed.
    let mut c = server.connect();
    c.write_all(&head("mqtt")).unwrap();
    server.accept(10);
    assert!(read_answer(&mut c).starts_with("HTTP/1.1 101 "));
}

#[test]
fn python_refuses_with_its_answer() {
    let server = Server::start(false, 10.0);
    let mut c = server.connect();
    c.write_all(&head("chat")).unwrap();
    let (conn, ..) = server.opened();
    server.command(Command::Refuse {
        conn,
        status: 400,
        body: b"MQTT over WebSocket needs subprotocol mqtt\n".to_vec(),
    });
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert_eq!(
        got,
        b"HTTP/1.1 400 \r\ncontent-type: text/plain\r\ncontent-length: 43\r\n\r\n\
          MQTT over WebSocket needs subprotocol mqtt\n"
    );
}

#[test]
fn a_silent_client_is_closed_at_the_upgrades_deadline() {
    let server = Server::start(true, 0.3);
    let began = Instant::now();
    let mut c = server.connect(); // the TLS handshake done: the upgrade's time starts
    let mut buf = [0u8; 1];
    assert!(matches!(c.read(&mut buf), Ok(0) | Err(_)), "closed");
    let took = began.elapsed();
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let text = server.sink.logged(5, LogTarget::Upgrade);
    assert!(text.ends_with("timed out"), "{text}");
}

#[test]
fn a_message_past_its_limit_closes_1009_and_is_said() {
    let server = Server::start(false, 10.0);
    let mut c = server.connect();
    c.write_all(&head("mqtt")).unwrap();
    let conn = server.accept(10);
    read_answer(&mut c);
    c.write_all(&frame(0x82, &[0xc0; 11])).unwrap();
    let (eof, why) = server.sink.ended(conn);
    assert!(!eof);
    assert!(
        why.ends_with("websocket message over 10 bytes (--max-connect-packet)"),
        "{why}"
    );
    let text = server.sink.logged(5, LogTarget::MessageLimit);
    assert!(
        text.starts_with("websocket client 127.0.0.1:")
            && text.ends_with("closed: a message of more than 10 bytes (--max-connect-packet)"),
        "{text}"
    );
    let (first, payload) = read_frame(&mut c);
    assert_eq!((first, &payload[..2]), (0x88, &1009u16.to_be_bytes()[..]));
    assert_eq!(&payload[2..], b"message over 10 bytes");
}

#[test]
fn our_close_waits_a_moment_for_the_clients() {
    let server = Server::start(false, 10.0);
    // A client that answers: closed as soon as it did.
    let mut c = server.connect();
    c.write_all(&head("mqtt")).unwrap();
    let conn = server.accept(100);
    read_answer(&mut c);
    server.command(Command::Send {
        conn,
        data: b"last words".to_vec(),
    });
    server.command(Command::Close { conn });
    assert_eq!(read_frame(&mut c), (0x82, b"last words".to_vec()));
    assert_eq!(read_frame(&mut c), (0x88, b"\x03\xe8".to_vec()));
    c.write_all(&frame(0x88, b"\x03\xe8")).unwrap();
    assert!(closed_within(&mut c, 0.5));
    // One that does not: closed a second later.
    let mut c = server.connect();
    c.write_all(&head("mqtt")).unwrap();
    let conn = server.accept(100);
    read_answer(&mut c);
    server.command(Command::Close { conn });
    assert_eq!(read_frame(&mut c), (0x88, b"\x03\xe8".to_vec()));
    let began = Instant::now();
    assert!(closed_within(&mut c, 3.0));
    assert!(began.elapsed() >= Duration::from_millis(800));
}

#[test]
fn the_relay_holds_its_window_and_no_more_until_python_reads() {
    use lightgate_native::link::RELAY_WINDOW;
    let server = Server::start(false, 10.0);
    let mut c = server.connect();
    c.write_all(&head("mqtt")).unwrap();
    let (conn, share, ..) = server.opened();
    share.set_message_limit(1 << 20, "--max-packet-size");
    server.command(Command::Upgrade {
        conn,
        subprotocol: Some("mqtt".into()),
    });
    read_answer(&mut c);
    // 256 KiB in messages of 16 KiB: the socket's buffers take them, the engine relays
    // its window's worth and waits.
    let message = vec![0x41u8; 16 * 1024];
    for _ in 0..16 {
        c.write_all(&frame(0x82, &message)).unwrap();
    }
    let first = server.sink.data(conn, RELAY_WINDOW as usize);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        first.len() + server.sink.data_now(conn).len(),
        RELAY_WINDOW as usize
    );
    // Python read it all: the rest comes, a window at a time.
    let mut total = RELAY_WINDOW;
    while total < 256 * 1024 {
        if share.consumed(total) {
            server.command(Command::Resume { conn });
        }
        total += server.sink.data(conn, 1).len() as u64;
        total += server.sink.data_now(conn).len() as u64;
        assert!(total - share.acked.load(Ordering::SeqCst) <= RELAY_WINDOW);
    }
    assert_eq!(total, 256 * 1024);
}

/// A stream of client frames, valid ones, for the codec.
fn frames() -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
    proptest::collection::vec(
        (
            proptest::collection::vec(any::<u8>(), 0..300),
            1usize..4,
            any::<[u8; 4]>(),
            any::<bool>(),
        ),
        0..12,
    )
    .prop_map(|messages| {
        let mut wire = Vec::new();
        let mut payload = Vec::new();
        for (bytes, parts, mask, ping) in messages {
            let cut = bytes.len() / parts;
            let mut pieces: Vec<&[u8]> = Vec::new();
            let mut rest = &bytes[..];
            for _ in 1..parts {
                let (a, b) = rest.split_at(cut.min(rest.len()));
                pieces.push(a);
                rest = b;
            }
            pieces.push(rest);
            for (i, piece) in pieces.iter().enumerate() {
                let op = if i == 0 { 0x2 } else { 0x0 };
                let fin = if i + 1 == pieces.len() { 0x80 } else { 0 };
                let mut f = vec![fin | op];
                match piece.len() {
                    n if n <= 125 => f.push(0x80 | n as u8),
                    n => {
                        f.push(0x80 | 126);
                        f.extend_from_slice(&(n as u16).to_be_bytes());
                    }
                }
                f.extend_from_slice(&mask);
                f.extend(piece.iter().enumerate().map(|(j, b)| b ^ mask[j % 4]));
                wire.extend(f);
                if ping {
                    wire.extend(frame(0x89, b"p")); // between the frames of a message
                }
            }
            payload.extend_from_slice(&bytes);
        }
        (wire, payload)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// However the frames are cut, the same message bytes come out, and the codec holds
    /// no more than a control frame's worth.
    #[test]
    fn frames_cut_anywhere_give_the_same_bytes(
        (wire, payload) in frames(),
        cuts in proptest::collection::vec(1usize..200, 1..40),
    ) {
        let mut codec = ws::Codec::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut i = 0;
        while at < wire.len() {
            let n = cuts[i % cuts.len()].min(wire.len() - at);
            let mut piece = wire[at..at + n].to_vec();
            let m = codec.decode(&mut piece, 1 << 20).unwrap();
            prop_assert!(m <= n);
            got.extend_from_slice(&piece[..m]);
            prop_assert!(codec.held() <= 3 * 128);
            at += n;
            i += 1;
        }
        prop_assert_eq!(got, payload);
        prop_assert_eq!(codec.ended(), None);
    }

    /// Hostile bytes, cut anywhere: no panic, nothing out of thin air, the codec's hold
    /// bounded; and once it stopped, it stays stopped.
    #[test]
    fn hostile_bytes_into_the_codec(
        junk in proptest::collection::vec(any::<u8>(), 0..4096),
        cut in 1usize..600,
        limit in 0usize..2000,
    ) {
        let mut codec = ws::Codec::new();
        for piece in junk.chunks(cut) {
            let mut piece = piece.to_vec();
            match codec.decode(&mut piece, limit) {
                Ok(m) => prop_assert!(m <= piece.len()),
                Err(_) => prop_assert!(codec.ended().is_some()),
            }
            prop_assert!(codec.held() <= 3 * 128);
            while codec.take_control().is_some() {}
        }
        codec.close();
        prop_assert!(codec.close_sent());
    }

    /// Any head: no panic, and nothing past the limit waits for more.
    #[test]
    fn hostile_heads(
        junk in proptest::collection::vec(any::<u8>(), 0..20_000),
        good in any::<bool>(),
    ) {
        let mut bytes = junk;
        if good {
            let mut h = head("mqtt");
            h.truncate(bytes.len() % (h.len() + 1));
            h.extend(bytes);
            bytes = h;
        }
        let read = ws::read_head(&bytes);
        if bytes.len() > ws::HEAD_LIMIT {
            prop_assert!(read != ws::Head::Incomplete);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Hostile bytes after an upgrade, into a real listener: the connection ends or
    /// waits, the listener goes on serving.
    #[test]
    fn hostile_bytes_after_an_upgrade(
        junk in proptest::collection::vec(any::<u8>(), 0..8192),
        before_upgrade in any::<bool>(),
    ) {
        let server = shared();
        let mut c = server.connect();
        if before_upgrade {
            let _ = c.write_all(&junk);
        } else {
            c.write_all(&head("mqtt")).unwrap();
            let conn = server.accept(1000);
            read_answer(&mut c);
            let _ = c.write_all(&junk);
            server.command(Command::Close { conn });
        }
        let _ = c.flush();
        if let Client::Plain(s) = &c {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
        prop_assert!(closed_within(&mut c, 5.0), "not closed");
        let mut ok = server.connect();
        ok.write_all(&head("mqtt")).unwrap();
        server.accept(10);
        prop_assert!(read_answer(&mut ok).starts_with("HTTP/1.1 101 "));
    }
}

fn shared() -> &'static Server {
    static SERVER: std::sync::OnceLock<Server> = std::sync::OnceLock::new();
    SERVER.get_or_init(|| Server::start(false, 2.0))
}
