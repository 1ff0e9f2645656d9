"""The sans-IO parts of store groups: the fork point of two epoch histories, the in-sync
set and the acks waiting on it, the controller's election rule, the metadata change log."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import trio

from store.common import StoreError
from store.metadata import COLUMN_FAMILIES, Metadata
from store.replication.controller import choose_master
from store.replication.epochs import EpochFile, fork_point, implicit
from store.replication.follower import moot_when_stopped
from store.replication.insync import InSync
from store.replication.metalog import MetaLog


def test_fork_point_cuts_only_what_the_master_does_not_have() -> None:
    master = [(0, 0), (1, 100), (3, 250)]
    # The old master of epoch 2 wrote 200..260 that nobody copied: cut at 200.
    assert fork_point(master, 400, [(0, 0), (1, 100), (2, 200)], 260) == 200
    # A replica that is simply behind keeps everything.
    assert fork_point(master, 400, [(0, 0), (1, 100)], 150) == 150
    assert fork_point(master, 400, [(0, 0), (1, 100), (3, 250)], 300) == 300
    # A replica of an epoch the master also had, but longer there: cut at its end.
    assert fork_point(master, 400, [(0, 0), (1, 100)], 280) == 250
    # Empty disk, or a log from before epochs.
    assert fork_point(master, 400, [], 0) == 0
    assert fork_point(master, 400, implicit([], 90), 90) == 90
    assert fork_point(master, 400, [(5, 0)], 90) == 0


def test_epoch_file_persists_and_refuses_going_back(tmp_path: Path) -> None:
    f = EpochFile(tmp_path)
    f.start(1, 0, 0)
    f.start(2, 500, 500)
    assert EpochFile(tmp_path).history == [(1, 0), (2, 500)]
    try:
        f.start(2, 600, 600)
    except ValueError:
        pass
    else:
        raise AssertionError("an epoch must be after the last one")
    g = EpochFile(tmp_path / "x")
    (tmp_path / "x").mkdir()
    g.start(4, 70, 70)  # a log written before epochs: epoch 0 from 0
    assert g.history == [(0, 0), (4, 70)]


def test_insync_acks_wait_for_every_member_of_the_committed_set() -> None:
    s = InSync("a", min_insync=2, max_lag_bytes=300, max_lag_s=5.0)
    assert not s.enough() and s.ack_offset(1000) == -1
    s.report("b", "b:1", 950, now=0.0, master_end=1000)  # within 300 bytes: caught up
    # b may join only once it holds everything acknowledged.
    assert s.desired(acked=1000) == {"a"} and s.desired(acked=900) == {"a", "b"}
    s.proposed = {"a", "b"}  # on its way to the controller: waited for already ...
    assert s.required() == {"b"} and not s.enough()  # ... but it does not count yet
    s.committed, s.proposed = {"a", "b"}, None
    assert s.members() == ["b"] and s.enough() and s.ack_offset(1200) == 950
    s.wait(1000, deadline=3.0, item="x")
    s.wait(1200, deadline=3.0, item="y")
    assert s.ready(s.ack_offset(1200)) == []  # b holds up to 950
    s.report("b", "b:1", 1000, now=1.0, master_end=1200)
    assert s.ready(s.ack_offset(1200)) == ["x"]
    assert s.expired(2.0) == [] and s.expired(3.5) == ["y"]
    s.report("c", "c:1", 0, now=1.0, master_end=1200)  # far behind: not caught up
    assert s.desired(acked=1000) == {"a", "b"}
    s.refresh(now=7.0, master_end=1200)  # b silent for 6 s: it should leave ...
    assert s.desired(acked=1000) == {"a"}
    assert s.required() == {"b"} and s.ack_offset(1200) == 1000  # ... once committed
    s.committed = {"a"}
    assert not s.enough() and s.ack_offset(1200) == -1


def test_election_rule() -> None:
    nodes = {"a": {"offset": 500, "last_epoch": 3, "acked": 480},
             "b": {"offset": 480, "last_epoch": 3},
             "c": {"offset": 470, "last_epoch": 2}}
    view = {"master": "a", "epoch": 3, "insync": ["a", "b", "c"], "nodes": nodes}
    dead = {"a": 10.0, "b": 0.5, "c": 0.5}  # seconds since the leader applied a report
    assert choose_master(view, dead, dead_s=4.0, group_size=3) == ("b", 4)
    alive = {"a": 3.0, "b": 0.5, "c": 0.5}
    assert choose_master(view, alive, dead_s=4.0, group_size=3) is None  # a alive
    nodes["a"]["acked"] = 400
    view["insync"] = ["a", "c"]
    assert choose_master(view, dead, dead_s=4.0, group_size=3) == ("c", 4)
    nodes["a"]["acked"] = 475  # c's log ends before what a acknowledged: not c
    assert choose_master(view, dead, dead_s=4.0, group_size=3) is None
    view["insync"] = ["a"]  # nobody in sync alive: no election (no acked data lost)
    assert choose_master(view, dead, dead_s=4.0, group_size=3) is None
    first = {"master": "", "epoch": 0, "insync": [], "nodes": {"a": nodes["b"]}}
    assert choose_master(first, {"a": 0.5}, dead_s=4.0, group_size=3) is None  # no majority
    first["nodes"]["c"] = nodes["c"]
    assert choose_master(first, {"a": 0.5, "c": 1.0}, dead_s=4.0, group_size=3) == ("a", 4)
    assert choose_master(first, {"a": 0.5}, dead_s=4.0, group_size=3) is None  # c unheard


def test_metalog_ops_or_snapshot() -> None:
    m = MetaLog(max_ops=3)
    assert m.since("other", 0) is None
    m.record([("put", "sessions", "c1", {"x": 1})])
    m.record([("delete", "sessions", "c0", None), ("put", "offsets", "k", 5)])
    assert m.since(m.incarnation, 0) == ([("put", "sessions", "c1", {"x": 1}),
                                         ("delete", "sessions", "c0", None),
                                         ("put", "offsets", "k", 5)], 3)
    assert m.since(m.incarnation, 3) == ([], 3)
    m.record([("put", "offsets", "k", 6)])
    assert m.since(m.incarnation, 0) is None  # op 1 is gone: a snapshot
    assert m.since(m.incarnation, 2) == ([("put", "offsets", "k", 5),
                                         ("put", "offsets", "k", 6)], 4)


def test_metadata_waits_for_every_required_replica() -> None:
    s = InSync("a", min_insync=2, max_lag_bytes=100, max_lag_s=5.0)
    assert s.meta_quorum(10) == -1  # the master alone
    s.report("b", "b:1", 1000, now=0.0, master_end=1000)
    s.committed = {"a", "b"}
    s.replicas["b"].meta = 7
    assert s.meta_quorum(10) == 7
    s.report("c", "c:1", 0, now=0.0, master_end=1000)  # not in the set: not waited for
    s.replicas["c"].meta = 10
    assert s.meta_quorum(10) == 7
    s.proposed = {"a", "b", "c"}
    s.replicas["c"].meta = 5  # proposed to join: waited for already
    assert s.meta_quorum(10) == 5


def test_metalog_answers_are_bounded_in_bytes() -> None:
    m = MetaLog()
    m.record([("put", "retained", f"t{i}", {"body": "x" * 1000}) for i in range(50)])
    ops, seq = m.since(m.incarnation, 0, max_bytes=10_000)
    assert len(ops) == 10 and seq == 10  # about 1 kB each: ten reach the bound
    ops, seq = m.since(m.incarnation, 10, max_bytes=10)
    assert len(ops) == 1 and seq == 11  # one at least, however big


def test_a_replica_amid_a_paged_snapshot_is_not_in_sync() -> None:
    s = InSync("a", min_insync=2, max_lag_bytes=100, max_lag_s=5.0)
    s.report("b", "b:1", 1000, now=0.0, master_end=1000, meta_complete=False)
    assert s.desired(acked=0) == {"a"}
    s.report("b", "b:1", 1000, now=0.1, master_end=1000, meta_complete=True)
    assert s.desired(acked=0) == {"a", "b"}


def test_a_snapshot_in_pages_read_amid_changes_then_the_changes_replayed(tmp_path: Path
                                                                          ) -> None:
    """Pages are read at different times; replaying every change since the first page
    over them gives the master's metadata exactly (changes are whole values)."""
    master, copy = Metadata(tmp_path / "m"), Metadata(tmp_path / "c")
    try:
        log = MetaLog()
        master.on_change = log.record
        for cf in ("sessions", "offsets", "retained"):
            for i in range(40):
                master.put(cf, f"k{i:02d}", {"v": i, "pad": "p" * 50})
        copy.put("users", "stale", {"gone": True})  # replaced by the first page
        seq0, cursor, first, pages = log.seq, None, True, 0
        while True:
            items, cursor = master.page(cursor, 600)
            copy.load_page(items, first)
            first, pages = False, pages + 1
            # the master changes amid the copy: before and after the cursor
            master.put("sessions", f"k{pages:02d}", {"v": -pages})
            master.delete("offsets", f"k{39 - pages:02d}")
            master.put("acl", f"new{pages}", {"p": pages})
            if cursor is None:
                break
        assert pages > 5
        ops, _ = log.since(log.incarnation, seq0, limit=10**6)
        copy.apply(ops)
        for cf in COLUMN_FAMILIES:
            assert list(copy.items(cf)) == list(master.items(cf)), cf
    finally:
        master.close()
        copy.close()


def test_a_full_master_is_replaced_at_once_and_a_full_node_never_elected() -> None:
    nodes = {"a": {"offset": 500, "last_epoch": 3, "acked": 480, "full": "0 bytes free"},
             "b": {"offset": 480, "last_epoch": 3},
             "c": {"offset": 490, "last_epoch": 3, "full": "no space left"}}
    view = {"master": "a", "epoch": 3, "insync": ["a", "b", "c"], "nodes": nodes}
    alive = {"a": 0.2, "b": 0.5, "c": 0.5}  # a reports: alive, but full
    assert choose_master(view, alive, dead_s=4.0, group_size=3) == ("b", 4)  # not c
    nodes["b"]["full"] = "no space left"
    assert choose_master(view, alive, dead_s=4.0, group_size=3) is None  # all full
    nodes["a"]["full"] = ""  # room again before anyone was elected: a stays
    assert choose_master(view, alive, dead_s=4.0, group_size=3) is None
    first = {"master": "", "epoch": 0, "insync": [], "nodes": nodes}
    assert choose_master(first, alive, dead_s=4.0, group_size=3) == ("a", 4)


def test_a_replica_that_cannot_write_leaves_the_set_and_comes_back() -> None:
    s = InSync("a", min_insync=2, max_lag_bytes=10**6, max_lag_s=5.0)
    s.report("b", "b:1", 1000, now=0.0, master_end=1000)
    s.committed = {"a", "b"}
    s.report("b", "b:1", 1000, now=0.1, master_end=1200, failed="no space left")
    assert s.desired(acked=1000) == {"a"}  # at once, not max_lag_s later
    s.report("b", "b:1", 1200, now=0.2, master_end=1200)
    assert s.desired(acked=1200) == {"a", "b"}


def test_space_full_on_an_error_or_a_low_disk_until_there_is_room() -> None:
    import errno

    from store.common import StoreFullError
    from store.replication.space import Space, no_space

    assert no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert no_space(StoreFullError("no space left on the store's disk"))
    assert no_space(Exception("IO error: No space left on device: While appending"))
    assert not no_space(OSError(errno.EIO, "I/O error"))
    s = Space(full_below=100, room_again=1000)
    assert s.measured(500) is None and s.full is None
    assert s.failed(OSError(errno.ENOSPC, "No space left on device")) and s.full
    assert not s.failed(OSError(errno.ENOSPC, "again"))  # full already
    assert s.measured(999) is None and s.full  # not room enough yet
    assert s.measured(1000) is False and s.full is None
    assert s.measured(99) is True and s.full == "99 bytes free on the disk"


async def _follow_stopped_as_it_fails(guarded: bool) -> bool:
    """A replica's follow stopped (its scope cancelled: a new role) just as its master
    closed the connection: trio's nursery holds both. Whether the stop went through."""
    with trio.CancelScope() as scope, \
            moot_when_stopped() if guarded else contextlib.nullcontext():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.sleep(0)
            scope.cancel()
            raise StoreError("replication from m: the master closed the connection")
    return scope.cancelled_caught


def test_a_follow_stopped_as_its_master_closes_ends_quietly() -> None:
    """Seen under a full disk's step-down: the failure left the scope beside the
    cancellation and ended the store node (the group then had no master to elect)."""
    with pytest.raises(BaseExceptionGroup):
        trio.run(_follow_stopped_as_it_fails, False)
    assert trio.run(_follow_stopped_as_it_fails, True)
