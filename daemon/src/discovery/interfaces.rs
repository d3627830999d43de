//! This host's network interfaces and their addresses, as `getifaddrs(3)` lists them: what
//! local discovery announces, where it sends (each IPv4 broadcast address, each IPv6 multicast
//! interface), and what roaming compares to tell an address that went away.
//!
//! **What it owns.** The one `unsafe` walk of the `getifaddrs` list; it copies what it needs
//! out of the list before freeing it. Reads only: it changes no interface.

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One address of an interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// The interface's name.
    pub name: String,
    /// Its index (for IPv6 scope and multicast).
    pub index: u32,
    /// The address.
    pub ip: IpAddr,
    /// Its IPv4 broadcast address, on an interface that broadcasts.
    pub broadcast: Option<Ipv4Addr>,
    /// The interface is up.
    pub up: bool,
    /// The interface is a loopback.
    pub loopback: bool,
    /// The interface does multicast.
    pub multicast: bool,
}

/// Every address of every interface.
pub fn addresses() -> io::Result<Vec<IfAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head`, which is valid writable memory.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not freed until below.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: ifa_addr points to a sockaddr of at least the size its family says.
        let Some(ip) = (unsafe { ip_of(ifa.ifa_addr) }) else {
            continue;
        };
        let flags = ifa.ifa_flags;
        let broadcast = match ip {
            IpAddr::V4(v4) if flags & libc::IFF_BROADCAST as u32 != 0 => {
                let given = if ifa.ifa_ifu.is_null() {
                    None
                } else {
                    // SAFETY: with IFF_BROADCAST, ifa_ifu is the broadcast sockaddr.
                    unsafe { ip_of(ifa.ifa_ifu) }
                };
                let mask = if ifa.ifa_netmask.is_null() {
                    None
                } else {
                    // SAFETY: ifa_netmask points to a sockaddr of the address's family.
                    unsafe { ip_of(ifa.ifa_netmask) }
                };
                broadcast_of(v4, given, mask)
            }
            _ => None,
        };
        // SAFETY: `name` is NUL-terminated.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        out.push(IfAddr {
            name: name.to_string_lossy().into_owned(),
            index,
            ip,
            broadcast,
            up: flags & libc::IFF_UP as u32 != 0,
            loopback: flags & libc::IFF_LOOPBACK as u32 != 0,
            multicast: flags & libc::IFF_MULTICAST as u32 != 0,
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once; nothing points into it any more.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IP address of a `sockaddr`, for IPv4 and IPv6.
///
/// # Safety
/// `sa` points to a valid `sockaddr` whose storage is as large as its family's struct.
unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller's promise: `sa` points to a sockaddr.
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: an AF_INET sockaddr is a sockaddr_in.
            let v4 = unsafe { &*(sa as *const libc::sockaddr_in) };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 sockaddr is a sockaddr_in6.
            let v6 = unsafe { &*(sa as *const libc::sockaddr_in6) };
            Some(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// The broadcast address of `ip`'s subnet: the one the interface gives, or — when it gives
/// none, as after a bare `ip addr add 10.0.0.2/24` (getifaddrs then reports nothing, or the
/// address itself) — the address with every host bit of the netmask set. None for a /31 or
/// /32, which have no broadcast.
fn broadcast_of(ip: Ipv4Addr, given: Option<IpAddr>, mask: Option<IpAddr>) -> Option<Ipv4Addr> {
    if let Some(IpAddr::V4(b)) = given {
        if !b.is_unspecified() && b != ip {
            return Some(b);
        }
    }
    let Some(IpAddr::V4(mask)) = mask else {
        return None;
    };
    let (ip, mask) = (u32::from(ip), u32::from(mask));
    (mask.leading_ones() < 31).then(|| Ipv4Addr::from(ip | !mask))
}

/// The addresses of the interfaces that are up, loopback left out (what a peer could reach).
pub fn local_ips() -> BTreeSet<IpAddr> {
    addresses()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a.up && !a.loopback)
        .map(|a| a.ip)
        .collect()
}

/// An IPv6 address valid only on its link (`fe80::/10`).
pub fn is_link_local_v6(ip: &Ipv6Addr) -> bool {
    (ip.segments()[0] & 0xffc0) == 0xfe80
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_interface_is_listed_as_such() {
        let all = addresses().unwrap();
        assert!(
            all.iter()
                .any(|a| a.loopback && a.ip == IpAddr::V4(Ipv4Addr::LOCALHOST)),
            "{all:?}"
        );
        assert!(!local_ips().contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }

    #[test]
    fn a_missing_broadcast_address_is_made_from_the_netmask() {
        let ip = Ipv4Addr::new(10, 77, 0, 2);
        let mask = |m: [u8; 4]| Some(IpAddr::V4(Ipv4Addr::from(m)));
        let zero = Some(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert_eq!(
            broadcast_of(ip, zero, mask([255, 255, 255, 0])),
            Some(Ipv4Addr::new(10, 77, 0, 255))
        );
        assert_eq!(
            broadcast_of(ip, None, mask([255, 255, 0, 0])),
            Some(Ipv4Addr::new(10, 77, 255, 255))
        );
        let given = Some(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 127)));
        assert_eq!(
            broadcast_of(ip, given, mask([255, 255, 255, 0])),
            Some(Ipv4Addr::new(10, 77, 0, 127))
        );
        assert_eq!(
            broadcast_of(ip, Some(IpAddr::V4(ip)), mask([255, 255, 255, 0])),
            Some(Ipv4Addr::new(10, 77, 0, 255))
        );
        assert_eq!(broadcast_of(ip, None, mask([255, 255, 255, 254])), None);
        assert_eq!(broadcast_of(ip, None, None), None);
    }
}
