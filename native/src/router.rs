//! Topic-filter trie: which filters (and their values) match a topic name, by the rules
//! of `lightqueue/trie.py` and `lightqueue/topic.py`, the reference.
//!
//! The native plane matches every appended message against the subscriptions of the
//! connections it carries: values are subscription handles, and a match walks the
//! topic's levels once, breadth-first. Each node is reached by one path only, so it
//! enters the frontier at most once: the cost is bounded by the nodes visited, whatever
//! the filter set, and nothing recurses (a 1,000-level topic is no deeper a stack).

use std::collections::HashMap;
use std::hash::Hash;

/// Why a topic filter is not one (the texts of `lightqueue.topic.TopicError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FilterError {
    Empty,
    Nul,
    TooLong,
    HashNotLast,
    PlusNotWhole,
}

impl std::fmt::Display for FilterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FilterError::Empty => "topic filter must be at least one character long",
            FilterError::Nul => "topic filter must not contain U+0000",
            FilterError::TooLong => "topic filter is longer than 65535 bytes",
            FilterError::HashNotLast => "'#' must be a whole last level",
            FilterError::PlusNotWhole => "'+' must be a whole level",
        })
    }
}

impl std::error::Error for FilterError {}

pub const MAX_TOPIC_BYTES: usize = 65535;

/// `topic_filter` if it is a valid subscription filter (MQTT 3.1.1 and 5.0 §4.7).
pub fn validate_filter(topic_filter: &str) -> Result<&str, FilterError> {
    if topic_filter.is_empty() {
        return Err(FilterError::Empty);
    }
    if topic_filter.contains('\0') {
        return Err(FilterError::Nul);
    }
    if topic_filter.len() > MAX_TOPIC_BYTES {
        return Err(FilterError::TooLong);
    }
    let levels: Vec<&str> = topic_filter.split('/').collect();
    let last = levels.len() - 1;
    for (i, level) in levels.iter().enumerate() {
        if level.contains('#') && (*level != "#" || i != last) {
            return Err(FilterError::HashNotLast);
        }
        if level.contains('+') && *level != "+" {
            return Err(FilterError::PlusNotWhole);
        }
    }
    Ok(topic_filter)
}

/// Whether `topic` matches `topic_filter`, level by level: the plain statement of the
/// rules that the trie's walk must agree with. A `$`-topic never matches a leading
/// wildcard (§4.7.2).
pub fn matches(topic_filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && (topic_filter.starts_with('+') || topic_filter.starts_with('#')) {
        return false;
    }
    let f: Vec<&str> = topic_filter.split('/').collect();
    let t: Vec<&str> = topic.split('/').collect();
    for (i, level) in f.iter().enumerate() {
        if *level == "#" {
            return true; // 'a/#' matches 'a' too: the parent level
        }
        match t.get(i) {
            None => return false,
            Some(name) if *level != "+" && level != name => return false,
            _ => {}
        }
    }
    f.len() == t.len()
}

struct Node<V> {
    children: HashMap<Box<str>, usize>,
    plus: Option<usize>,
    /// The filter ending exactly here, and the filter ending in `#` here, with values.
    exact: Option<(Box<str>, Vec<V>)>,
    hash: Option<(Box<str>, Vec<V>)>,
}

impl<V> Node<V> {
    fn new() -> Self {
        Node {
            children: HashMap::new(),
            plus: None,
            exact: None,
            hash: None,
        }
    }

    fn empty(&self) -> bool {
        self.children.is_empty()
            && self.plus.is_none()
            && self.exact.is_none()
            && self.hash.is_none()
    }
}

/// Filters to values. Nodes live in one arena (indices, no `Rc`), and freed slots are
/// reused, so a table that churns with connections does not grow.
pub struct TopicTrie<V> {
    nodes: Vec<Node<V>>,
    free: Vec<usize>,
    len: usize,
}

impl<V: Copy + Eq + Hash> Default for TopicTrie<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V: Copy + Eq + Hash> TopicTrie<V> {
    pub fn new() -> Self {
        TopicTrie {
            nodes: vec![Node::new()],
            free: Vec::new(),
            len: 0,
        }
    }

    /// Number of (filter, value) pairs.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn alloc(&mut self) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Node::new();
                i
            }
            None => {
                self.nodes.push(Node::new());
                self.nodes.len() - 1
            }
        }
    }

    fn split(topic_filter: &str) -> (Vec<&str>, bool) {
        let mut levels: Vec<&str> = topic_filter.split('/').collect();
        let hash_last = levels.last() == Some(&"#");
        if hash_last {
            levels.pop();
        }
        (levels, hash_last)
    }

    /// Add (filter, value); true if it was not there yet.
    pub fn add(&mut self, topic_filter: &str, value: V) -> Result<bool, FilterError> {
        validate_filter(topic_filter)?;
        let (levels, hash_last) = Self::split(topic_filter);
        let mut node = 0;
        for level in levels {
            node = if level == "+" {
                match self.nodes[node].plus {
                    Some(n) => n,
                    None => {
                        let n = self.alloc();
                        self.nodes[node].plus = Some(n);
                        n
                    }
                }
            } else {
                match self.nodes[node].children.get(level) {
                    Some(&n) => n,
                    None => {
                        let n = self.alloc();
                        self.nodes[node].children.insert(level.into(), n);
                        n
                    }
                }
            };
        }
        let slot = if hash_last {
            &mut self.nodes[node].hash
        } else {
            &mut self.nodes[node].exact
        };
        let (_, values) = slot.get_or_insert_with(|| (topic_filter.into(), Vec::new()));
        if values.contains(&value) {
            return Ok(false);
        }
        values.push(value);
        self.len += 1;
        Ok(true)
    }

    /// Remove (filter, value), pruning nodes left empty; true if it was there.
    pub fn remove(&mut self, topic_filter: &str, value: V) -> bool {
        if validate_filter(topic_filter).is_err() {
            return false;
        }
        let (levels, hash_last) = Self::split(topic_filter);
        let mut path = vec![0usize];
        for level in &levels {
            let node = &self.nodes[*path.last().unwrap_or(&0)];
            let next = if *level == "+" {
                node.plus
            } else {
                node.children.get(*level).copied()
            };
            match next {
                Some(n) => path.push(n),
                None => return false,
            }
        }
        let end = *path.last().unwrap_or(&0);
        let slot = if hash_last {
            &mut self.nodes[end].hash
        } else {
            &mut self.nodes[end].exact
        };
        let Some((_, values)) = slot.as_mut() else {
            return false;
        };
        let Some(i) = values.iter().position(|v| *v == value) else {
            return false;
        };
        values.swap_remove(i);
        self.len -= 1;
        if values.is_empty() {
            *slot = None;
        }
        for depth in (1..path.len()).rev() {
            let (child, parent) = (path[depth], path[depth - 1]);
            if !self.nodes[child].empty() {
                break;
            }
            let level = levels[depth - 1];
            if level == "+" {
                self.nodes[parent].plus = None;
            } else {
                self.nodes[parent].children.remove(level);
            }
            self.free.push(child);
        }
        true
    }

    /// Call `found(filter, value)` for every (filter, value) whose filter matches the
    /// topic name `topic`. A filter is reported once, however the walk reaches it.
    pub fn for_each_match(&self, topic: &str, mut found: impl FnMut(&str, V)) {
        let mut report = |slot: &Option<(Box<str>, Vec<V>)>| {
            if let Some((f, values)) = slot {
                for v in values {
                    found(f, *v);
                }
            }
        };
        // '+' and '#' as the first level never match a $-topic; deeper wildcards do.
        let mut wild = !topic.starts_with('$');
        let mut frontier = vec![0usize];
        let mut next = Vec::new();
        for level in topic.split('/') {
            next.clear();
            for &n in &frontier {
                let node = &self.nodes[n];
                if wild {
                    report(&node.hash);
                    if let Some(p) = node.plus {
                        next.push(p);
                    }
                }
                if let Some(&c) = node.children.get(level) {
                    next.push(c);
                }
            }
            if next.is_empty() {
                return;
            }
            std::mem::swap(&mut frontier, &mut next);
            wild = true;
        }
        for &n in &frontier {
            let node = &self.nodes[n];
            report(&node.exact);
            report(&node.hash); // 'a/#' also matches 'a'
        }
    }

    /// The values of every filter matching `topic`, each once.
    pub fn matching(&self, topic: &str) -> Vec<V> {
        let mut out = Vec::new();
        self.for_each_match(topic, |_, v| {
            if !out.contains(&v) {
                out.push(v);
            }
        });
        out
    }

    /// The distinct filters (with at least one value) that match `topic`.
    pub fn matching_filters(&self, topic: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        self.for_each_match(topic, |f, _| {
            if out.last().map(String::as_str) != Some(f) && !out.iter().any(|x| x == f) {
                out.push(f.to_string());
            }
        });
        out
    }
}

/// Which light queues one message belongs to (`lightqueue/routing.py`'s `Router.route`):
/// its exact-topic queue, every registered wildcard queue whose filter matches (in
/// sorted order), and one partition `first#N` of its first-level topic, N the CRC-32 of
/// the topic modulo that topic's partitions. Deterministic: the native append routes a
/// message exactly as the Python store would.
pub struct Routes {
    wildcards: TopicTrie<()>,
    partitions: HashMap<String, u32>,
    default_partitions: u32,
}

impl Routes {
    pub fn new(default_partitions: u32) -> Self {
        Routes {
            wildcards: TopicTrie::new(),
            partitions: HashMap::new(),
            default_partitions: default_partitions.max(1),
        }
    }

    pub fn register_wildcard(&mut self, topic_filter: &str) -> Result<bool, FilterError> {
        self.wildcards.add(topic_filter, ())
    }

    pub fn unregister_wildcard(&mut self, topic_filter: &str) -> bool {
        self.wildcards.remove(topic_filter, ())
    }

    pub fn set_partitions(&mut self, first_level: &str, partitions: u32) {
        self.partitions
            .insert(first_level.to_string(), partitions.max(1));
    }

    /// The queues of a message published on `topic`, the exact-topic queue first.
    pub fn route(&self, topic: &str) -> Vec<String> {
        let mut filters = self.wildcards.matching_filters(topic);
        // Python sorts str by code point; UTF-8 byte order is the same order.
        filters.sort_unstable();
        let first = topic.split('/').next().unwrap_or(topic);
        let parts = self
            .partitions
            .get(first)
            .copied()
            .unwrap_or(self.default_partitions);
        let partition = crc32fast::hash(topic.as_bytes()) % parts;
        let mut out = Vec::with_capacity(filters.len() + 2);
        out.push(topic.to_string());
        out.extend(filters);
        out.push(format!("{first}#{partition}"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_rules() {
        assert!(matches("a/+/c", "a/b/c"));
        assert!(matches("a/#", "a"));
        assert!(matches("#", "a/b"));
        assert!(!matches("#", "$SYS/x"));
        assert!(!matches("+/x", "$SYS/x"));
        assert!(matches("$SYS/#", "$SYS/x"));
        assert!(matches("a//c", "a//c"));
        assert!(matches("+/+", "/x"));
        assert!(!matches("a/+", "a"));
    }

    #[test]
    fn validation() {
        assert_eq!(validate_filter(""), Err(FilterError::Empty));
        assert_eq!(validate_filter("a/#/b"), Err(FilterError::HashNotLast));
        assert_eq!(validate_filter("a/b+"), Err(FilterError::PlusNotWhole));
        assert_eq!(validate_filter("a\0"), Err(FilterError::Nul));
        assert!(validate_filter("+/#").is_ok());
    }

    #[test]
    fn add_match_remove() {
        let mut t = TopicTrie::new();
        assert!(t.add("home/+/temp", 1).unwrap());
        assert!(!t.add("home/+/temp", 1).unwrap());
        assert!(t.add("home/#", 2).unwrap());
        assert!(t.add("home/bath/temp", 3).unwrap());
        let mut got = t.matching("home/bath/temp");
        got.sort();
        assert_eq!(got, vec![1, 2, 3]);
        assert!(t.remove("home/#", 2));
        assert!(!t.remove("home/#", 2));
        let mut got = t.matching("home/bath/temp");
        got.sort();
        assert_eq!(got, vec![1, 3]);
        assert!(t.remove("home/+/temp", 1));
        assert!(t.remove("home/bath/temp", 3));
        assert!(t.is_empty());
        assert_eq!(
            t.nodes.len() - t.free.len(),
            1,
            "every node but the root pruned"
        );
    }

    #[test]
    fn routes_exact_wildcards_and_a_partition() {
        let mut r = Routes::new(4);
        r.register_wildcard("home/#").unwrap();
        r.register_wildcard("home/+/temp").unwrap();
        r.set_partitions("plant", 1);
        let route = r.route("home/bath/temp");
        assert_eq!(&route[..3], ["home/bath/temp", "home/#", "home/+/temp"]);
        let n = crc32fast::hash(b"home/bath/temp") % 4;
        assert_eq!(route[3], format!("home#{n}"));
        assert_eq!(
            r.route("plant/x"),
            vec!["plant/x".to_string(), "plant#0".to_string()]
        );
    }

    #[test]
    fn deep_topics_do_not_recurse() {
        let deep = vec!["x"; 10_000].join("/");
        let mut t = TopicTrie::new();
        t.add(&deep, 7).unwrap();
        t.add("#", 8).unwrap();
        assert_eq!(t.matching(&deep).len(), 2);
    }

    fn level() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("".to_string()),
            Just("$s".to_string())
        ]
    }

    fn filter() -> impl Strategy<Value = String> {
        (
            proptest::collection::vec(prop_oneof![level(), Just("+".to_string())], 1..4),
            any::<bool>(),
        )
            .prop_map(|(mut levels, hash)| {
                if hash {
                    levels.push("#".to_string());
                }
                levels.join("/")
            })
    }

    fn topic() -> impl Strategy<Value = String> {
        proptest::collection::vec(level(), 1..5).prop_map(|l| l.join("/"))
    }

    proptest! {
        #[test]
        fn the_walk_agrees_with_the_rules(
            filters in proptest::collection::vec(filter(), 0..12),
            removed in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
            topics in proptest::collection::vec(topic(), 1..8),
        ) {
            let mut t = TopicTrie::new();
            let mut live: Vec<(String, usize)> = Vec::new();
            for (i, f) in filters.iter().enumerate() {
                match t.add(f, i) {
                    Ok(true) => live.push((f.clone(), i)),
                    Ok(false) => {}
                    Err(_) => prop_assert!(validate_filter(f).is_err()),
                }
            }
            for r in removed {
                if !live.is_empty() {
                    let (f, v) = live.remove(r.index(live.len()));
                    prop_assert!(t.remove(&f, v));
                }
            }
            prop_assert_eq!(t.len(), live.len());
            for topic in &topics {
                let mut got = t.matching(topic);
                got.sort();
                let mut want: Vec<usize> =
                    live.iter().filter(|(f, _)| matches(f, topic)).map(|(_, v)| *v).collect();
                want.sort();
                prop_assert_eq!(got, want, "topic {}", topic);
            }
        }
    }
}
