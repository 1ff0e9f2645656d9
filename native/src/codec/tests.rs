//! Known bytes (as `gateway/mqtt/codec.py` makes and reads them), round trips, and
//! hostile input: no input panics, and the budget holds however the bytes arrive.

use super::error::*;
use super::properties::{Property, Value};
use super::*;
use proptest::prelude::*;

/// Every packet and the error (if any) from feeding `chunks` to a fresh decoder.
fn run(version: u8, max: usize, chunks: &[&[u8]]) -> (Vec<String>, Option<DecodeError>) {
    let mut dec = Decoder::new(version, max).unwrap();
    let mut out = Vec::new();
    for chunk in chunks {
        if let Err(e) = dec.feed(chunk, |p| out.push(format!("{p:?}"))) {
            return (out, Some(e));
        }
    }
    (out, None)
}

fn one(version: u8, bytes: &[u8]) -> Result<String, DecodeError> {
    let (mut got, err) = run(version, MAX_PACKET_SIZE, &[bytes]);
    match err {
        Some(e) => Err(e),
        None => {
            assert_eq!(got.len(), 1, "{got:?}");
            Ok(got.remove(0))
        }
    }
}

fn code(version: u8, bytes: &[u8]) -> u8 {
    one(version, bytes)
        .expect_err("should not decode")
        .reason_code()
}

fn publish<'a>(
    topic: &'a str,
    payload: &'a [u8],
    qos: u8,
    props: Vec<Property<'a>>,
) -> Publish<'a> {
    Publish {
        topic,
        payload,
        qos,
        retain: false,
        dup: false,
        packet_id: if qos > 0 { Some(10) } else { None },
        properties: props,
    }
}

const V4_QOS1: &[u8] = b"\x32\x09\x00\x03a/b\x00\x0ahi";
const V5_QOS1: &[u8] = b"\x32\x0e\x00\x03a/b\x00\x0a\x04\x03\x00\x01thi";

#[test]
fn decodes_known_publishes() {
    let mut dec = Decoder::new(4, MAX_PACKET_SIZE).unwrap();
    let mut got = Vec::new();
    dec.feed(V4_QOS1, |p| got.push(format!("{p:?}"))).unwrap();
    assert_eq!(
        got,
        [format!(
            "{:?}",
            Packet::Publish(publish("a/b", b"hi", 1, vec![]))
        )]
    );
    let want = publish(
        "a/b",
        b"hi",
        1,
        vec![Property {
            id: 0x03,
            value: Value::Str("t"),
        }],
    );
    assert_eq!(
        one(5, V5_QOS1).unwrap(),
        format!("{:?}", Packet::Publish(want))
    );
}

#[test]
fn encodes_known_bytes() {
    let mut out = Vec::new();
    encode_publish(&publish("a/b", b"hi", 1, vec![]), 4, &mut out).unwrap();
    assert_eq!(out, V4_QOS1);
    out.clear();
    let props = vec![Property {
        id: 0x03,
        value: Value::Str("t"),
    }];
    encode_publish(&publish("a/b", b"hi", 1, props), 5, &mut out).unwrap();
    assert_eq!(out, V5_QOS1);
    out.clear();
    encode_ack(7, 0, &[], 4, &mut out).unwrap();
    encode_ack(7, 0x10, &[], 5, &mut out).unwrap();
    encode_pingresp(&mut out);
    assert_eq!(out, b"\x40\x02\x00\x07\x40\x03\x00\x07\x10\xd0\x00");
    assert!(encode_ack(7, 0x10, &[], 4, &mut out).is_err());
    assert!(encode_ack(7, 0x05, &[], 5, &mut out).is_err());
}

#[test]
fn encode_refuses_what_python_refuses() {
    let mut out = Vec::new();
    for (p, v) in [
        (publish("a/+", b"", 0, vec![]), 4),
        (publish("", b"", 0, vec![]), 4),
        (publish("a", b"", 3, vec![]), 4),
        (
            Publish {
                packet_id: Some(0),
                ..publish("a", b"", 1, vec![])
            },
            4,
        ),
        (
            Publish {
                dup: true,
                ..publish("a", b"", 0, vec![])
            },
            4,
        ),
        (
            publish(
                "a",
                b"",
                0,
                vec![Property {
                    id: 0x03,
                    value: Value::Str("t"),
                }],
            ),
            4,
        ),
        (
            publish(
                "a",
                b"",
                0,
                vec![Property {
                    id: 0x23,
                    value: Value::Int(0),
                }],
            ),
            5,
        ),
        (
            publish(
                "a",
                b"",
                0,
                vec![Property {
                    id: 0x01,
                    value: Value::Int(2),
                }],
            ),
            5,
        ),
        (
            publish(
                "a",
                b"",
                0,
                vec![Property {
                    id: 0x11,
                    value: Value::Int(2),
                }],
            ),
            5,
        ),
        (
            publish(
                "a",
                b"",
                0,
                vec![Property {
                    id: 0x08,
                    value: Value::Str("r/#"),
                }],
            ),
            5,
        ),
    ] {
        assert!(encode_publish(&p, v, &mut out).is_err(), "{p:?}");
    }
    assert!(out.is_empty());
    // A topic alias stands in for the topic in v5 only; a delivery may carry
    // subscription identifiers (more than one).
    let alias = vec![Property {
        id: 0x23,
        value: Value::Int(3),
    }];
    encode_publish(&publish("", b"", 0, alias), 5, &mut out).unwrap();
    let ids = vec![
        Property {
            id: 0x0B,
            value: Value::Int(1),
        },
        Property {
            id: 0x0B,
            value: Value::Int(2),
        },
    ];
    encode_publish(&publish("a", b"", 0, ids), 5, &mut out).unwrap();
}

#[test]
fn reason_codes_match_the_python_codec() {
    // (version, bytes, reason code), each as gateway/mqtt/codec.py raises it.
    let cases: &[(u8, &[u8], u8)] = &[
        (4, b"\x36\x03\x00\x01a", MALFORMED_PACKET),    // QoS 3
        (4, b"\x30\x03\x00\x05a", MALFORMED_PACKET),    // topic past the end
        (4, b"\x30\x03\x00\x01\xff", MALFORMED_PACKET), // topic not UTF-8
        (4, b"\x30\x05\x00\x03\xed\xa0\x80", MALFORMED_PACKET), // a surrogate
        (4, b"\x30\x03\x00\x01\x00", MALFORMED_PACKET), // U+0000
        (4, b"\x30\x02\x00\x00", PROTOCOL_ERROR),       // empty topic
        (4, b"\x30\x03\x00\x01+", TOPIC_NAME_INVALID),
        (5, b"\x30\x04\x00\x01#\x00", TOPIC_NAME_INVALID),
        (4, b"\x38\x03\x00\x01a", MALFORMED_PACKET), // DUP on QoS 0
        (4, b"\x32\x05\x00\x01a\x00\x00", PROTOCOL_ERROR), // packet id 0
        (4, b"\x32\x04\x00\x01a\x00", MALFORMED_PACKET), // truncated packet id
        (5, b"\x30\x06\x00\x01a\x02\x01\x02", PROTOCOL_ERROR), // format indicator 2
        (5, b"\x30\x06\x00\x00\x03\x23\x00\x00", TOPIC_ALIAS_INVALID),
        (5, b"\x30\x06\x00\x01a\x02\x0b\x01", PROTOCOL_ERROR), // subscription id from a client
        (5, b"\x30\x06\x00\x01a\x02\x11\x01", MALFORMED_PACKET), // not a PUBLISH property
        (5, b"\x30\x06\x00\x01a\x02\x7f\x01", MALFORMED_PACKET), // unknown property
        (5, b"\x30\x08\x00\x01a\x04\x01\x00\x01\x00", PROTOCOL_ERROR), // repeated
        (5, b"\x30\x05\x00\x01a\x05\x01", MALFORMED_PACKET),   // property length past the end
        (5, b"\x30\x07\x00\x01a\x03\x02\x00\x00", MALFORMED_PACKET), // truncated u32
        (5, b"\x30\x08\x00\x01a\x04\x08\x00\x01#", PROTOCOL_ERROR), // bad response topic
        (5, b"\x30\x05\x00\x01a\x80\x00", MALFORMED_PACKET),   // non-minimal length
        (4, b"\x42\x02\x00\x01", MALFORMED_PACKET),            // PUBACK flags
        (4, b"\x40\x02\x00\x00", PROTOCOL_ERROR),
        (4, b"\x40\x03\x00\x01\x00", MALFORMED_PACKET), // v4 ack with a reason
        (5, b"\x40\x03\x00\x01\x05", PROTOCOL_ERROR),   // not a PUBACK reason
        (5, b"\x62\x03\x00\x01\x10", PROTOCOL_ERROR),   // not a PUBREL reason
        (5, b"\x40\x05\x00\x01\x00\x00\x00", MALFORMED_PACKET), // trailing bytes
        (5, b"\x40\x06\x00\x01\x00\x02\x01\x00", MALFORMED_PACKET), // not an ack property
        (4, b"\xc0\x01\x00", MALFORMED_PACKET),
        (4, b"\xe0\x01\x00", MALFORMED_PACKET),
        (5, b"\xe0\x01\x05", PROTOCOL_ERROR),
        (4, b"\x00\x00", MALFORMED_PACKET),
        (4, b"\xf0\x00", MALFORMED_PACKET),       // AUTH before v5
        (4, b"\x20\x02\x00\x00", PROTOCOL_ERROR), // CONNACK from a client
        (4, b"\x30\x80\x80\x80\x80\x01", MALFORMED_PACKET), // 5-byte remaining length
        (4, b"\x30\x80\x00", MALFORMED_PACKET),   // non-minimal remaining length
    ];
    for (version, bytes, want) in cases {
        assert_eq!(code(*version, bytes), *want, "{bytes:02x?}");
    }
}

#[test]
fn other_packets_are_left_for_python() {
    let sub = b"\x82\x06\x00\x01\x00\x01a\x00";
    let got = one(4, sub).unwrap();
    let frame = Frame {
        ptype: SUBSCRIBE,
        flags: 2,
        body: &sub[2..],
    };
    assert_eq!(got, format!("{:?}", Packet::Other(frame)));
    assert!(one(5, b"\xf0\x00").is_ok()); // AUTH in v5
    assert!(one(4, b"\x10\x00").is_ok()); // a second CONNECT: Python refuses it
}

#[test]
fn acks_ping_and_disconnect() {
    assert!(one(5, b"\x40\x02\x00\x01").is_ok());
    assert!(one(5, b"\x50\x03\x00\x01\x10").is_ok());
    assert!(one(5, b"\x62\x08\x00\x01\x92\x04\x1f\x00\x01x").is_ok());
    assert_eq!(one(4, b"\xc0\x00").unwrap(), "Pingreq");
    let got = one(5, b"\xe0\x07\x04\x05\x11\x00\x00\x00\x05").unwrap();
    assert!(got.contains("reason_code: 4"), "{got}");
}

#[test]
fn budget_refuses_before_buffering() {
    // The header announces 100 bytes; the limit is 50: refused with 2 bytes in hand.
    let (got, err) = run(4, 50, &[b"\x30\x62"]);
    assert!(got.is_empty());
    assert_eq!(
        err,
        Some(DecodeError::PacketTooLarge { size: 100, max: 50 })
    );
    // Exactly at the limit is fine, and a dead decoder stays dead.
    let mut dec = Decoder::new(4, V4_QOS1.len()).unwrap();
    dec.feed(V4_QOS1, |_| {}).unwrap();
    assert!(dec.feed(b"\x30\x7f", |_| {}).is_err());
    assert_eq!(
        dec.feed(V4_QOS1, |_| panic!("dead"))
            .unwrap_err()
            .reason_code(),
        PACKET_TOO_LARGE
    );
}

#[test]
fn partial_tail_is_kept_and_counted() {
    let mut dec = Decoder::new(4, MAX_PACKET_SIZE).unwrap();
    let mut n = 0;
    let two = [V4_QOS1, V4_QOS1].concat();
    dec.feed(&two[..15], |_| n += 1).unwrap();
    assert_eq!((n, dec.buffered()), (1, 4));
    dec.feed(&two[15..16], |_| n += 1).unwrap();
    assert_eq!((n, dec.buffered()), (1, 5));
    dec.feed(&two[16..], |_| n += 1).unwrap();
    assert_eq!((n, dec.buffered()), (2, 0));
}

#[test]
fn payload_format_indicator() {
    let utf8 = vec![Property {
        id: 0x01,
        value: Value::Int(1),
    }];
    assert!(payload_format_valid(&publish("a", "é".as_bytes(), 0, utf8.clone())).is_ok());
    let bad = payload_format_valid(&publish("a", b"\xff", 0, utf8)).unwrap_err();
    assert_eq!(bad.reason_code(), PAYLOAD_FORMAT_INVALID);
    assert!(payload_format_valid(&publish("a", b"\xff", 0, vec![])).is_ok());
}

// ----------------------------------------------------------------------------------------
// Property tests
// ----------------------------------------------------------------------------------------

/// Text without U+0000 (which no MQTT string may hold).
fn text() -> impl Strategy<Value = String> {
    "[^\u{0}]{0,12}"
}

fn topic() -> impl Strategy<Value = String> {
    "[^\u{0}+#]{1,20}"
}

/// One PUBLISH property a client may send, as an owned value.
#[derive(Debug, Clone)]
enum Owned {
    Int(u8, u32),
    Str(u8, String),
    Bin(Vec<u8>),
    Pair(String, String),
}

fn client_publish_property() -> impl Strategy<Value = Owned> {
    prop_oneof![
        (0u32..2).prop_map(|v| Owned::Int(0x01, v)),
        any::<u32>().prop_map(|v| Owned::Int(0x02, v)),
        text().prop_map(|s| Owned::Str(0x03, s)),
        topic().prop_map(|s| Owned::Str(0x08, s)),
        proptest::collection::vec(any::<u8>(), 0..16).prop_map(Owned::Bin),
        (1u32..=0xFFFF).prop_map(|v| Owned::Int(0x23, v)),
        (text(), text()).prop_map(|(k, v)| Owned::Pair(k, v)),
    ]
}

fn borrow(props: &[Owned]) -> Vec<Property<'_>> {
    props
        .iter()
        .map(|o| match o {
            Owned::Int(id, v) => Property {
                id: *id,
                value: Value::Int(*v),
            },
            Owned::Str(id, s) => Property {
                id: *id,
                value: Value::Str(s),
            },
            Owned::Bin(b) => Property {
                id: 0x09,
                value: Value::Bin(b),
            },
            Owned::Pair(k, v) => Property {
                id: 0x26,
                value: Value::Pair(k, v),
            },
        })
        .collect()
}

/// A property list without repeats of the single-valued ones.
fn props() -> impl Strategy<Value = Vec<Owned>> {
    proptest::collection::vec(client_publish_property(), 0..6).prop_map(|list| {
        let mut seen = Vec::new();
        list.into_iter()
            .filter(|p| {
                let id = match p {
                    Owned::Int(id, _) | Owned::Str(id, _) => *id,
                    Owned::Bin(_) => 0x09,
                    Owned::Pair(..) => return true,
                };
                let fresh = !seen.contains(&id);
                seen.push(id);
                fresh
            })
            .collect()
    })
}

proptest! {
    #[test]
    fn publish_round_trips(
        topic in topic(), payload in proptest::collection::vec(any::<u8>(), 0..300),
        qos in 0u8..3, retain: bool, dup: bool, id in 1u16.., version in 4u8..6,
        props in props(),
    ) {
        let props = if version == 5 { borrow(&props) } else { Vec::new() };
        let p = Publish { topic: &topic, payload: &payload, qos, retain, dup: dup && qos > 0,
            packet_id: (qos > 0).then_some(id), properties: props };
        let mut out = Vec::new();
        encode_publish(&p, version, &mut out).unwrap();
        let mut got = Vec::new();
        Decoder::new(version, MAX_PACKET_SIZE).unwrap()
            .feed(&out, |d| got.push(format!("{d:?}"))).unwrap();
        prop_assert_eq!(got, vec![format!("{:?}", Packet::Publish(p))]);
    }

    #[test]
    fn puback_round_trips(id in 1u16.., code in proptest::sample::select(vec![0u8, 0x10, 0x80, 0x87, 0x99]),
                          reason in proptest::option::of(text())) {
        let props: Vec<Property<'_>> = reason.iter()
            .map(|r| Property { id: 0x1F, value: Value::Str(r) }).collect();
        let mut out = Vec::new();
        encode_ack(id, code, &props, 5, &mut out).unwrap();
        let mut got = Vec::new();
        Decoder::new(5, MAX_PACKET_SIZE).unwrap().feed(&out, |d| got.push(format!("{d:?}"))).unwrap();
        let want = Packet::Ack(Ack { ptype: PUBACK, packet_id: id, reason_code: code, properties: props });
        prop_assert_eq!(got, vec![format!("{want:?}")]);
    }

    #[test]
    fn hostile_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..600), version in 3u8..6,
        max in 2usize..400, step in 1usize..64,
    ) {
        let mut dec = Decoder::new(version, max).unwrap();
        for chunk in bytes.chunks(step) {
            if dec.feed(chunk, |_| {}).is_err() {
                break;
            }
            // Never more than one packet within the budget (or a header) is held.
            prop_assert!(dec.buffered() < max.max(5));
        }
    }

    #[test]
    fn chunking_changes_nothing(
        bytes in proptest::collection::vec(any::<u8>(), 0..300), version in 4u8..6, step in 1usize..16,
    ) {
        let whole = run(version, 1000, &[&bytes]);
        let chunks: Vec<&[u8]> = bytes.chunks(step).collect();
        prop_assert_eq!(run(version, 1000, &chunks), whole);
    }

    #[test]
    fn mangled_publishes_never_panic(
        topic in topic(), payload in proptest::collection::vec(any::<u8>(), 0..40), props in props(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let p = Publish { topic: &topic, payload: &payload, qos: 1, retain: false, dup: false,
            packet_id: Some(1), properties: borrow(&props) };
        let mut out = Vec::new();
        encode_publish(&p, 5, &mut out).unwrap();
        for (at, xor) in flips {
            let i = at.index(out.len());
            out[i] ^= xor;
        }
        let _ = run(5, 1 << 16, &[&out]);
        let _ = run(5, 1 << 16, &[&out[..cut.index(out.len())]]);
    }
}

#[test]
fn a_decoder_can_move_to_another_thread() {
    // The native plane runs a reactor per I/O thread; a connection's decoder goes with it.
    fn send<T: Send + Sync>() {}
    send::<Decoder>();
    send::<DecodeError>();
}
