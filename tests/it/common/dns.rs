//! A DNS server on loopback for the discovery tests: answers A queries for
//! the names it is given, with the addresses set now (TTL 1 s unless set); AAAA with
//! no record; any other name NXDOMAIN. Never the machine's resolver.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::net::UdpSocket;

/// The server, and the records it answers with.
pub struct Dns {
    pub addr: SocketAddr,
    records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>>,
    pub queries: Arc<std::sync::atomic::AtomicUsize>,
    ttl: Arc<std::sync::atomic::AtomicU32>,
}

impl Dns {
    pub async fn start() -> Dns {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let records: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>> = Arc::default();
        let queries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let ttl = Arc::new(std::sync::atomic::AtomicU32::new(1));
        let (r, q, t) = (records.clone(), queries.clone(), ttl.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                q.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let answer = {
                    let records = r.lock().unwrap();
                    answer(
                        &buf[..n],
                        &records,
                        t.load(std::sync::atomic::Ordering::SeqCst),
                    )
                };
                if let Some(answer) = answer {
                    let _ = socket.send_to(&answer, from).await;
                }
            }
        });
        Dns {
            addr,
            records,
            queries,
            ttl,
        }
    }

    /// Records are answered with this TTL from now on.
    pub fn set_ttl(&self, seconds: u32) {
        self.ttl.store(seconds, std::sync::atomic::Ordering::SeqCst);
    }

    /// `name` is answered NXDOMAIN from now on.
    pub fn remove(&self, name: &str) {
        self.records
            .lock()
            .unwrap()
            .remove(&name.to_ascii_lowercase());
    }

    /// `name` (without the final dot) answers `addresses` from now on.
    pub fn set(&self, name: &str, addresses: &[Ipv4Addr]) {
        self.records
            .lock()
            .unwrap()
            .insert(name.to_ascii_lowercase(), addresses.to_vec());
    }
}

/// The answer to one query, or `None` if it cannot be read.
fn answer(query: &[u8], records: &HashMap<String, Vec<Ipv4Addr>>, ttl: u32) -> Option<Vec<u8>> {
    if query.len() < 12 {
        return None;
    }
    // The question: labels, then type and class.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question = query.get(12..at + 4)?;
    let name = labels.join(".");
    let found = records.get(&name);
    let addresses: &[Ipv4Addr] = match (found, qtype) {
        (Some(a), 1) => a,
        _ => &[],
    };
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(&query[..2]); // id
    let rcode = if found.is_some() { 0 } else { 3 }; // NXDOMAIN
    out.extend_from_slice(&[0x85, 0x80 | rcode]); // response, AA, RD, RA
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&(addresses.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(question);
    for ip in addresses {
        out.extend_from_slice(&[0xc0, 12]); // the question's name
        out.extend_from_slice(&[0, 1, 0, 1]); // A, IN
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&[0, 4]);
        out.extend_from_slice(&ip.octets());
    }
    Some(out)
}
