//! The engine over loopback sockets: a publish is appended once with its queue offsets,
//! acknowledged after the append, delivered to each matching subscriber once at the
//! right QoS, and left for the index; the log holds the record as the Python store
//! writes it.

mod common;

use std::io::{Read, Write};

use std::os::fd::OwnedFd;
use std::time::Duration;

use common::{pair, read_exact};
use lightgate_native::engine::{AppendError, Config, Engine, Marks, Message};
use lightgate_native::protocol::Settings;
use lightgate_native::reactor::{Adoption, Command};
use lightgate_native::record;

fn adopt(engine: &Engine, conn: u64, socket: OwnedFd) {
    engine.send(adoption(conn, socket));
}

fn adoption(conn: u64, socket: OwnedFd) -> Command {
    Command::Adopt {
        conn,
        socket,
        adoption: Box::new(Adoption::new(Settings {
            version: 4,
            keepalive: 0,
            max_packet: 1 << 20,
            max_qos: 2,
            topic_alias_maximum: 0,
            receive_maximum: 64,
            client_receive_maximum: 10,
            max_inflight: 32,
            client_max_packet: 1 << 20,
            problem_info: true,
        })),
    }
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

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lg-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn message(topic: &str, body: &[u8], queues: &[&str]) -> Message {
    Message {
        born_ts: 7,
        qos: 1,
        topic: topic.to_string(),
        body: body.to_vec(),
        queues: queues.iter().map(|q| q.to_string()).collect(),
        ..Message::default()
    }
}

#[test]
fn outside_appends_share_the_offsets_and_the_order_of_native_publishes() {
    let dir = tmp_dir("outside");
    let config = one_thread_config();
    let engine = Engine::start(&dir, config, Box::new(|q| if q == "a/b" { 5 } else { 0 })).unwrap();
    let (mut publisher, socket) = pair();
    adopt(&engine, 1, socket);
    let (mut subscriber, socket) = pair();
    adopt(&engine, 2, socket);
    engine.subscribe(2, "a/b", 1).unwrap();

    // Python's append first: "a/b" goes on from where the index ends (5).
    let rows = engine
        .append(&[message("a/b", b"py", &["a/b", "x"])], Some(1000))
        .unwrap();
    assert_eq!(
        rows[0].queues,
        vec![("a/b".to_string(), 5), ("x".to_string(), 0)]
    );
    assert_eq!((rows[0].phys_offset, rows[0].store_ts), (0, 1000));
    // ... reaches the native subscriber as a native publish would.
    assert_eq!(
        read_exact(&mut subscriber, 11),
        vec![0x32, 0x09, 0, 3, b'a', b'/', b'b', 0, 1, b'p', b'y']
    );
    // A native publish next takes the offset after it.
    publisher
        .write_all(&[0x32, 0x09, 0, 3, b'a', b'/', b'b', 0, 9, b'h', b'i'])
        .unwrap();
    assert_eq!(read_exact(&mut publisher, 4), vec![0x40, 2, 0, 9]);
    let rows2 = engine
        .append(&[message("a/b", b"again", &["a/b"])], None)
        .unwrap();
    assert_eq!(rows2[0].queues, vec![("a/b".to_string(), 7)]);

    // The index gets all three, in log order, each where the log holds it.
    let pending = engine.take_pending();
    let offsets: Vec<u64> = pending.rows.iter().map(|r| r.queues[0].1).collect();
    assert_eq!(offsets, vec![5, 6, 7]);
    let positions: Vec<u64> = pending.rows.iter().map(|r| r.phys_offset).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]));
    assert!(pending.new_segments.is_empty());
    let end = engine.stop().unwrap();
    let data = std::fs::read(dir.join(format!("{:020}", 0))).unwrap();
    assert_eq!(data.len() as u64, end);
    let (rec, size) = record::decode(&data).unwrap();
    assert_eq!(size as u32, rows[0].size);
    assert_eq!((rec.topic, rec.body, rec.born_ts), ("a/b", &b"py"[..], 7));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_message_no_record_holds_fails_its_batch_and_uses_no_offset() {
    let dir = tmp_dir("invalid");
    let config = Config {
        segment_size: 1 << 20,
        active_base: 0,
        write_pos: 0,
        default_partitions: 1,
        sync: true,
        io_threads: 1,
    };
    let engine = Engine::start(&dir, config, Box::new(|_| 0)).unwrap();
    let mut bad = message("t", b"", &["t"]);
    bad.client_id = "c".repeat(70_000); // a u16 length prefix
    let err = engine
        .append(&[message("t", b"ok", &["t"]), bad], None)
        .unwrap_err();
    assert!(matches!(err, AppendError::Invalid(1, _)), "{err}");
    assert_eq!(engine.write_pos(), 0);
    assert!(engine.take_pending().rows.is_empty());
    let rows = engine.append(&[message("t", b"ok", &["t"])], None).unwrap();
    assert_eq!(rows[0].queues, vec![("t".to_string(), 0)]);
    assert_eq!(
        engine.flushed(),
        engine.write_pos(),
        "sync mode: durable at once"
    );
    engine.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An empty log of 1 MiB segments, one partition, one I/O thread, flush async.
fn one_thread_config() -> Config {
    Config {
        segment_size: 1 << 20,
        active_base: 0,
        write_pos: 0,
        default_partitions: 1,
        sync: false,
        io_threads: 1,
    }
}

#[test]
fn marks_are_raised_before_the_offsets_past_them_are_written() {
    use std::sync::{Arc, Mutex};
    let dir = tmp_dir("marks");
    let config = one_thread_config();
    // "m" has a mark of 2 already; each raise goes 3 past the offset; the third fails.
    type Calls = Vec<Vec<(String, u64)>>;
    let asked: Arc<Mutex<Calls>> = Arc::default();
    let seen = Arc::clone(&asked);
    let marks = Marks {
        mark: Box::new(|q| if q == "m" { 2 } else { 0 }),
        raise: Box::new(move |wanted| {
            let mut calls = seen.lock().unwrap();
            calls.push(wanted.to_vec());
            if calls.len() == 3 {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            Ok(wanted.iter().map(|(_, o)| o + 3).collect())
        }),
    };
    let engine = Engine::start_marked(&dir, config, Box::new(|_| 0), Some(marks)).unwrap();
    let two = [
        message("m", b"a", &["m", "n"]),
        message("m", b"b", &["m", "n"]),
    ];
    engine.append(&two, None).unwrap(); // m 0, 1 under its mark; n 0, 1 past it
    assert_eq!(*asked.lock().unwrap(), vec![vec![("n".to_string(), 1)]]);
    engine.append(&[message("m", b"c", &["m"])], None).unwrap(); // m 2: raised to 5
    assert_eq!(asked.lock().unwrap()[1], vec![("m".to_string(), 2)]);
    let before = engine.write_pos();
    let err = engine
        .append(&vec![message("n", b"d", &["n"]); 3], None) // n 2, 3 under 4; n 4 not
        .unwrap_err();
    assert!(
        matches!(&err, AppendError::Io(e) if e.raw_os_error() == Some(28)),
        "{err}"
    );
    assert_eq!(
        engine.write_pos(),
        before,
        "nothing written past a mark not raised"
    );
    let rows = engine.append(&[message("n", b"e", &["n"])], None).unwrap();
    assert_eq!(
        rows[0].queues,
        vec![("n".to_string(), 2)],
        "the offsets were not used"
    );
    engine.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rolls_are_reported_with_the_rows_and_a_waiter_is_woken() {
    let dir = tmp_dir("rolls");
    let config = Config {
        segment_size: 200,
        active_base: 0,
        write_pos: 0,
        default_partitions: 1,
        sync: false,
        io_threads: 1,
    };
    let engine = std::sync::Arc::new(Engine::start(&dir, config, Box::new(|_| 0)).unwrap());
    assert!(!engine.wait_dispatched(Duration::from_millis(10)));
    let batch: Vec<Message> = (0..5).map(|_| message("t", &[1; 60], &["t"])).collect();
    let rows = engine.append(&batch, None).unwrap();
    assert!(
        engine.wait_dispatched(Duration::from_secs(10)),
        "rows are waiting"
    );
    let size = u64::from(rows[0].size);
    let pending = engine.take_pending();
    assert_eq!(pending.rows, rows);
    // Records of `size` bytes, at most 200 bytes a segment.
    let per = 200 / size;
    let expect: Vec<u64> = (1..5).filter(|i| i % per == 0).map(|i| i * size).collect();
    assert_eq!(pending.new_segments, expect);
    assert_eq!(engine.active_base(), *expect.last().unwrap());
    assert!(
        engine.flushed() >= *expect.last().unwrap(),
        "a closed segment is durable"
    );
    assert_eq!(engine.sync().unwrap(), 5 * size);
    let waiter = {
        let engine = std::sync::Arc::clone(&engine);
        std::thread::spawn(move || engine.wait_dispatched(Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(50));
    let t0 = std::time::Instant::now();
    engine.wake();
    assert!(!waiter.join().unwrap());
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "woken, not timed out"
    );
    assert!(
        !engine.wait_dispatched(Duration::from_secs(10)),
        "woken for good"
    );
    let engine = std::sync::Arc::into_inner(engine).unwrap();
    engine.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

fn temp_engine(name: &str, ends: fn(&str) -> u64) -> (Engine, std::path::PathBuf) {
    let dir = tmp_dir(name);
    let config = Config {
        segment_size: 1 << 20,
        active_base: 0,
        write_pos: 0,
        default_partitions: 4,
        sync: false,
        io_threads: 2,
    };
    (Engine::start(&dir, config, Box::new(ends)).unwrap(), dir)
}

#[test]
fn a_promotion_waits_for_its_queues_end_and_a_demotion_hands_positions_back() {
    // Queue "s/t" holds 3 messages in the index.
    let (engine, dir) = temp_engine("promote", |q| if q == "s/t" { 3 } else { 0 });
    let (mut publisher, socket) = pair();
    adopt(&engine, 1, socket);
    let (mut subscriber, socket) = pair();
    let socket = std::cell::Cell::new(Some(socket));
    // Behind the queue's end: refused, and the socket is not taken.
    let taken = engine
        .promote(2, 4, &[("s/t".to_string(), 1, 2)], || {
            adoption(2, socket.take().unwrap())
        })
        .unwrap();
    assert!(!taken);
    let socket = socket.take().expect("not taken");
    assert!(engine
        .promote(2, 4, &[("s/t".to_string(), 1, 3)], || adoption(2, socket))
        .unwrap());

    // PUBLISH QoS 0 "s/t" "a", then "b": offsets 3 and 4 of the queue.
    publisher
        .write_all(&[0x30, 0x06, 0, 3, b's', b'/', b't', b'a'])
        .unwrap();
    publisher
        .write_all(&[0x30, 0x06, 0, 3, b's', b'/', b't', b'b'])
        .unwrap();
    let got = read_exact(&mut subscriber, 16);
    assert_eq!((got[7], got[15]), (b'a', b'b'));
    assert_eq!(engine.counters().snapshot()[0], ("messages_in", 2));

    // A SUBSCRIBE is Python's: demoted, the positions say what went out, and the
    // wake-up descriptor is readable.
    subscriber
        .write_all(&[0x82, 0x06, 0, 5, 0, 1, b'x', 0])
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let demoted = loop {
        let mut found: Vec<_> = engine
            .take_reports()
            .into_iter()
            .filter_map(|r| match r {
                lightgate_native::reactor::Report::Demoted(d) => Some(d),
                _ => None,
            })
            .collect();
        if let Some(d) = found.pop() {
            break d;
        }
        assert!(std::time::Instant::now() < deadline, "no demotion");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(demoted.conn, 2);
    assert_eq!(demoted.positions.get("s/t"), Some(&5));
    let wake = engine.wake_fd();
    assert!(wake >= 0);
    engine.clear_wake();

    // Its subscriptions went with it: a later publish reaches nobody natively.
    publisher
        .write_all(&[0x30, 0x06, 0, 3, b's', b'/', b't', b'c'])
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut appended = 0;
    while appended < 3 {
        appended += engine.take_dispatched().len();
        assert!(std::time::Instant::now() < deadline, "not appended");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(std::net::TcpStream::from(
        demoted.socket.expect("a plain socket"),
    ));
    let mut buf = [0u8; 8];
    assert_eq!(
        subscriber.read(&mut buf).unwrap(),
        0,
        "closed, nothing more sent"
    );
    // A promotion at the new end (6) is taken again.
    let (_other, socket) = pair();
    assert!(engine
        .promote(3, 4, &[("s/t".to_string(), 0, 6)], || adoption(3, socket))
        .unwrap());
    engine.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_dispatch_far_behind_takes_bounded_steps_and_can_be_hurried() {
    let (engine, dir) = temp_engine("steps", |_| 0);
    let messages: Vec<Message> = (0..5).map(|i| message("t", &[i], &["t"])).collect();
    engine.append(&messages, None).unwrap();
    let first = engine.take_pending_upto(2);
    let rest = engine.take_pending_upto(10);
    let offsets = |p: &lightgate_native::engine::Pending| -> Vec<u64> {
        p.rows.iter().map(|d| d.queues[0].1).collect()
    };
    assert_eq!(offsets(&first), vec![0, 1], "the oldest first");
    assert_eq!(offsets(&rest), vec![2, 3, 4]);
    assert!(engine.take_pending_upto(10).rows.is_empty());

    assert!(
        !engine.wait_hurry(Duration::from_millis(20)),
        "the pause, unhurried"
    );
    engine.hurry();
    let t = std::time::Instant::now();
    assert!(engine.wait_hurry(Duration::from_secs(5)), "hurried");
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(
        !engine.wait_hurry(Duration::from_millis(20)),
        "once per hurry"
    );
    engine.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_records_of_wanted_queues_come_with_their_rows_and_only_theirs() {
    let (engine, dir) = temp_engine("wanted", |_| 0);
    let (mut publisher, socket) = pair();
    adopt(&engine, 1, socket);
    // PUBLISH QoS 1 "a/b" id `id` "hi", acknowledged once in the log.
    let publish = |publisher: &mut std::net::TcpStream, topic: u8, id: u8| {
        publisher
            .write_all(&[0x32, 0x09, 0, 3, b'a', b'/', topic, 0, id, b'h', b'i'])
            .unwrap();
        assert_eq!(read_exact(publisher, 4), vec![0x40, 2, 0, id]);
    };
    publish(&mut publisher, b'b', 1); // nobody reads "a/b" yet: no record
    engine.want_queues(&["a/b".to_string()], Duration::from_secs(60));
    publish(&mut publisher, b'b', 2); // read: its record comes along
    publish(&mut publisher, b'c', 3); // another queue's: not
    engine
        .append(&[message("a/b", b"py", &["a/b"])], None)
        .unwrap(); // the owner's own: it holds the message, no record
    engine.want_queues(&["a/b".to_string()], Duration::ZERO);
    publish(&mut publisher, b'b', 4); // no longer read
    let rows = engine.take_pending().rows;
    let seen: Vec<(bool, bool)> = rows.iter().map(|d| (d.own, d.record.is_some())).collect();
    assert_eq!(
        seen,
        vec![
            (false, false),
            (false, true),
            (false, false),
            (true, false),
            (false, false)
        ]
    );
    let kept = rows[1].record.as_ref().unwrap();
    assert_eq!(kept.len(), rows[1].size as usize);
    let (rec, _) = record::decode(kept).unwrap();
    assert_eq!(
        (rec.topic, rec.body, rec.queues[0]),
        ("a/b", &b"hi"[..], ("a/b", 1))
    );
    engine.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
