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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ucrypt::sync::{lock, WaitCell};

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
pub struct Budget {
    /// Bytes charged, all connections together. Connections' own counts change only under
    /// this lock too, so one check sees both.
    used: Mutex<u64>,
    /// Readers waiting for room; every release wakes them all (each rechecks its own cap).
    freed: WaitCell,
}

/// One connection's share of the budget.
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
            used: Mutex::new(0),
            freed: WaitCell::new(),
        }
    }

    /// Charges `bytes` (at most [`MAX_PAYLOAD_BYTES`]) to the server and to `conn`, waiting
    /// until both have room.
    pub fn charge(self: &Arc<Self>, conn: &Arc<ConnBudget>, bytes: u64) -> Charge {
        debug_assert!(bytes <= u64::from(MAX_PAYLOAD_BYTES));
        let mut used = lock(&self.used);
        loop {
            let mine = conn.used.load(Ordering::Acquire);
            if *used + bytes <= SERVER_BYTES_MAX && mine + bytes <= CONNECTION_BYTES_MAX {
                break;
            }
            used = self.freed.wait(used);
        }
        *used += bytes;
        conn.used.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            budget: self.clone(),
            conn: conn.clone(),
            bytes,
        }
    }

    /// Bytes charged now, all connections together.
    #[cfg(test)]
    pub fn used(&self) -> u64 {
        *lock(&self.used)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let mut used = lock(&self.budget.used);
        *used -= self.bytes;
        self.conn.used.fetch_sub(self.bytes, Ordering::AcqRel);
        drop(used);
        self.budget.freed.notify_all();
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
