//! One connection's steady state after its CONNACK, sans-IO, to the rules of
//! `gateway/mqtt/protocol.py` and `outbound.py` (the reference): bytes in, events and
//! bytes out, no socket and no clock of its own.
//!
//! It carries only what a device does per message: PUBLISH at QoS 0 and 1 (topic
//! aliases resolved, our Receive Maximum counted), PINGREQ, and the PUBACKs of our own
//! QoS 1 deliveries, with their packet ids and the client's window. Everything else is
//! the Python side's: at the first packet it does not carry (a SUBSCRIBE, QoS 2, a
//! retained publish, a topic the ACL cache cannot answer, DISCONNECT, anything
//! malformed) it stops and says `Demote`, leaving that packet and the bytes after it
//! unread (`unread`), so the Python core decides it exactly as it decides any other
//! (with `unacked_at_demote`, the QoS 1 publishes not acknowledged when that packet was
//! read, so that it counts our Receive Maximum as it would have). The two therefore
//! share one implementation of every rare path and every error.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use crate::codec::properties::{self, Property, Value};
use crate::codec::wire::varint_or_none;

/// MQTT 5 Reason String.
const REASON_STRING: u8 = 0x1F;
/// A PUBACK's bytes but its Reason String's text, at most (Python's `REASON_OVERHEAD`).
const REASON_OVERHEAD: usize = 16;
use crate::codec::{decode_packet, encode_ack, encode_pingresp, encode_publish, Packet, Publish};

/// What CONNECT negotiated, handed over by the Python core.
#[derive(Debug, Clone)]
pub struct Settings {
    pub version: u8,
    /// Seconds; 0: no keepalive.
    pub keepalive: u16,
    /// Ours: the largest packet the client may send (the decoder's budget).
    pub max_packet: usize,
    pub max_qos: u8,
    /// Ours: the highest inbound topic alias (v5).
    pub topic_alias_maximum: u16,
    /// Ours: unacknowledged inbound QoS 1/2 publishes allowed (v5).
    pub receive_maximum: u32,
    /// The client's Receive Maximum and our own cap on what we keep in flight.
    pub client_receive_maximum: u32,
    pub max_inflight: u32,
    /// The client's Maximum Packet Size: larger deliveries are dropped.
    pub client_max_packet: usize,
    /// The client's Request Problem Information (v5): false, no Reason String on a
    /// PUBACK [MQTT-3.1.2-29].
    pub problem_info: bool,
}

/// What a call to `receive` found for the driver to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Append this message; answer it with `publish_done(ticket, ..)` (QoS 1).
    Publish {
        topic: String,
        payload: Vec<u8>,
        qos: u8,
        packet_id: Option<u16>,
        ticket: Option<u64>,
    },
    /// One of our QoS 1 sends was acknowledged: the window has room again. `source` is
    /// what the driver gave `deliver` for it.
    Acked { packet_id: u16, source: (u64, u64) },
    /// The packet at `unread()` is the Python side's; nothing after it was read.
    Demote,
}

/// The verdict of the driver's ACL cache on a topic the client publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acl {
    Allowed,
    /// Refused, or not known yet: either way the Python side decides.
    AskPython,
}

/// The owner's limits on a topic name (`--max-topic-length` in characters,
/// `--max-topic-levels`): what a connection that may publish anywhere is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicLimits {
    pub max_length: usize,
    pub max_levels: usize,
}

impl TopicLimits {
    pub const NONE: TopicLimits = TopicLimits {
        max_length: usize::MAX,
        max_levels: usize::MAX,
    };

    /// As the owner counts: characters, and levels as separators.
    pub fn exceeded(&self, topic: &str) -> bool {
        topic.chars().count() > self.max_length
            || topic.bytes().filter(|&b| b == b'/').count() >= self.max_levels
    }
}

impl Acl {
    /// The verdict of a per-connection cache of allowed topics, or (None) of a
    /// connection that may publish to every topic: within `limits`, and not to a topic
    /// of the server's (`$`), which the owner decides.
    pub fn from_cache(allowed: &Option<BTreeSet<String>>, topic: &str, limits: TopicLimits) -> Acl {
        match allowed {
            Some(set) if set.contains(topic) => Acl::Allowed,
            Some(_) => Acl::AskPython,
            None if topic.starts_with('$') || limits.exceeded(topic) => Acl::AskPython,
            None => Acl::Allowed,
        }
    }
}

/// An outbound QoS 1 send awaiting its PUBACK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub data: Vec<u8>,
    /// Where the message came from: (light queue handle, offset), for the driver.
    pub source: (u64, u64),
}

pub struct Connection {
    pub settings: Settings,
    /// A B-tree: empty (most connections), it is half a hash map's size.
    aliases_in: BTreeMap<u16, String>,
    /// Inbound QoS 1 publishes whose PUBACK is not decided yet (our Receive Maximum).
    inbound_unacked: u32,
    /// `inbound_unacked` when the packet handed back was read: the owner counts that
    /// packet, and those after it, on top of them (as a burst read at once is counted).
    unacked_at_demote: u32,
    /// Answers in the order of the packets they answer; None until decided.
    answers: VecDeque<Option<Vec<u8>>>,
    next_ticket: u64,
    out: Vec<u8>,
    outgoing: BTreeMap<u16, Outgoing>,
    next_packet_id: u16,
    /// Bytes not parsed yet: an incomplete packet, or everything from the one handed back.
    unread: Vec<u8>,
    read_at: f64,
    demoted: bool,
    /// A publish was not stored and 3.1.1 has no negative ack: the connection must end
    /// (as the Python side ends it), so that the client sends it again.
    store_failed: bool,
}

impl Connection {
    pub fn new(settings: Settings, now: f64) -> Self {
        Connection {
            settings,
            aliases_in: BTreeMap::new(),
            inbound_unacked: 0,
            unacked_at_demote: 0,
            answers: VecDeque::new(),
            next_ticket: 0,
            out: Vec::new(),
            outgoing: BTreeMap::new(),
            next_packet_id: 1,
            unread: Vec::new(),
            read_at: now,
            demoted: false,
            store_failed: false,
        }
    }

    /// Restore what the Python core had: inbound aliases, the next packet id, what was
    /// in flight, bytes read but not parsed.
    pub fn restore(
        &mut self,
        aliases_in: HashMap<u16, String>,
        next_packet_id: u16,
        outgoing: BTreeMap<u16, Outgoing>,
        unread: Vec<u8>,
    ) {
        self.aliases_in = aliases_in.into_iter().collect();
        self.next_packet_id = next_packet_id.max(1);
        self.outgoing = outgoing;
        self.unread = unread;
    }

    /// The owner had read `n` QoS 1 publishes it had not acknowledged before the bytes
    /// it hands over (`unread` of an adoption): those are read behind them, and
    /// `caught_up(n)` once they are.
    pub fn behind(&mut self, n: u32) {
        self.inbound_unacked += n;
    }

    pub fn caught_up(&mut self, n: u32) {
        self.inbound_unacked = self.inbound_unacked.saturating_sub(n);
    }

    // -- output -------------------------------------------------------------------------
    /// Everything the client is to be sent, in order; empties the outbox.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    pub fn pending_output(&self) -> usize {
        self.out.len()
    }

    fn answer_now(&mut self, data: &[u8]) {
        if self.answers.is_empty() {
            self.out.extend_from_slice(data);
        } else {
            self.answers.push_back(Some(data.to_vec()));
        }
    }

    fn ticket(&mut self) -> u64 {
        self.answers.push_back(None);
        self.next_ticket + self.answers.len() as u64 - 1
    }

    fn decide(&mut self, ticket: u64, data: Vec<u8>) {
        let Some(i) = ticket.checked_sub(self.next_ticket) else {
            return;
        };
        if let Some(slot) = self.answers.get_mut(i as usize) {
            *slot = Some(data);
        }
        while let Some(Some(_)) = self.answers.front() {
            if let Some(Some(data)) = self.answers.pop_front() {
                self.out.extend_from_slice(&data);
            }
            self.next_ticket += 1;
        }
    }

    /// Answers still waiting for the store (a demotion waits until there are none).
    pub fn answers_pending(&self) -> usize {
        self.answers.len()
    }

    // -- input --------------------------------------------------------------------------
    /// The bytes from the first packet not handled on (after a `Demote`), or of an
    /// incomplete packet: what the Python core is to be fed next.
    pub fn unread(&self) -> &[u8] {
        &self.unread
    }

    pub fn demoted(&self) -> bool {
        self.demoted
    }

    /// Inbound QoS 1 publishes not acknowledged yet when the packet at `unread` was
    /// read (their PUBACKs go out before the demotion): the owner reads that packet, and
    /// those after it, as if they still were not, as it counts a burst it reads at once
    /// against our Receive Maximum [MQTT-3.3.4-7].
    pub fn unacked_at_demote(&self) -> u32 {
        self.unacked_at_demote
    }

    /// A 3.1.1 publish was not stored: the connection must end.
    pub fn store_failed(&self) -> bool {
        self.store_failed
    }

    /// When the client last sent anything, in the driver's clock.
    pub fn read_at(&self) -> f64 {
        self.read_at
    }

    /// When the keepalive runs out (1.5 times the interval without a packet), in the
    /// driver's clock; infinity without a keepalive.
    pub fn deadline(&self) -> f64 {
        if self.settings.keepalive == 0 {
            f64::INFINITY
        } else {
            self.read_at + f64::from(self.settings.keepalive) * 1.5
        }
    }

    /// Feed bytes read from the client. `acl` answers for each topic published to.
    pub fn receive(
        &mut self,
        data: &[u8],
        now: f64,
        mut acl: impl FnMut(&str) -> Acl,
        events: &mut Vec<Event>,
    ) {
        if self.demoted {
            self.unread.extend_from_slice(data);
            return;
        }
        self.read_at = now;
        let buf = if self.unread.is_empty() {
            data.to_vec()
        } else {
            let mut held = std::mem::take(&mut self.unread);
            held.extend_from_slice(data);
            held
        };
        let mut pos = 0;
        while pos < buf.len() {
            let start = pos;
            let header = varint_or_none(&buf, pos + 1, buf.len());
            let (rl, body_at) = match header {
                Ok(Some(v)) => v,
                Ok(None) => break, // the header is not whole yet
                Err(_) => return self.demote(&buf[start..], events),
            };
            let end = body_at + rl as usize;
            if end - start > self.settings.max_packet {
                return self.demote(&buf[start..], events); // Python refuses it (0x95)
            }
            if end > buf.len() {
                break;
            }
            let b0 = buf[start];
            let handled = match decode_packet(
                b0 >> 4,
                b0 & 0x0F,
                &buf[body_at..end],
                self.settings.version,
            ) {
                Ok(packet) => self.on_packet(packet, &mut acl, events),
                Err(_) => false,
            };
            if !handled {
                return self.demote(&buf[start..], events);
            }
            pos = end;
        }
        self.unread = buf[pos..].to_vec();
    }

    fn demote(&mut self, rest: &[u8], events: &mut Vec<Event>) {
        self.unread = rest.to_vec();
        self.unacked_at_demote = self.inbound_unacked;
        self.demoted = true;
        events.push(Event::Demote);
    }

    /// Handle one packet here; false: it is the Python side's, and nothing was changed.
    fn on_packet(
        &mut self,
        packet: Packet<'_>,
        acl: &mut impl FnMut(&str) -> Acl,
        events: &mut Vec<Event>,
    ) -> bool {
        match packet {
            Packet::Publish(p) => self.on_publish(&p, acl, events),
            Packet::Ack(a) if a.ptype == crate::codec::PUBACK => {
                // An unknown id is a late or duplicate ack: nothing to do (as in Python).
                if let Some(o) = self.outgoing.remove(&a.packet_id) {
                    events.push(Event::Acked {
                        packet_id: a.packet_id,
                        source: o.source,
                    });
                }
                true
            }
            Packet::Pingreq => {
                let mut pong = Vec::with_capacity(2);
                encode_pingresp(&mut pong);
                self.answer_now(&pong);
                true
            }
            _ => false,
        }
    }

    fn on_publish(
        &mut self,
        p: &Publish<'_>,
        acl: &mut impl FnMut(&str) -> Acl,
        events: &mut Vec<Event>,
    ) -> bool {
        let s = &self.settings;
        if p.retain || p.qos == 2 || p.qos > s.max_qos {
            return false;
        }
        // Only a topic alias may come with it: other properties are stored with the
        // message as the Python side encodes them.
        let mut alias = None;
        for prop in &p.properties {
            match (prop.id, &prop.value) {
                (properties::TOPIC_ALIAS, Value::Int(a)) => alias = Some(*a),
                _ => return false,
            }
        }
        let topic: String = match alias {
            None => p.topic.to_string(),
            Some(a) => {
                let Ok(a) = u16::try_from(a) else {
                    return false;
                };
                if a > s.topic_alias_maximum {
                    return false;
                }
                if !p.topic.is_empty() {
                    p.topic.to_string()
                } else {
                    match self.aliases_in.get(&a) {
                        Some(t) => t.clone(),
                        None => return false,
                    }
                }
            }
        };
        if topic.starts_with('$') || acl(&topic) != Acl::Allowed {
            return false;
        }
        if p.qos == 1 && s.version == 5 && self.inbound_unacked + 1 > s.receive_maximum {
            return false; // Python ends it with 0x93
        }
        if let (Some(a), false) = (alias, p.topic.is_empty()) {
            self.aliases_in.insert(a as u16, p.topic.to_string());
        }
        let ticket = if p.qos == 1 {
            self.inbound_unacked += 1;
            Some(self.ticket())
        } else {
            None
        };
        events.push(Event::Publish {
            topic,
            payload: p.payload.to_vec(),
            qos: p.qos,
            packet_id: p.packet_id,
            ticket,
        });
        true
    }

    /// The publish at `ticket` was stored (`code` 0) or not (a v5 reason code, and
    /// `reason` why in words; 3.1.1 gets no PUBACK, as it has no negative one).
    pub fn publish_done(&mut self, ticket: u64, packet_id: u16, code: u8, reason: Option<&str>) {
        self.inbound_unacked = self.inbound_unacked.saturating_sub(1);
        if code != 0 && self.settings.version != 5 {
            // No ack at all: its place is given up, and the connection ends.
            self.store_failed = true;
            self.decide(ticket, Vec::new());
            return;
        }
        let told = if self.settings.version == 5 { code } else { 0 };
        let why = if told == 0 {
            None
        } else {
            reason.and_then(|r| self.reason(r))
        };
        let props: Vec<Property<'_>> = why
            .map(|w| Property {
                id: REASON_STRING,
                value: Value::Str(w),
            })
            .into_iter()
            .collect();
        let mut ack = Vec::with_capacity(5);
        // A valid id and reason code cannot fail to encode; a bad one is dropped.
        if encode_ack(packet_id, told, &props, self.settings.version, &mut ack).is_ok() {
            self.decide(ticket, ack);
        }
    }

    /// A Reason String as Python's core sends one (`MqttProtocol.reason`): none unless
    /// the client asked for problem information [MQTT-3.1.2-29]; cut (at a character)
    /// to what keeps the packet within the client's Maximum Packet Size and 200 bytes
    /// [MQTT-3.4.2-2]; none if fewer than 8 characters are left of it.
    fn reason<'a>(&self, text: &'a str) -> Option<&'a str> {
        if !self.settings.problem_info || self.settings.version != 5 {
            return None;
        }
        let room = self
            .settings
            .client_max_packet
            .saturating_sub(REASON_OVERHEAD)
            .min(200);
        let mut end = text.len().min(room);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cut = &text[..end];
        (cut.chars().count() >= 8).then_some(cut)
    }

    // -- deliveries -----------------------------------------------------------------------
    /// How many more QoS 1 sends the client takes now.
    pub fn window(&self) -> usize {
        let cap = self
            .settings
            .client_receive_maximum
            .min(self.settings.max_inflight) as usize;
        cap.saturating_sub(self.outgoing.len())
    }

    fn packet_id(&mut self) -> Option<u16> {
        for _ in 0..65535 {
            let pid = self.next_packet_id;
            self.next_packet_id = pid % 65535 + 1;
            if !self.outgoing.contains_key(&pid) {
                return Some(pid);
            }
        }
        None
    }

    /// Send a stored message at `qos` (the caller checked `window` for QoS 1). Returns
    /// the packet id taken (QoS 1), None for QoS 0, or Err when it must be dropped
    /// (larger than the client takes).
    pub fn deliver(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
        source: (u64, u64),
    ) -> Result<Option<u16>, Dropped> {
        let pid = if qos > 0 {
            Some(self.packet_id().ok_or(Dropped)?)
        } else {
            None
        };
        let sent = self.encode_delivery(pid, topic, payload, qos, retain, source);
        if let (Err(_), Some(pid)) = (&sent, pid) {
            // Not taken after all: the id goes back.
            self.next_packet_id = pid;
        }
        sent
    }

    /// `deliver`, under the packet id the caller reserved for it (`pid`, QoS 1: a
    /// persistent session's send, whose record names the id before it goes out).
    pub fn deliver_as(
        &mut self,
        pid: Option<u16>,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
        source: (u64, u64),
    ) -> Result<Option<u16>, Dropped> {
        if pid.is_some_and(|p| p == 0 || self.outgoing.contains_key(&p))
            || (qos > 0) != pid.is_some()
        {
            return Err(Dropped);
        }
        let sent = self.encode_delivery(pid, topic, payload, qos, retain, source);
        if let (Ok(_), Some(pid)) = (&sent, pid) {
            self.next_packet_id = pid % 65535 + 1;
        }
        sent
    }

    fn encode_delivery(
        &mut self,
        pid: Option<u16>,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
        source: (u64, u64),
    ) -> Result<Option<u16>, Dropped> {
        let p = Publish {
            topic,
            payload,
            qos,
            retain,
            dup: false,
            packet_id: pid,
            properties: Vec::<Property<'_>>::new(),
        };
        let mut data = Vec::new();
        if encode_publish(&p, self.settings.version, &mut data).is_err()
            || data.len() > self.settings.client_max_packet
        {
            return Err(Dropped);
        }
        self.out.extend_from_slice(&data);
        if let Some(pid) = pid {
            self.outgoing.insert(pid, Outgoing { data, source });
        }
        Ok(pid)
    }

    /// What is in flight, for a demotion's snapshot.
    pub fn outgoing(&self) -> &BTreeMap<u16, Outgoing> {
        &self.outgoing
    }

    pub fn next_packet_id(&self) -> u16 {
        self.next_packet_id
    }

    pub fn aliases_in(&self) -> HashMap<u16, String> {
        self.aliases_in
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }
}

/// A delivery that cannot go to this client (it would pass the client's Maximum Packet
/// Size, or no packet id is free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_acl_cache_or_anywhere_within_the_limits() {
        let limits = TopicLimits {
            max_length: 8,
            max_levels: 3,
        };
        let cache: Option<BTreeSet<String>> = Some(["a/b".to_string()].into());
        assert_eq!(Acl::from_cache(&cache, "a/b", limits), Acl::Allowed);
        assert_eq!(Acl::from_cache(&cache, "a/c", limits), Acl::AskPython);
        // What Python cached it checked: the cache is not held to the limits again.
        let long: Option<BTreeSet<String>> = Some(["a/b/c/d/e".to_string()].into());
        assert_eq!(Acl::from_cache(&long, "a/b/c/d/e", limits), Acl::Allowed);
        for (topic, verdict) in [
            ("a/b/c", Acl::Allowed),
            ("a/b/c/d", Acl::AskPython), // three separators: past 3 levels
            ("ééééééé", Acl::Allowed),   // 7 characters, 14 bytes
            ("ééééééééé", Acl::AskPython),
            ("$SYS/x", Acl::AskPython), // the server's: Python decides
            ("$share", Acl::AskPython),
        ] {
            assert_eq!(Acl::from_cache(&None, topic, limits), verdict, "{topic}");
        }
        assert_eq!(
            Acl::from_cache(&None, "a/b/c/d/e/f/g", TopicLimits::NONE),
            Acl::Allowed
        );
    }

    fn settings(version: u8) -> Settings {
        Settings {
            version,
            keepalive: 60,
            max_packet: 1 << 20,
            max_qos: 2,
            topic_alias_maximum: 10,
            receive_maximum: 2,
            client_receive_maximum: 3,
            max_inflight: 100,
            client_max_packet: 1 << 20,
            problem_info: true,
        }
    }

    fn publish(topic: &str, payload: &[u8], qos: u8, pid: Option<u16>, version: u8) -> Vec<u8> {
        let p = Publish {
            topic,
            payload,
            qos,
            retain: false,
            dup: false,
            packet_id: pid,
            properties: Vec::new(),
        };
        let mut out = Vec::new();
        encode_publish(&p, version, &mut out).unwrap();
        out
    }

    fn allow(_: &str) -> Acl {
        Acl::Allowed
    }

    #[test]
    fn publishes_and_acks_in_order() {
        let mut c = Connection::new(settings(4), 0.0);
        let mut data = publish("a/b", b"1", 1, Some(7), 4);
        data.extend(publish("a/b", b"2", 0, None, 4));
        data.extend([0xC0, 0x00]); // PINGREQ: its answer waits behind the PUBACK
        let mut ev = Vec::new();
        c.receive(&data, 1.0, allow, &mut ev);
        assert_eq!(ev.len(), 2);
        assert!(matches!(
            &ev[0],
            Event::Publish {
                qos: 1,
                ticket: Some(0),
                ..
            }
        ));
        assert!(c.take_output().is_empty());
        c.publish_done(0, 7, 0, None);
        assert_eq!(c.take_output(), vec![0x40, 2, 0, 7, 0xD0, 0]);
        assert_eq!(c.deadline(), 91.0);
    }

    #[test]
    fn a_311_publish_not_stored_gets_no_ack_and_ends_the_connection() {
        let mut c = Connection::new(settings(4), 0.0);
        let mut data = publish("a", b"1", 1, Some(7), 4);
        data.extend([0xC0, 0x00]); // PINGREQ after it
        let mut ev = Vec::new();
        c.receive(&data, 1.0, allow, &mut ev);
        c.publish_done(0, 7, 0x80, Some("not stored: the disk failed"));
        assert!(c.store_failed());
        assert_eq!(c.take_output(), vec![0xD0, 0], "the PINGRESP, no PUBACK");
        assert_eq!(c.answers_pending(), 0);
        let mut v5 = Connection::new(settings(5), 0.0);
        v5.receive(&publish("a", b"1", 1, Some(7), 5), 1.0, allow, &mut ev);
        v5.publish_done(0, 7, 0x80, None);
        assert!(!v5.store_failed(), "v5 says it in the PUBACK");
    }

    #[test]
    fn a_refusals_reason_string_only_if_asked_and_within_the_clients_limit() {
        let why = "not stored: no space left on the store's disk";
        let ack = |problem_info: bool, client_max_packet: usize| {
            let mut c = Connection::new(
                Settings {
                    problem_info,
                    client_max_packet,
                    ..settings(5)
                },
                0.0,
            );
            let mut ev = Vec::new();
            c.receive(&publish("a", b"1", 1, Some(7), 5), 1.0, allow, &mut ev);
            c.publish_done(0, 7, 0x97, Some(why));
            c.take_output()
        };
        let told = ack(true, 1 << 20);
        assert_eq!(
            told[..8],
            [
                0x40,
                7 + why.len() as u8,
                0,
                7,
                0x97,
                3 + why.len() as u8,
                0x1F,
                0
            ]
        );
        assert_eq!(&told[9..], why.as_bytes());
        // Request Problem Information 0: the code alone [MQTT-3.1.2-29].
        assert_eq!(ack(false, 1 << 20), vec![0x40, 3, 0, 7, 0x97]);
        // Cut to the client's Maximum Packet Size, or left out if under 8 characters.
        assert_eq!(ack(true, 16 + 10)[9..], why.as_bytes()[..10]);
        assert_eq!(ack(true, 16 + 7), vec![0x40, 3, 0, 7, 0x97]);
    }

    #[test]
    fn a_partial_packet_waits_for_the_rest() {
        let mut c = Connection::new(settings(4), 0.0);
        let data = publish("t", b"hello", 0, None, 4);
        let mut ev = Vec::new();
        c.receive(&data[..3], 0.0, allow, &mut ev);
        assert!(ev.is_empty());
        assert_eq!(c.unread().len(), 3);
        c.receive(&data[3..], 0.0, allow, &mut ev);
        assert_eq!(ev.len(), 1);
        assert!(c.unread().is_empty());
    }

    #[test]
    fn what_python_decides_is_handed_back_unread() {
        for (name, packet) in [
            ("retained", {
                let mut p = publish("t", b"x", 0, None, 4);
                p[0] |= 1;
                p
            }),
            ("qos 2", publish("t", b"x", 2, Some(1), 4)),
            ("$ topic", publish("$SYS/x", b"x", 0, None, 4)),
            ("subscribe", vec![0x82, 0x06, 0, 1, 0, 1, b'a', 0]),
            ("disconnect", vec![0xE0, 0x00]),
            ("malformed", vec![0x30, 0x02, 0xFF, 0xFF]),
        ] {
            let mut c = Connection::new(settings(4), 0.0);
            let mut data = publish("ok", b"1", 0, None, 4);
            data.extend(&packet);
            let after = publish("after", b"2", 0, None, 4);
            data.extend(&after);
            let mut ev = Vec::new();
            c.receive(&data, 0.0, allow, &mut ev);
            assert_eq!(ev.len(), 2, "{name}");
            assert_eq!(ev[1], Event::Demote, "{name}");
            assert_eq!(
                c.unread(),
                &data[data.len() - packet.len() - after.len()..],
                "{name}"
            );
            assert!(c.demoted());
        }
    }

    #[test]
    fn an_acl_miss_is_pythons() {
        let mut c = Connection::new(settings(4), 0.0);
        let mut ev = Vec::new();
        c.receive(
            &publish("secret", b"x", 0, None, 4),
            0.0,
            |_| Acl::AskPython,
            &mut ev,
        );
        assert_eq!(ev, vec![Event::Demote]);
    }

    #[test]
    fn aliases_resolve_and_receive_maximum_holds() {
        let mut c = Connection::new(settings(5), 0.0);
        let alias = |topic: &str, pid: u16| {
            let p = Publish {
                topic,
                payload: b"v",
                qos: 1,
                retain: false,
                dup: false,
                packet_id: Some(pid),
                properties: vec![Property {
                    id: properties::TOPIC_ALIAS,
                    value: Value::Int(3),
                }],
            };
            let mut out = Vec::new();
            encode_publish(&p, 5, &mut out).unwrap();
            out
        };
        let mut ev = Vec::new();
        c.receive(&alias("dev/1", 1), 0.0, allow, &mut ev);
        c.receive(&alias("", 2), 0.0, allow, &mut ev);
        assert!(matches!(&ev[1], Event::Publish { topic, .. } if topic == "dev/1"));
        // A third unacknowledged QoS 1 passes our Receive Maximum of 2: Python's 0x93,
        // which counts it behind the two not acknowledged when it was read, although
        // their PUBACKs go out before the hand-back.
        c.receive(&alias("", 3), 0.0, allow, &mut ev);
        assert_eq!(ev[2], Event::Demote);
        c.publish_done(0, 1, 0, None);
        c.publish_done(1, 2, 0, None);
        assert_eq!(c.answers_pending(), 0);
        assert_eq!(c.unacked_at_demote(), 2);
    }

    #[test]
    fn bytes_handed_over_are_read_behind_the_owners_unacknowledged() {
        let mut c = Connection::new(settings(5), 0.0);
        let mut ev = Vec::new();
        c.behind(2);
        c.receive(&publish("a", b"1", 1, Some(1), 5), 0.0, allow, &mut ev);
        c.caught_up(2);
        assert_eq!(
            ev,
            vec![Event::Demote],
            "a third one past our Receive Maximum of 2"
        );
        let mut c = Connection::new(settings(5), 0.0);
        c.behind(1);
        c.receive(&publish("a", b"1", 1, Some(1), 5), 0.0, allow, &mut ev);
        c.caught_up(1);
        c.publish_done(0, 1, 0, None);
        let two = [
            publish("a", b"2", 1, Some(2), 5),
            publish("a", b"3", 1, Some(3), 5),
        ];
        ev.clear();
        c.receive(&two.concat(), 0.0, allow, &mut ev);
        assert_eq!(ev.len(), 2, "caught up: the window is whole again");
    }

    #[test]
    fn deliveries_take_packet_ids_within_the_window() {
        let mut c = Connection::new(settings(4), 0.0);
        assert_eq!(c.window(), 3);
        assert_eq!(c.deliver("t", b"1", 1, false, (0, 0)), Ok(Some(1)));
        assert_eq!(c.deliver("t", b"2", 0, false, (0, 1)), Ok(None));
        assert_eq!(c.deliver("t", b"3", 1, false, (0, 2)), Ok(Some(2)));
        assert_eq!(c.window(), 1);
        let out = c.take_output();
        assert_eq!(out[..2], [0x32, 6]);
        let mut ev = Vec::new();
        c.receive(&[0x40, 2, 0, 1, 0x40, 2, 0, 9], 0.0, allow, &mut ev);
        assert_eq!(
            ev,
            vec![Event::Acked {
                packet_id: 1,
                source: (0, 0)
            }]
        );
        assert_eq!(c.window(), 2);
        c.settings.client_max_packet = 5;
        assert_eq!(c.deliver("t", b"too big", 1, false, (0, 3)), Err(Dropped));
        assert_eq!(
            c.next_packet_id(),
            3,
            "a dropped delivery gives its id back"
        );
    }
}
