//! A measuring stick, not a broker: the native engine with the least possible owner
//! around it (MQTT 3.1.1 CONNECT accepted as is, SUBSCRIBE to plain filters, nothing
//! else), so the benchmark harness can show what the native per-message path costs
//! before the Python rules are wired to it. No authentication, no sessions, no index.
//!
//! `cargo run --release --example engine_broker -- PORT DATA_DIR IO_THREADS`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use lightgate_native::engine::{Config, Engine};
use lightgate_native::protocol::Settings;
use lightgate_native::reactor::{Adoption, Command, Report, Why};

fn settings() -> Settings {
    Settings {
        version: 4,
        keepalive: 0,
        max_packet: 1 << 20,
        max_qos: 2,
        topic_alias_maximum: 0,
        receive_maximum: 1024,
        client_receive_maximum: 32,
        max_inflight: 32,
        client_max_packet: 1 << 20,
        problem_info: true,
    }
}

/// Read one whole packet from a blocking socket: (first byte, body).
fn read_packet(s: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    let mut b0 = [0u8; 1];
    s.read_exact(&mut b0)?;
    let (mut len, mut mult) = (0usize, 1usize);
    loop {
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        len += usize::from(b[0] & 0x7F) * mult;
        if b[0] < 0x80 {
            break;
        }
        mult *= 128;
    }
    let mut body = vec![0; len];
    s.read_exact(&mut body)?;
    Ok((b0[0], body))
}

/// A SUBSCRIBE's packet id and (filter, qos) pairs, MQTT 3.1.1.
fn parse_subscribe(body: &[u8]) -> Option<(u16, Vec<(String, u8)>)> {
    let pid = u16::from_be_bytes([*body.first()?, *body.get(1)?]);
    let mut p = 2;
    let mut out = Vec::new();
    while p < body.len() {
        let n = usize::from(u16::from_be_bytes([body[p], *body.get(p + 1)?]));
        let f = std::str::from_utf8(body.get(p + 2..p + 2 + n)?)
            .ok()?
            .to_string();
        out.push((f, *body.get(p + 2 + n)? & 3));
        p += 3 + n;
    }
    Some((pid, out))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port: u16 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1883);
    let dir =
        std::path::PathBuf::from(args.get(2).cloned().unwrap_or_else(|| "data-engine".into()));
    let threads: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1);
    std::fs::create_dir_all(&dir).expect("data dir");
    let config = Config {
        segment_size: 1 << 30,
        active_base: 0,
        write_pos: 0,
        default_partitions: 4,
        sync: false,
        io_threads: threads,
    };
    let engine = Arc::new(Engine::start(&dir, config, Box::new(|_| 0)).expect("engine"));
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("port");
    println!("ready mqtt=127.0.0.1:{port}");
    let owner = Arc::clone(&engine);
    // Each connection's filters: a demotion takes its subscriptions away, so they are
    // registered again with the new ones.
    let mut filters_of: std::collections::HashMap<u64, Vec<(String, u8)>> =
        std::collections::HashMap::new();
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(20));
        owner.take_dispatched(); // no index here: what it costs is Python's, later
        for report in owner.take_reports() {
            let Report::Demoted(d) = report else { continue };
            if d.why != Why::Packet || d.unread.first().map(|b| b >> 4) != Some(8) {
                filters_of.remove(&d.conn);
                continue; // the connection ends: its socket closes
            }
            let Some(socket) = d.socket else { continue };
            let mut s = TcpStream::from(socket);
            let _ = s.set_nonblocking(false);
            let mut held: &[u8] = &d.unread;
            let Ok((_, body)) = read_packet(&mut held) else {
                continue;
            };
            let Some((pid, filters)) = parse_subscribe(&body) else {
                continue;
            };
            let mut ack = vec![0x90, (2 + filters.len()) as u8, (pid >> 8) as u8, pid as u8];
            let known = filters_of.entry(d.conn).or_default();
            for (f, q) in &filters {
                ack.push(*q);
                known.retain(|(old, _)| old != f);
                known.push((f.clone(), *q));
            }
            for (f, q) in known.iter() {
                let _ = owner.subscribe(d.conn, f, *q);
            }
            let _ = s.write_all(&d.unsent);
            let _ = s.write_all(&ack);
            let _ = s.set_nonblocking(true);
            let consumed = packet_len(&d.unread);
            owner.send(Command::Adopt {
                conn: d.conn,
                socket: OwnedFd::from(s),
                adoption: Box::new(Adoption {
                    unread: d.unread[consumed..].to_vec(),
                    ..Adoption::new(settings())
                }),
            });
        }
    });
    let mut next = 1u64;
    for stream in listener.incoming() {
        let Ok(mut s) = stream else { continue };
        let _ = s.set_nodelay(true);
        if read_packet(&mut s).is_err() || s.write_all(&[0x20, 2, 0, 0]).is_err() {
            continue;
        }
        let _ = s.set_nonblocking(true);
        engine.send(Command::Adopt {
            conn: next,
            socket: OwnedFd::from(s),
            adoption: Box::new(Adoption::new(settings())),
        });
        next += 1;
    }
}

/// The length of the whole packet at the start of `data`.
fn packet_len(data: &[u8]) -> usize {
    let (mut len, mut mult, mut i) = (0usize, 1usize, 1usize);
    while i < data.len() {
        len += usize::from(data[i] & 0x7F) * mult;
        i += 1;
        if data[i - 1] < 0x80 {
            break;
        }
        mult *= 128;
    }
    (i + len).min(data.len())
}
