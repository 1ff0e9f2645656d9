//! The engine over loopback sockets: a publish is appended once with its queue offsets,
//! acknowledged after the append, delivered to each matching subscriber once at the
//! right QoS, and left for the index; the log holds the record as the Python store
//! writes it.

mod common;

use std::io::{Read, Write};

use std::os::fd::OwnedFd;
use std::time::Duration;

use common::{pair, read_exact};
use lightgate_native::engine::{Config, Engine};
use lightgate_native::protocol::Settings;
use lightgate_native::reactor::Command;
use lightgate_native::record;

fn adopt(engine: &Engine, conn: u64, socket: OwnedFd) {
    engine.send(Command::Adopt {
        conn,
        socket,
        settings: Settings {
            version: 4,
            keepalive: 0,
            max_packet: 1 << 20,
            max_qos: 2,
            topic_alias_maximum: 0,
            receive_maximum: 64,
            client_receive_maximum: 10,
            max_inflight: 32,
            client_max_packet: 1 << 20,
        },
        unread: Vec::new(),
        idle_for: 0.0,
        acl: None,
    });
}

#[test]
fn publish_append_ack_deliver_dispatch() {
    let dir = std::env::temp_dir().join(format!("lg-engine-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = Config {
        segment_size: 1 << 20,
        active_base: 0,
        write_pos: 0,
        default_partitions: 4,
        sync: true,
        io_threads: 2,
    };
    // Queue "a/b" already holds 5 messages in the index: its next offset is 5.
    let engine = Engine::start(&dir, config, Box::new(|q| if q == "a/b" { 5 } else { 0 })).unwrap();
    engine.register_wildcard("a/+").unwrap();
    let (mut publisher, socket) = pair();
    adopt(&engine, 1, socket);
    let (mut subscriber, socket) = pair();
    adopt(&engine, 2, socket);
    engine.subscribe(2, "a/+", 1).unwrap();
    engine.subscribe(2, "a/#", 0).unwrap(); // overlapping: still one copy, at QoS 1

    // PUBLISH QoS 1 "a/b" id 9 "hi"
    publisher
        .write_all(&[0x32, 0x09, 0, 3, b'a', b'/', b'b', 0, 9, b'h', b'i'])
        .unwrap();
    assert_eq!(read_exact(&mut publisher, 4), vec![0x40, 2, 0, 9]);
    assert_eq!(
        read_exact(&mut subscriber, 11),
        vec![0x32, 0x09, 0, 3, b'a', b'/', b'b', 0, 1, b'h', b'i']
    );
    subscriber
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    assert!(subscriber.read(&mut [0; 4]).is_err(), "one copy only");

    let dispatched = engine.take_dispatched();
    assert_eq!(dispatched.len(), 1);
    let n = crc32fast::hash(b"a/b") % 4;
    assert_eq!(
        dispatched[0].queues,
        vec![
            ("a/b".to_string(), 5),
            ("a/+".to_string(), 0),
            (format!("a#{n}"), 0)
        ]
    );
    assert_eq!(dispatched[0].phys_offset, 0);
    let end = engine.stop().unwrap();
    let data = std::fs::read(dir.join(format!("{:020}", 0))).unwrap();
    assert_eq!(data.len() as u64, end);
    let (rec, size) = record::decode(&data).unwrap();
    assert_eq!(size, data.len());
    assert_eq!((rec.topic, rec.body, rec.qos), ("a/b", &b"hi"[..], 1));
    assert_eq!(rec.queues[0], ("a/b", 5));
    std::fs::remove_dir_all(&dir).unwrap();
}
