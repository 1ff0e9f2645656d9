//! The CommitLog's tail, as `store/commitlog.py` writes it: encoded records appended to
//! segment files named by their base offset (20 zero-padded digits), a new segment when
//! the next record would not fit, and a batch undone whole when any write fails.
//!
//! This is the writer only. Recovery, reads, retention and the segment list readers use
//! stay with the Python CommitLog, which hands the writer the tail it recovered
//! (`open`) and learns of each new segment from what `append` returns.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A segment file's name: its base offset, 20 digits (`store/segment.py`).
pub fn segment_name(base: u64) -> String {
    format!("{base:020}")
}

/// Make the directory's entries (a file just created) durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// What one `append` did: where each record starts, and the segments it began.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Appended {
    pub positions: Vec<u64>,
    pub new_segments: Vec<u64>,
}

pub struct LogWriter {
    dir: PathBuf,
    segment_size: u64,
    file: File,
    active_base: u64,
    write_pos: u64,
    flushed: u64,
    /// Why the tail cannot be trusted any more (an fsync or an undo failed), if so.
    broken: Option<String>,
    /// Moves at each `undo`: a sync begun before one no longer says what is durable.
    generation: u64,
}

/// An fsync of the tail to run outside the writer's lock (`LogWriter::sync_ticket`), so
/// that appends go on while the disk works: another handle on the active segment, the
/// end it makes durable, and the writer's generation when it was taken.
pub struct SyncTicket {
    file: File,
    target: u64,
    generation: u64,
}

impl SyncTicket {
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

impl LogWriter {
    /// Take over the tail: the active segment starting at `active_base`, the log ending
    /// at `write_pos` (what recovery verified, all of it durable).
    pub fn open(
        dir: &Path,
        segment_size: u64,
        active_base: u64,
        write_pos: u64,
    ) -> io::Result<Self> {
        if write_pos < active_base || segment_size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "tail outside its segment",
            ));
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(segment_name(active_base)))?;
        if file.metadata()?.len() != write_pos - active_base {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the active segment's size disagrees with the recovered end",
            ));
        }
        Ok(LogWriter {
            dir: dir.to_path_buf(),
            segment_size,
            file,
            active_base,
            write_pos,
            flushed: write_pos,
            broken: None,
            generation: 0,
        })
    }

    pub fn write_pos(&self) -> u64 {
        self.write_pos
    }

    pub fn flushed(&self) -> u64 {
        self.flushed
    }

    pub fn active_base(&self) -> u64 {
        self.active_base
    }

    /// Why the writer refuses appends: after a failed fsync the page cache's state is
    /// unknown, and after a failed undo the tail is; either stops the log for good.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Append `records` in order, rolling to a new segment where the next one would not
    /// fit (a record never spans two; a segment holds at least one). On any error the
    /// log is cut back to where it was and the segments this call began are removed.
    pub fn append(&mut self, records: &[&[u8]]) -> io::Result<Appended> {
        self.append_synced(records, false)
    }

    /// `append`, made durable before it returns when `sync` (`--flush sync`); a failed
    /// fsync undoes the batch too, and leaves the writer broken.
    pub fn append_synced(&mut self, records: &[&[u8]], sync: bool) -> io::Result<Appended> {
        if let Some(why) = &self.broken {
            return Err(io::Error::other(why.clone()));
        }
        let start_pos = self.write_pos;
        let start_base = self.active_base;
        let mut done = Appended::default();
        let mut pending: Vec<u8> = Vec::new();
        let mut pos = self.write_pos;
        for rec in records {
            let len = rec.len() as u64;
            if pos - self.active_base + len > self.segment_size && pos > self.active_base {
                if let Err(e) = self.write_all(&pending).and_then(|()| self.roll(pos)) {
                    self.undo(start_pos, start_base, &done.new_segments);
                    return Err(e);
                }
                pending.clear();
                done.new_segments.push(pos);
            }
            done.positions.push(pos);
            pending.extend_from_slice(rec);
            pos += len;
        }
        if let Err(e) = self.write_all(&pending) {
            self.undo(start_pos, start_base, &done.new_segments);
            return Err(e);
        }
        if sync {
            if let Err(e) = self.sync() {
                self.undo(start_pos, start_base, &done.new_segments);
                return Err(e);
            }
        }
        Ok(done)
    }

    /// A replica's copy (`CommitLog.write_raw`): the master's whole records as they are,
    /// at the end, in one write; `roll_first` when the master's segment starts here (no
    /// roll by size: the master's offsets map to the same files). Undone on any error,
    /// the roll too. The base of the segment it began, if it rolled.
    pub fn append_raw(
        &mut self,
        data: &[u8],
        roll_first: bool,
        sync: bool,
    ) -> io::Result<Option<u64>> {
        if let Some(why) = &self.broken {
            return Err(io::Error::other(why.clone()));
        }
        let start_pos = self.write_pos;
        let start_base = self.active_base;
        let mut began = Vec::new();
        let written = (|| {
            if roll_first {
                self.roll(start_pos)?;
                began.push(start_pos);
            }
            self.write_all(data)?;
            if sync {
                self.sync()?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            self.undo(start_pos, start_base, &began);
            return Err(e);
        }
        Ok(began.first().copied())
    }

    fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all(data)?;
        self.write_pos += data.len() as u64;
        Ok(())
    }

    /// A new segment from `base` on: the old one made durable first (a closed segment
    /// always is), the new name made durable before anything in it is acknowledged.
    fn roll(&mut self, base: u64) -> io::Result<()> {
        self.sync_file()?;
        self.flushed = self.write_pos;
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(self.dir.join(segment_name(base)))?;
        fsync_dir(&self.dir)?;
        self.file = file;
        self.active_base = base;
        Ok(())
    }

    /// Cut back to `start_pos` after a failed write (a full disk): the segments begun
    /// since go, the one that was active is truncated to where it ended.
    fn undo(&mut self, start_pos: u64, start_base: u64, began: &[u64]) {
        for base in began {
            let _ = fs::remove_file(self.dir.join(segment_name(*base)));
        }
        let path = self.dir.join(segment_name(start_base));
        let reopened = OpenOptions::new().append(true).open(&path).and_then(|f| {
            f.set_len(start_pos - start_base)?;
            Ok(f)
        });
        match reopened {
            Ok(f) => self.file = f,
            Err(e) => {
                self.broken = Some(format!("the log's tail could not be restored: {e}"));
            }
        }
        self.active_base = start_base;
        self.write_pos = start_pos;
        self.flushed = self.flushed.min(start_pos);
        self.generation += 1;
    }

    /// Make everything written durable; returns the durable end.
    pub fn sync(&mut self) -> io::Result<u64> {
        if self.flushed < self.write_pos {
            self.sync_file()?;
            self.flushed = self.write_pos;
        }
        Ok(self.flushed)
    }

    /// What an fsync of everything written so far needs, taken under the writer's lock
    /// and run without it; None if all of it is durable. (A segment rolled meanwhile
    /// was made durable by the roll.)
    pub fn sync_ticket(&self) -> io::Result<Option<SyncTicket>> {
        if let Some(why) = &self.broken {
            return Err(io::Error::other(why.clone()));
        }
        if self.flushed >= self.write_pos {
            return Ok(None);
        }
        Ok(Some(SyncTicket {
            file: self.file.try_clone()?,
            target: self.write_pos,
            generation: self.generation,
        }))
    }

    /// What a ticket's fsync did, back under the lock: the durable end. A failed one
    /// stops the log, as a failed `sync` does; one that an undo overtook says nothing.
    pub fn synced(&mut self, ticket: &SyncTicket, result: io::Result<()>) -> io::Result<u64> {
        match result {
            Err(e) => {
                self.broken.get_or_insert(format!("fsync failed: {e}"));
                Err(e)
            }
            Ok(()) => {
                if ticket.generation == self.generation {
                    self.flushed = self.flushed.max(ticket.target);
                }
                Ok(self.flushed)
            }
        }
    }

    fn sync_file(&mut self) -> io::Result<()> {
        if let Some(why) = &self.broken {
            return Err(io::Error::other(why.clone()));
        }
        let synced = self.file.sync_data();
        if let Err(e) = &synced {
            self.broken = Some(format!("fsync failed: {e}"));
        }
        synced
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lg-native-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn appends_and_rolls() {
        let dir = tmp("roll");
        let mut w = LogWriter::open(&dir, 100, 0, 0).unwrap();
        let recs: Vec<Vec<u8>> = (0..5).map(|i| vec![i as u8; 40]).collect();
        let refs: Vec<&[u8]> = recs.iter().map(Vec::as_slice).collect();
        let got = w.append(&refs).unwrap();
        assert_eq!(got.positions, vec![0, 40, 80, 120, 160]);
        assert_eq!(got.new_segments, vec![80, 160]);
        assert_eq!(w.write_pos(), 200);
        assert_eq!(w.flushed(), 160, "a rolled segment is durable");
        assert_eq!(w.sync().unwrap(), 200);
        let mut names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            vec![segment_name(0), segment_name(80), segment_name(160)]
        );
        assert_eq!(fs::read(dir.join(segment_name(80))).unwrap().len(), 80);
        // A record larger than a segment still gets one of its own.
        let big = vec![9u8; 300];
        assert_eq!(w.append(&[&big]).unwrap().new_segments, vec![200]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_sync_outside_the_lock_makes_durable_what_was_written_before_it() {
        let dir = tmp("ticket");
        let mut w = LogWriter::open(&dir, 1000, 0, 0).unwrap();
        assert!(w.sync_ticket().unwrap().is_none(), "nothing to sync");
        w.append(&[b"abc"]).unwrap();
        let ticket = w.sync_ticket().unwrap().unwrap();
        w.append(&[b"de"]).unwrap(); // appends go on while it syncs
        let done = ticket.sync();
        assert_eq!(w.synced(&ticket, done).unwrap(), 3, "only what it saw");
        assert_eq!(w.sync().unwrap(), 5);
        // An undo between the ticket and its end: the ticket says nothing.
        w.append(&[b"fg"]).unwrap();
        let ticket = w.sync_ticket().unwrap().unwrap();
        w.undo(5, 0, &[]);
        w.append(&[b"hijk"]).unwrap();
        let done = ticket.sync();
        assert_eq!(w.synced(&ticket, done).unwrap(), 5);
        // A failed fsync stops the log.
        let failed = Err(io::Error::other("EIO"));
        let ticket = w.sync_ticket().unwrap().unwrap();
        assert!(w.synced(&ticket, failed).is_err());
        assert!(w.append(&[b"l"]).is_err() && w.sync_ticket().is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replica_copy_rolls_only_where_asked() {
        let dir = tmp("raw");
        let mut w = LogWriter::open(&dir, 10, 0, 0).unwrap();
        assert_eq!(w.append_raw(&[1u8; 25], false, false).unwrap(), None);
        assert_eq!(
            w.write_pos(),
            25,
            "no roll by size: the master's bytes as they are"
        );
        assert_eq!(w.append_raw(&[2u8; 5], true, true).unwrap(), Some(25));
        assert_eq!((w.active_base(), w.write_pos(), w.flushed()), (25, 30, 30));
        assert_eq!(fs::read(dir.join(segment_name(25))).unwrap(), vec![2u8; 5]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reopens_where_recovery_left_it() {
        let dir = tmp("reopen");
        let mut w = LogWriter::open(&dir, 1000, 0, 0).unwrap();
        w.append(&[b"abc"]).unwrap();
        w.sync().unwrap();
        drop(w);
        assert!(
            LogWriter::open(&dir, 1000, 0, 2).is_err(),
            "a size that disagrees is refused"
        );
        let mut w = LogWriter::open(&dir, 1000, 0, 3).unwrap();
        assert_eq!(w.append(&[b"de"]).unwrap().positions, vec![3]);
        assert_eq!(fs::read(dir.join(segment_name(0))).unwrap(), b"abcde");
        fs::remove_dir_all(&dir).unwrap();
    }
}
