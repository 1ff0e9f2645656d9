"""Store groups: CommitLog and metadata replication, in-sync replicas, epochs, and the
embedded Raft controller (pysyncobj) that elects the master. See docs/store-groups.md."""
