"""The store: the CommitLog every message is appended to, the light-queue index over it,
metadata (sessions, offsets, retained messages, users and policies), the native protocol
that gateways and applications speak to it, and store groups (replication, failover).
Other rooms use it through store.api only."""
