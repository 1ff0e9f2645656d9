//! Lightgate's native data plane: the parts of the per-message path that an interpreter
//! makes slow, as a library the Python side calls through one crossing (`py`).
//!
//! The modules mirror the Python rooms they implement, so a reader can go from one to
//! the other; the Python code stays the reference for every rule:
//! - `record`: the CommitLog record (`store/record.py`), byte for byte.
//! - `commitlog`: the log's tail, segment writes and rolls (`store/commitlog.py`).
//! - `router`: the topic-filter trie (`lightqueue/trie.py`): who a message goes to.
//! - `codec`: MQTT framing, decoding and encoding (`gateway/mqtt/codec.py`).
//! - `protocol`: one connection's steady state after CONNACK (`gateway/mqtt/protocol.py`).
//! - `reactor`: the threads that own promoted sockets (`gateway/reactor.py`).
//! - `partial`: the node's budget for partly received packets, both planes'
//!   (`serving/read_budget.py`).
//! - `engine`: append, acknowledge and deliver each batch the reactors read.
//! - `index`: the light-queue index's runs for a batch (`lightqueue/index.py`).
//! - `backlog`, `ring`: rounds of a subscriber that fell behind, from the log's
//!   segments; the newest index entries of the queues such subscribers read.
//! - `tls`: the TLS listeners' configuration, its reload and client identities
//!   (`gateway/transports.py`).
//! - `frame`: the store's native protocol framing (`store/protocol.py`).
//! - `client`: a client of the store's native protocol (`store/client.py`).
//! - `remote`: the reactors' appends to a store elsewhere (`lightgate gateway`).
//! - `readers`: the subscribers a gateway node carries, and their positions.
//! - `subs`: the carried subscriptions, and who a message goes to (both engines).
//! - `replica`: a store group's replica copying its master's log (`store/replication/
//!   follower.py`'s steady state), through the engine.
//! - `server`: the store's native protocol for the connections Python hands over
//!   (`store/server.py`): PUBLISH appended here, the rest answered by Python.
//!
//! Everything outside `py` is plain, safe Rust with no Python in it: `cargo test` runs
//! it without an interpreter.

// No unsafe code but at the crossing (`py`), where a socket Python hands over becomes
// a Rust-owned one.
#![deny(unsafe_code)]

pub mod backlog;
pub mod client;
pub mod codec;
pub mod commitlog;
pub mod engine;
pub mod fetch;
pub mod frame;
pub mod index;
pub mod link;
pub mod partial;
pub mod protocol;
pub mod reactor;
pub mod readers;
pub mod record;
pub mod remote;
pub mod replica;
pub mod ring;
pub mod router;
pub mod server;
pub mod subs;
pub mod tls;
pub mod ws;

#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_replica;
#[cfg(feature = "python")]
mod py_server;
