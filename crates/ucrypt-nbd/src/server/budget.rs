//! The server's request buffer budget: payload bytes (write data read in, read data not yet
//! sent) are charged per request to one budget the whole server shares, and to the
//! connection's own cap, and given back when the request ends (its [`Charge`] is dropped).
//!
//! Why shared: a connection holds buffers only while it has requests, so an idle connection
//! costs no buffer memory and the connection limit can be large; the memory bound is the
//! budget, whatever the number of connections. Why a per-connection cap too: one client (for
//! instance one that stops reading its replies) cannot take the whole budget. A request
//! waits for room (back-pressure on its client), it never fails for want of buffers: every
//! request the protocol lets through fits ([`MAX_PAYLOAD_BYTES`] is within both limits), so
//! it proceeds once requests in flight finish, and those never wait on the budget.
//!
//! Every request is charged by its connection's reader and given back by whichever thread
//! ends it, so the common case (room in both) is two atomic updates, with no lock that the
//! reader and the workers of all connections would take in turn. Only a charge that finds no
//! room takes the lock and sleeps; a release takes it only when someone sleeps.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use ucrypt::sync::lock;

use crate::proto::MAX_PAYLOAD_BYTES;

/// Payload bytes all connections of a server hold at once.
pub const SERVER_BYTES_MAX: u64 = 4 * MAX_PAYLOAD_BYTES as u64;
/// Payload bytes one connection holds at once: two maximum requests, so that receiving one
/// overlaps with executing the other.
pub const CONNECTION_BYTES_MAX: u64 = 2 * MAX_PAYLOAD_BYTES as u64;

// Every request the protocol accepts fits in the connection's cap, and that in the budget.
const _: () = assert!(MAX_PAYLOAD_BYTES as u64 <= CONNECTION_BYTES_MAX);
const _: () = assert!(CONNECTION_BYTES_MAX <= SERVER_BYTES_MAX);

/// The server-wide budget.
///
/// Wake-ups cannot be lost: a charge that finds no room counts itself in `sleepers` and looks
/// again, both under `lock`, before it sleeps; a release gives its bytes back, then reads
/// `sleepers`, and if any sleep, notifies under `lock`. All four are sequentially consistent,
/// so either the release sees the sleeper (and its notify comes after the sleeper waits, the
/// lock being held until then) or the sleeper's second look comes after the bytes were given
/// back and sees them.
pub struct Budget {
    /// Bytes charged, all connections together.
    used: AtomicU64,
    /// Charges waiting for room.
    sleepers: AtomicU32,
    lock: Mutex<()>,
    freed: Condvar,
}

/// One connection's share of the budget. Only the connection's reader charges it (so its
/// check and its increase cannot race with another charge); any thread gives back.
#[derive(Default)]
pub struct ConnBudget {
    used: AtomicU64,
}

/// Bytes charged to the server's budget and a connection's; given back when dropped.
pub struct Charge {
    budget: Arc<Budget>,
    conn: Arc<ConnBudget>,
    bytes: u64,
}

impl Budget {
    pub fn new() -> Budget {
        Budget {
            used: AtomicU64::new(0),
            sleepers: AtomicU32::new(0),
            lock: Mutex::new(()),
            freed: Condvar::new(),
        }
    }

    /// Charges `bytes` (at most [`MAX_PAYLOAD_BYTES`]) to the server and to `conn`, waiting
    /// until both have room.
    pub fn charge(self: &Arc<Self>, conn: &Arc<ConnBudget>, bytes: u64) -> Charge {
        debug_assert!(bytes <= u64::from(MAX_PAYLOAD_BYTES));
        if !self.charge_now(conn, bytes) {
            let mut g = lock(&self.lock);
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            while !self.charge_now(conn, bytes) {
                g = self
                    .freed
                    .wait(g)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        Charge {
            budget: self.clone(),
            conn: conn.clone(),
            bytes,
        }
    }

    /// Charges `bytes` to the server and to `conn` if both have room now.
    pub fn try_charge(self: &Arc<Self>, conn: &Arc<ConnBudget>, bytes: u64) -> Option<Charge> {
        self.charge_now(conn, bytes).then(|| Charge {
            budget: self.clone(),
            conn: conn.clone(),
            bytes,
        })
    }

    /// Charges if both have room now.
    fn charge_now(&self, conn: &ConnBudget, bytes: u64) -> bool {
        // The server's count first: a release gives back the connection's bytes before the
        // server's, so seeing the server's returned means seeing the connection's too.
        let mut used = self.used.load(Ordering::SeqCst);
        if conn.used.load(Ordering::SeqCst) + bytes > CONNECTION_BYTES_MAX {
            return false;
        }
        loop {
            if used + bytes > SERVER_BYTES_MAX {
                return false;
            }
            match self.used.compare_exchange_weak(
                used,
                used + bytes,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        conn.used.fetch_add(bytes, Ordering::SeqCst);
        true
    }

    /// Bytes charged now, all connections together.
    #[cfg(test)]
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let b = &self.budget;
        self.conn.used.fetch_sub(self.bytes, Ordering::SeqCst);
        b.used.fetch_sub(self.bytes, Ordering::SeqCst);
        if b.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&b.lock);
            b.freed.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MAX: u64 = MAX_PAYLOAD_BYTES as u64;

    #[test]
    fn waits_for_room_and_gives_back_on_drop() {
        let b = Arc::new(Budget::new());
        let (c1, c2, c3) = (
            Arc::new(ConnBudget::default()),
            Arc::new(ConnBudget::default()),
            Arc::new(ConnBudget::default()),
        );
        // Two connections at their caps fill the budget.
        let held: Vec<Charge> = [&c1, &c1, &c2, &c2]
            .into_iter()
            .map(|c| b.charge(c, MAX))
            .collect();
        assert_eq!(b.used(), SERVER_BYTES_MAX);
        // A third waits until a charge is dropped, then proceeds.
        let (b2, c3b) = (b.clone(), c3.clone());
        let t = std::thread::spawn(move || drop(b2.charge(&c3b, 4096)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "charged beyond the budget");
        let mut held = held;
        drop(held.pop());
        t.join().unwrap();
        // A connection at its cap waits though the server has room.
        let (b2, c1b) = (b.clone(), c1.clone());
        let t = std::thread::spawn(move || drop(b2.charge(&c1b, 4096)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "charged beyond the connection's cap");
        drop(held.remove(0));
        t.join().unwrap();
        drop(held);
        assert_eq!(b.used(), 0);
    }
}
