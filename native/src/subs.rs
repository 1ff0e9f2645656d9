//! The subscriptions of the connections an engine carries, and who a stored message
//! goes to: shared by the engine whose store is in-process (`engine`) and a gateway
//! node's (`readers`), so that both planes match a message the same way.

use std::collections::HashMap;
use std::sync::Arc;

use crate::reactor::Positions;
use crate::router::{FilterError, TopicTrie};

pub struct Sub {
    pub conn: u64,
    pub qos: u8,
    /// The connection's protocol version: what a message must not lose for it.
    pub version: u8,
    /// The filter, which names the light queue the subscription reads.
    pub filter: Arc<str>,
}

#[derive(Default)]
pub struct Subs {
    pub trie: TopicTrie<u64>,
    pub table: HashMap<u64, Sub>,
    /// conn -> filter -> subscription id: a connection's own go at once when it leaves.
    pub by_conn: HashMap<u64, HashMap<String, u64>>,
    pub next_id: u64,
}

/// One connection a message goes to: the highest QoS of its matching filters, its
/// protocol version, and the message's offset in each of their queues.
pub struct Target {
    pub qos: u8,
    pub version: u8,
    pub positions: Positions,
}

impl Subs {
    /// `conn` receives what matches `topic_filter`, at most at `qos` (a repeated
    /// SUBSCRIBE replaces its options).
    pub fn add(
        &mut self,
        conn: u64,
        topic_filter: &str,
        qos: u8,
        version: u8,
    ) -> Result<(), FilterError> {
        if let Some(&id) = self.by_conn.get(&conn).and_then(|f| f.get(topic_filter)) {
            if let Some(s) = self.table.get_mut(&id) {
                s.qos = qos;
            }
            return Ok(());
        }
        let id = self.next_id;
        self.trie.add(topic_filter, id)?;
        self.next_id += 1;
        self.table.insert(
            id,
            Sub {
                conn,
                qos,
                version,
                filter: Arc::from(topic_filter),
            },
        );
        self.by_conn
            .entry(conn)
            .or_default()
            .insert(topic_filter.to_string(), id);
        Ok(())
    }

    /// Every subscription of `conn` goes; what they were.
    pub fn remove_conn(&mut self, conn: u64) -> Vec<Sub> {
        let mut gone = Vec::new();
        for (f, id) in self.by_conn.remove(&conn).unwrap_or_default() {
            if let Some(s) = self.table.remove(&id) {
                gone.push(s);
            }
            self.trie.remove(&f, id);
        }
        gone
    }

    /// Each connection with a subscription matching `topic`, once, with the message's
    /// offset in each of its matching filters' queues that `queues` names.
    pub fn targets<Q: AsRef<str>>(&self, topic: &str, queues: &[(Q, u64)]) -> HashMap<u64, Target> {
        let mut best: HashMap<u64, Target> = HashMap::new();
        if self.table.is_empty() {
            return best;
        }
        self.trie.for_each_match(topic, |_, id| {
            if let Some(s) = self.table.get(&id) {
                let t = best.entry(s.conn).or_insert(Target {
                    qos: 0,
                    version: s.version,
                    positions: Vec::new(),
                });
                t.qos = t.qos.max(s.qos);
                if let Some((_, offset)) =
                    queues.iter().find(|(name, _)| name.as_ref() == &*s.filter)
                {
                    t.positions.push((Arc::clone(&s.filter), *offset));
                }
            }
        });
        best
    }
}
