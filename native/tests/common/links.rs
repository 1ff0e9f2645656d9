//! A sink that keeps what the reactors report, for the tests of the connections the
//! native listeners accept (TLS, WebSocket): each waits for the event it needs.
#![allow(dead_code)] // (each test crate uses its part)

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use lightgate_native::reactor::{LinkEvent, LogTarget, Report, Sink};

#[derive(Default)]
pub struct Collect {
    reports: Mutex<Vec<Report>>,
    changed: Condvar,
}

impl Sink for Collect {
    fn report(&self, report: Report) {
        self.reports.lock().unwrap().push(report);
        self.changed.notify_all();
    }
}

impl Collect {
    /// The first link event `pick` accepts, waiting up to `secs` for it.
    pub fn wait<T>(&self, secs: u64, mut pick: impl FnMut(&LinkEvent) -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let mut reports = self.reports.lock().unwrap();
        loop {
            let found = reports.iter().position(|r| match r {
                Report::Link(e) => pick(e).is_some(),
                _ => false,
            });
            if let Some(i) = found {
                let Report::Link(e) = reports.remove(i) else {
                    unreachable!()
                };
                return pick(&e).unwrap();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no such event in {secs} s");
            reports = self.changed.wait_timeout(reports, left).unwrap().0;
        }
    }

    pub fn opened(&self) -> (u64, Option<String>) {
        self.wait(5, |e| match e {
            LinkEvent::Opened { conn, identity, .. } => Some((*conn, identity.clone())),
            _ => None,
        })
    }

    /// Plaintext relayed for `conn` until `n` bytes came.
    pub fn data(&self, conn: u64, n: usize) -> Vec<u8> {
        let mut got = Vec::new();
        while got.len() < n {
            got.extend(self.wait(5, |e| match e {
                LinkEvent::Data { conn: c, data } if *c == conn => Some(data.clone()),
                _ => None,
            }));
        }
        got
    }

    /// The plaintext relayed for `conn` so far, without waiting.
    pub fn data_now(&self, conn: u64) -> Vec<u8> {
        let mut reports = self.reports.lock().unwrap();
        let mut got = Vec::new();
        reports.retain(|r| match r {
            Report::Link(LinkEvent::Data { conn: c, data }) if *c == conn => {
                got.extend_from_slice(data);
                false
            }
            _ => true,
        });
        got
    }

    pub fn ended(&self, conn: u64) -> (bool, String) {
        self.wait(5, |e| match e {
            LinkEvent::Ended { conn: c, eof, why } if *c == conn => Some((*eof, why.clone())),
            _ => None,
        })
    }

    pub fn logged(&self, secs: u64, target: LogTarget) -> String {
        self.wait(secs, |e| match e {
            LinkEvent::Log { target: t, text } if *t == target => Some(text.clone()),
            _ => None,
        })
    }
}
