"""Light queues: many small queues over one log. Topic names and filters and how they
match, which queues a message belongs to (its exact topic, the wildcard filters it
matches, a partition of its first-level topic), the index that finds a queue's entries in
the CommitLog, and where a replay starts. Shared by the store and the gateway; it knows
neither."""
