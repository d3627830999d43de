//! Dialing a device at several candidate addresses at once, staggered (happy eyeballs, RFC
//! 8305): the first address is tried alone, the next joins [`STAGGER`] later or as soon as one
//! fails, and the first TLS handshake that completes with the device wins. Only the winner is
//! greeted; the other attempts are dropped before their hello, so the listener never counts
//! them as connections (and no crossed-dial tie is ever needed between them). The attempts cut
//! short so were sent to and never answered: the race names them, so that a hint nothing
//! answered at is forgotten whether or not another address answered first.
//!
//! **What it owns.** The race. It decides nothing about which addresses to try (the caller
//! passes them best first) nor what a failure means for the address book (the caller reads the
//! losers).

use super::book::{Candidate, Source};
use crate::transport::{self, Established, TransportError};
use meshfs_protocol::DeviceId;
use std::net::SocketAddr;
use std::time::Duration;

/// How long an attempt runs alone before the next candidate joins it.
pub const STAGGER: Duration = Duration::from_millis(250);
/// Most candidates one race tries.
pub const MAX_CANDIDATES: usize = 8;

/// A race's winner.
pub struct Won {
    /// The welcomed connection.
    pub established: Established,
    /// The address that answered.
    pub addr: SocketAddr,
    /// How that address was learned.
    pub source: Source,
    /// The attempts still waiting for an answer when this one won (cut short).
    pub cut: Vec<Candidate>,
}

/// One attempt that failed.
#[derive(Debug)]
pub struct Lost {
    /// The address tried.
    pub addr: SocketAddr,
    /// How it was learned.
    pub source: Source,
    /// Why it failed.
    pub error: TransportError,
}

/// Races `candidates` (best first, at most [`MAX_CANDIDATES`]) for `peer`, each attempt cut
/// off after `attempt` if given. Returns the winner, if any, and every attempt that failed
/// before the race ended. A device that answers and then refuses (our certificate, a crossed
/// dial, its daemon stopping) ends the race with that answer: its other addresses would say
/// the same. Given up (`None`) when `give_up` completes before any attempt's TLS handshake
/// has: the peer never counts such a dial as a connection (it waits for our greeting,
/// `Handshaken::greet`), so nothing is left behind. Once an attempt has shaken hands, its
/// greeting and the race's end are not given up.
pub async fn race(
    endpoint: &quinn::Endpoint,
    peer: DeviceId,
    candidates: &[Candidate],
    attempt: Option<Duration>,
    give_up: impl std::future::Future<Output = ()>,
) -> Option<Result<Won, Vec<Lost>>> {
    tokio::pin!(give_up);
    let candidates = &candidates[..candidates.len().min(MAX_CANDIDATES)];
    let mut lost = Vec::new();
    let mut running = tokio::task::JoinSet::new();
    // The attempts started and not yet ended.
    let mut waiting = std::collections::BTreeSet::new();
    let mut next = 0;
    let start = |i: usize,
                 running: &mut tokio::task::JoinSet<_>,
                 waiting: &mut std::collections::BTreeSet<usize>| {
        waiting.insert(i);
        let (ep, addr) = (endpoint.clone(), candidates[i].addr);
        running.spawn(async move {
            let shake = transport::handshake(&ep, addr, peer);
            let r = match attempt {
                Some(limit) => match tokio::time::timeout(limit, shake).await {
                    Ok(r) => r,
                    Err(_) => Err(TransportError::Connect {
                        addr,
                        reason: "no answer yet".into(),
                    }),
                },
                None => shake.await,
            };
            (i, r)
        });
    };
    loop {
        if next < candidates.len() && (running.is_empty() || next == 0) {
            start(next, &mut running, &mut waiting);
            next += 1;
        }
        let stagger = async {
            if next < candidates.len() {
                tokio::time::sleep(STAGGER).await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            done = running.join_next() => {
                let Some(done) = done else {
                    return Some(Err(lost));
                };
                let Ok((i, r)) = done else { continue };
                waiting.remove(&i);
                let c = candidates[i];
                match r {
                    Ok(shaken) => {
                        // The others are dropped before their hello.
                        running.abort_all();
                        let cut: Vec<Candidate> = waiting.iter().map(|&j| candidates[j]).collect();
                        return Some(match shaken.greet().await {
                            Ok(established) => Ok(Won {
                                established,
                                addr: c.addr,
                                source: c.source,
                                cut,
                            }),
                            Err(error) => {
                                lost.push(Lost { addr: c.addr, source: c.source, error });
                                lost.extend(cut.into_iter().map(|c| Lost {
                                    addr: c.addr,
                                    source: c.source,
                                    error: TransportError::Connect {
                                        addr: c.addr,
                                        reason: "no answer before the device answered at another address".into(),
                                    },
                                }));
                                Err(lost)
                            }
                        });
                    }
                    Err(error) => {
                        lost.push(Lost { addr: c.addr, source: c.source, error });
                        // A failure lets the next candidate start at once.
                        if next < candidates.len() {
                            start(next, &mut running, &mut waiting);
                            next += 1;
                        } else if running.is_empty() {
                            return Some(Err(lost));
                        }
                    }
                }
            }
            _ = stagger => {
                start(next, &mut running, &mut waiting);
                next += 1;
            }
            // No attempt has shaken hands (that arm awaits its greeting in place).
            _ = &mut give_up => {
                running.abort_all();
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;
    use crate::transport::TrustStore;
    use std::time::Instant;

    fn endpoint(identity: &Identity, trust: Vec<DeviceId>) -> quinn::Endpoint {
        transport::endpoint(
            identity,
            "127.0.0.1:0".parse().unwrap(),
            TrustStore::new(trust),
        )
        .unwrap()
    }

    /// A silent address (nothing answers: the Initial goes nowhere) first, the device second:
    /// the device's address joins after the stagger and wins, long before the silent attempt
    /// would give up.
    #[tokio::test]
    async fn a_silent_first_address_costs_only_the_stagger() {
        let (a, b) = (Identity::generate().unwrap(), Identity::generate().unwrap());
        let ea = endpoint(&a, vec![b.device_id]);
        let eb = endpoint(&b, vec![a.device_id]);
        let accept = tokio::spawn({
            let eb = eb.clone();
            async move { transport::accept_peer(&eb, eb.accept().await.unwrap()).await }
        });
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let candidates = [
            Candidate {
                addr: silent.local_addr().unwrap(),
                source: Source::Lan,
            },
            Candidate {
                addr: eb.local_addr().unwrap(),
                source: Source::Incoming,
            },
        ];
        let t0 = Instant::now();
        let won = race(&ea, b.device_id, &candidates, None, std::future::pending())
            .await
            .and_then(Result::ok)
            .unwrap();
        assert_eq!(won.addr, eb.local_addr().unwrap());
        assert_eq!(won.source, Source::Incoming);
        // The silent address was sent to and never answered: named, so a hint is forgotten.
        assert_eq!(won.cut, candidates[..1]);
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert!(accept.await.unwrap().is_ok());
    }

    /// Another device at the first address fails that attempt at once; the device at the
    /// second wins.
    #[tokio::test]
    async fn another_device_at_an_address_is_a_lost_attempt_and_the_race_goes_on() {
        let (a, b, c) = (
            Identity::generate().unwrap(),
            Identity::generate().unwrap(),
            Identity::generate().unwrap(),
        );
        let ea = endpoint(&a, vec![b.device_id, c.device_id]);
        let eb = endpoint(&b, vec![a.device_id]);
        let ec = endpoint(&c, vec![a.device_id]);
        for e in [eb.clone(), ec.clone()] {
            tokio::spawn(async move {
                while let Some(i) = e.accept().await {
                    let e = e.clone();
                    tokio::spawn(async move { transport::accept_peer(&e, i).await });
                }
            });
        }
        let candidates = [
            Candidate {
                addr: ec.local_addr().unwrap(),
                source: Source::Lan,
            },
            Candidate {
                addr: eb.local_addr().unwrap(),
                source: Source::Lan,
            },
        ];
        let won = race(&ea, b.device_id, &candidates, None, std::future::pending())
            .await
            .and_then(Result::ok)
            .unwrap();
        assert_eq!(won.established.peer, b.device_id);
        let lost = race(
            &ea,
            b.device_id,
            &candidates[..1],
            None,
            std::future::pending(),
        )
        .await
        .and_then(Result::err)
        .unwrap();
        assert!(
            matches!(lost[0].error, TransportError::WrongDevice { .. }),
            "{:?}",
            lost[0].error
        );
    }
}
