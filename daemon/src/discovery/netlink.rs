//! Noticing that this host's network changed: an rtnetlink socket subscribed to address, route
//! and link changes, read on the runtime without a thread of its own.
//!
//! **What it owns.** The netlink socket and its `unsafe` calls. It reports *that* something
//! changed and of which kind ([`Change`]), gathered over [`SETTLE`] so that an `ip addr del`
//! followed by an `ip addr add` is one change; what changed is read from the interfaces by the
//! caller. Where netlink is unavailable it says so once and the caller polls instead
//! ([`POLL`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// How long changes are gathered into one report after the first of them.
pub const SETTLE: Duration = Duration::from_millis(50);
/// How often the interfaces are compared where netlink is unavailable.
pub const POLL: Duration = Duration::from_secs(2);

/// What changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// An address was added or removed, or an interface went up or down.
    pub addresses: bool,
    /// A route was added or removed.
    pub routes: bool,
}

/// An rtnetlink socket listening for changes.
pub struct Watch {
    fd: AsyncFd<OwnedFd>,
}

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;
const NLMSG_HDRLEN: usize = 16;

impl Watch {
    /// Subscribes to address, route and link changes. Must be called inside a tokio runtime.
    pub fn new() -> io::Result<Watch> {
        // SAFETY: plain socket creation; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; all-zero is valid and then filled in.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups = RTMGRP_LINK
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV6_IFADDR
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV6_ROUTE;
        // SAFETY: `sa` is a valid sockaddr_nl and its size is passed along.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the AsyncFd owns the OwnedFd, which keeps the descriptor open and naming the
        // same socket until the AsyncFd is dropped.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(Watch { fd })
    }

    /// Waits for the next change, then gathers whatever follows within [`SETTLE`].
    pub async fn next(&mut self) -> io::Result<Change> {
        let mut change = self.read_some().await?;
        let settle = tokio::time::sleep(SETTLE);
        tokio::pin!(settle);
        loop {
            tokio::select! {
                _ = &mut settle => return Ok(change),
                more = self.read_some() => {
                    let more = more?;
                    change.addresses |= more.addresses;
                    change.routes |= more.routes;
                }
            }
        }
    }

    /// Reads what the socket holds (at least one datagram) and says what it reported.
    async fn read_some(&mut self) -> io::Result<Change> {
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let mut guard = self.fd.readable().await?;
            let mut change = Change::default();
            let mut got = false;
            loop {
                // SAFETY: `buf` is writable for its length.
                let n = unsafe {
                    libc::recv(
                        guard.get_inner().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                    )
                };
                if n < 0 {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => continue,
                        // ENOBUFS: the kernel dropped reports; something changed.
                        _ if e.raw_os_error() == Some(libc::ENOBUFS) => {
                            change.addresses = true;
                            change.routes = true;
                            got = true;
                            continue;
                        }
                        _ => return Err(e),
                    }
                }
                got = true;
                parse(&buf[..n as usize], &mut change);
            }
            guard.clear_ready();
            if got {
                return Ok(change);
            }
        }
    }
}

/// Marks in `change` the kinds of the netlink messages in one datagram.
fn parse(mut data: &[u8], change: &mut Change) {
    while data.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        match kind {
            libc::RTM_NEWADDR | libc::RTM_DELADDR | libc::RTM_NEWLINK | libc::RTM_DELLINK => {
                change.addresses = true
            }
            libc::RTM_NEWROUTE | libc::RTM_DELROUTE => change.routes = true,
            _ => {}
        }
        // Messages are 4-byte aligned.
        let step = (len + 3) & !3;
        if len < NLMSG_HDRLEN || step > data.len() {
            return;
        }
        data = &data[step..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: u16, len: u32) -> Vec<u8> {
        let mut m = len.to_ne_bytes().to_vec();
        m.extend_from_slice(&kind.to_ne_bytes());
        m.resize(len as usize, 0);
        m
    }

    #[test]
    fn address_and_route_messages_are_told_apart() {
        let mut c = Change::default();
        parse(&header(libc::RTM_NEWROUTE, 20), &mut c);
        assert_eq!(
            c,
            Change {
                addresses: false,
                routes: true
            }
        );
        let mut both = header(libc::RTM_NEWROUTE, 18);
        both.resize(20, 0);
        both.extend(header(libc::RTM_DELADDR, 16));
        let mut c = Change::default();
        parse(&both, &mut c);
        assert!(c.addresses && c.routes);
        // A length that runs past the datagram stops the walk, whatever follows.
        let mut c = Change::default();
        parse(&header(libc::RTM_NEWADDR, 16)[..10], &mut c);
        assert_eq!(c, Change::default());
    }
}
