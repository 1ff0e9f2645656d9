//! What the native plane writes: PUBLISH (deliveries), PUBACK and PINGRESP, to the bytes
//! `gateway/mqtt/codec.py` makes, refusing what it refuses (its `ValueError`).

use super::decode::Publish;
use super::error::{refuse, EncodeError};
use super::properties::{self, has, Property, TOPIC_ALIAS};
use super::wire::{put_varint, topic_name_problem, varint_len, MAX_VARINT};
use super::{PUBACK, PUBLISH};

const PUBACK_REASONS: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];

fn check_version(version: u8) -> Result<(), EncodeError> {
    if (3..=5).contains(&version) {
        Ok(())
    } else {
        refuse(format!("unsupported protocol version {version}"))
    }
}

/// Append a PUBLISH for protocol level `version`. The topic may be empty only with a v5
/// topic alias; `packet_id` is None for QoS 0 and 1..65535 otherwise.
pub fn encode_publish(p: &Publish<'_>, version: u8, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let aliased = p.topic.is_empty() && version == 5 && has(&p.properties, TOPIC_ALIAS);
    if !aliased {
        if let Some(why) = topic_name_problem(p.topic) {
            return refuse(why);
        }
    }
    let mut b0 = 0x30 | (p.qos << 1) | u8::from(p.retain);
    let pid = match (p.qos, p.packet_id) {
        (1 | 2, Some(id)) if id > 0 => {
            if p.dup {
                b0 |= 0x08;
            }
            Some(id)
        }
        (1 | 2, _) => return refuse(format!("packet id must be 1..65535, got {:?}", p.packet_id)),
        (0, None) if !p.dup => None,
        (0, _) => return refuse("a QoS 0 PUBLISH has no packet id and no DUP flag"),
        (qos, _) => return refuse(format!("QoS must be 0, 1 or 2, got {qos}")),
    };
    check_version(version)?;
    // The property block; v5 without properties is one zero byte (no buffer for it).
    let block = match version {
        5 if !p.properties.is_empty() => {
            let mut block = Vec::new();
            properties::encode(&p.properties, PUBLISH, &mut block)?;
            Some(block)
        }
        5 => None,
        _ if !p.properties.is_empty() => return refuse("PUBLISH properties need MQTT 5"),
        _ => None,
    };
    let props: &[u8] = match (&block, version) {
        (Some(block), _) => block,
        (None, 5) => &[0],
        (None, _) => &[],
    };
    let rl = 2 + p.topic.len() + if pid.is_some() { 2 } else { 0 } + props.len() + p.payload.len();
    if rl > MAX_VARINT as usize {
        return refuse(format!("PUBLISH of {rl} bytes is too large to encode"));
    }
    out.reserve(1 + varint_len(rl) + rl);
    out.push(b0);
    put_varint(out, rl as u32)?;
    out.extend_from_slice(&(p.topic.len() as u16).to_be_bytes());
    out.extend_from_slice(p.topic.as_bytes());
    if let Some(id) = pid {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out.extend_from_slice(props);
    out.extend_from_slice(p.payload);
    Ok(())
}

/// Append a PUBACK. Before MQTT 5 only reason code 0 and no properties can be said; v5
/// leaves out what it may (a success without properties is 4 bytes).
pub fn encode_ack(
    packet_id: u16,
    reason_code: u8,
    props: &[Property<'_>],
    version: u8,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    check_version(version)?;
    if packet_id == 0 {
        return refuse("packet id must be 1..65535, got 0");
    }
    let valid = PUBACK_REASONS.contains(&reason_code);
    let id = packet_id.to_be_bytes();
    if props.is_empty() {
        if reason_code == 0 {
            out.extend_from_slice(&[0x40, 2, id[0], id[1]]);
            return Ok(());
        }
        if version == 5 && valid {
            out.extend_from_slice(&[0x40, 3, id[0], id[1], reason_code]);
            return Ok(());
        }
    }
    if version != 5 {
        return refuse("reason codes and properties on PUBACK need MQTT 5");
    }
    if !valid {
        return refuse(format!("invalid PUBACK reason code {reason_code}"));
    }
    let mut body = vec![id[0], id[1], reason_code];
    properties::encode(props, PUBACK, &mut body)?;
    out.push(0x40);
    put_varint(out, body.len() as u32)?;
    out.extend_from_slice(&body);
    Ok(())
}

pub fn encode_pingresp(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0xD0, 0x00]);
}
