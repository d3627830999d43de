//! The control stream's send queue of one session: messages leave in the order they were
//! queued, except that a message which only states the latest of something replaces one of
//! its kind still waiting.
//!
//! What replaces what ([`Kind`]): an acknowledgement of a folder (it covers every batch up
//! to its sequence: the peer needs only the highest), the list of devices linked for a folder
//! (`Peers`), the devices sought (`Seek`), the addresses of one device (`Addresses`). So
//! however fast a peer makes this device answer (a flood of empty batches, each acknowledged;
//! its `Seek` list flipping) while it reads nothing, the queue holds at most one of each,
//! besides what this device says at its own pace: its index batches (a few per folder, by the
//! session's window), its scan reports (kept in order: the end of a scan follows the batches
//! sent before it), its hello and error. It never reorders anything else, and never drops a
//! message that is not replaced.
//!
//! It owns the queue only; writing to the stream is the session driver's.

use meshfs_protocol::{DeviceId, FolderId, Message};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// What a queued message replaces: one waiting with the same kind.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    Ack(FolderId),
    Peers(FolderId),
    Seek,
    Addresses(DeviceId),
}

fn kind(m: &Message) -> Option<Kind> {
    Some(match m {
        Message::IndexAck(a) => Kind::Ack(a.folder.clone()),
        Message::Peers(p) => Kind::Peers(p.folder.clone()),
        Message::Seek(_) => Kind::Seek,
        Message::Addresses(a) => Kind::Addresses(a.device),
        _ => return None,
    })
}

/// A session's queue of messages to send, each with what the writer needs beside it (`T`):
/// the session's end ([`Outbox::push`]) and the writer's ([`Outgoing::next`]), like a channel.
pub fn outbox<T>() -> (Outbox<T>, Outgoing<T>) {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue {
            items: VecDeque::new(),
            closed: false,
        }),
        ready: Notify::new(),
    });
    (Outbox(shared.clone()), Outgoing(shared))
}

/// Where the session queues messages; dropping it closes the queue (what waits is still
/// written).
pub struct Outbox<T>(Arc<Shared<T>>);

/// Where the writer takes them from.
pub struct Outgoing<T>(Arc<Shared<T>>);

struct Shared<T> {
    queue: Mutex<Queue<T>>,
    ready: Notify,
}

struct Queue<T> {
    items: VecDeque<(Message, T)>,
    closed: bool,
}

impl<T> Outbox<T> {
    /// Queues `msg` (with `extra`), in place of a waiting message it replaces. Returns false
    /// once the writer is gone (nothing is queued then).
    pub fn push(&self, msg: Message, extra: T) -> bool {
        let Ok(mut q) = self.0.queue.lock() else {
            return false;
        };
        if q.closed {
            return false;
        }
        let replaced = kind(&msg).and_then(|k| {
            q.items
                .iter_mut()
                .find(|(m, _)| kind(m).as_ref() == Some(&k))
        });
        match replaced {
            Some(slot) => *slot = (msg, extra),
            None => q.items.push_back((msg, extra)),
        }
        drop(q);
        self.0.ready.notify_one();
        true
    }

    /// Messages waiting.
    pub fn len(&self) -> usize {
        self.0.queue.lock().map(|q| q.items.len()).unwrap_or(0)
    }

    /// Whether no message waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> Drop for Outbox<T> {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl<T> Outgoing<T> {
    /// The next message to write, waiting for one; `None` once the [`Outbox`] is dropped and
    /// nothing waits.
    pub async fn next(&self) -> Option<(Message, T)> {
        loop {
            let notified = self.0.ready.notified();
            {
                let mut q = self.0.queue.lock().ok()?;
                if let Some(item) = q.items.pop_front() {
                    return Some(item);
                }
                if q.closed {
                    return None;
                }
            }
            notified.await;
        }
    }
}

impl<T> Drop for Outgoing<T> {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl<T> Shared<T> {
    fn close(&self) {
        if let Ok(mut q) = self.queue.lock() {
            q.closed = true;
        }
        self.ready.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshfs_protocol::{IndexAck, IndexBatch};

    fn ack(folder: &str, sequence: u64) -> Message {
        Message::IndexAck(IndexAck {
            folder: FolderId::new(folder).unwrap(),
            sequence,
        })
    }

    fn batch(up_to: u64) -> Message {
        Message::Index(IndexBatch {
            folder: FolderId::new("f").unwrap(),
            records: Vec::new(),
            up_to,
            inline: Vec::new(),
        })
    }

    fn drain(o: Outbox<()>, w: &Outgoing<()>) -> Vec<Message> {
        let mut out = Vec::new();
        drop(o);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        while let Some((m, ())) = rt.block_on(w.next()) {
            out.push(m);
        }
        out
    }

    #[test]
    fn a_million_acknowledgements_of_a_folder_not_yet_written_are_one() {
        let (o, w) = outbox();
        for s in 1..=1_000_000 {
            o.push(ack("f", s), ());
        }
        assert_eq!(o.len(), 1);
        assert_eq!(drain(o, &w), vec![ack("f", 1_000_000)]);
    }

    #[test]
    fn messages_leave_in_order_and_a_replacement_takes_the_place_of_what_it_replaces() {
        let (o, w) = outbox();
        o.push(batch(1), ());
        o.push(ack("f", 1), ());
        o.push(ack("g", 5), ());
        o.push(batch(2), ());
        o.push(ack("f", 2), ());
        assert_eq!(
            drain(o, &w),
            vec![batch(1), ack("f", 2), ack("g", 5), batch(2)]
        );
    }

    #[test]
    fn what_waits_is_written_after_the_session_let_go_and_nothing_is_queued_once_the_writer_is_gone(
    ) {
        let (o, w) = outbox();
        o.push(batch(1), ());
        assert_eq!(drain(o, &w), vec![batch(1)]);
        let (o, w) = outbox::<()>();
        drop(w);
        assert!(!o.push(batch(2), ()));
    }
}
