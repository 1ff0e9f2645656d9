//! The floor of one more process on a message's path, on this machine: the CPU a
//! request and its answer cost over loopback TCP when each message travels alone (a
//! fleet of devices, each publishing now and then), with no work at either end.
//!
//! `cargo run --release --example hop_floor -- [messages] [rate]` prints JSON: the CPU
//! (user + system, from /proc) per message of a paced sender alone (it wakes once per
//! message, as a broker does for a device's publish), and of the sender and an echo
//! process when each message makes one round trip to it (what a gateway pays to reach
//! its store). The difference is what the separated shape cannot avoid per message,
//! however little either process does.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SIZE: usize = 96;

fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0 // USER_HZ
}

fn echo(port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_nodelay(true).ok();
    let mut buf = [0u8; SIZE];
    while s.read_exact(&mut buf).is_ok() {
        if s.write_all(&buf).is_err() {
            return;
        }
    }
}

/// Paced sends; with `peer`, each waits for its answer. CPU seconds of (self, peer).
fn run(n: u32, rate: f64, peer: Option<&mut TcpStream>, peer_pid: Option<u32>) -> (f64, f64) {
    let me = std::process::id();
    let (c0, p0) = (cpu_s(me), peer_pid.map_or(0.0, cpu_s));
    let start = Instant::now();
    let mut buf = [7u8; SIZE];
    let mut peer = peer;
    for i in 0..n {
        let due = start + Duration::from_secs_f64(f64::from(i) / rate);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if let Some(s) = peer.as_deref_mut() {
            s.write_all(&buf).expect("send");
            s.read_exact(&mut buf).expect("answer");
        }
    }
    (cpu_s(me) - c0, peer_pid.map_or(0.0, cpu_s) - p0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--echo") {
        echo(args[2].parse().expect("port"));
        return;
    }
    let n: u32 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let rate: f64 = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(2_000.0);
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args(["--echo", &port.to_string()])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn the echo process");
    let (mut s, _) = listener.accept().expect("accept");
    s.set_nodelay(true).ok();
    let (alone, _) = run(n, rate, None, None);
    let (sender, peer) = run(n, rate, Some(&mut s), Some(child.id()));
    drop(s);
    let _ = child.wait();
    let us = |cpu: f64| (cpu * 1e6 / f64::from(n) * 10.0).round() / 10.0;
    println!(
        "{{\"messages\": {n}, \"rate\": {rate}, \"paced_alone_us\": {}, \
         \"with_hop_sender_us\": {}, \"with_hop_echo_us\": {}, \"hop_us\": {}}}",
        us(alone),
        us(sender),
        us(peer),
        us(sender + peer - alone)
    );
}
