//! A hand-driven BGP peer: raw bytes on the wire, so a test can send what real daemons never
//! do (malformed attributes, families nobody negotiated, martians with any next hop).
use std::sync::{Arc, Mutex};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{tcp::OwnedWriteHalf, TcpListener},
};

pub const OPEN: u8 = 1;
pub const UPDATE: u8 = 2;
pub const NOTIFICATION: u8 = 3;
pub const KEEPALIVE: u8 = 4;

pub fn message(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![0xff; 16];
    m.extend_from_slice(&((19 + body.len()) as u16).to_be_bytes());
    m.push(kind);
    m.extend_from_slice(body);
    m
}

/// OPEN with hold time 0 (no keepalives needed), IPv4 unicast and 4-octet AS.
pub fn open(asn: u16, router_id: [u8; 4]) -> Vec<u8> {
    let mut body = vec![4];
    body.extend_from_slice(&asn.to_be_bytes());
    body.extend_from_slice(&0u16.to_be_bytes());
    body.extend_from_slice(&router_id);
    let caps = [
        2,
        6,
        1,
        4,
        0,
        1,
        0,
        1, // MP: IPv4 unicast
        2,
        6,
        65,
        4,
        0,
        0,
        (asn >> 8) as u8,
        asn as u8, // 4-octet AS
    ];
    body.push(caps.len() as u8);
    body.extend_from_slice(&caps);
    message(OPEN, &body)
}

/// UPDATE announcing `prefix`/24 with the given ORIGIN value (0..=2 valid).
pub fn update(asn: u32, next_hop: [u8; 4], prefix: [u8; 3], origin: u8) -> Vec<u8> {
    let mut attrs = vec![0x40, 1, 1, origin];
    attrs.extend_from_slice(&[0x40, 2, 6, 2, 1]);
    attrs.extend_from_slice(&asn.to_be_bytes());
    attrs.extend_from_slice(&[0x40, 3, 4]);
    attrs.extend_from_slice(&next_hop);
    let mut body = vec![0, 0];
    body.extend_from_slice(&(attrs.len() as u16).to_be_bytes());
    body.extend_from_slice(&attrs);
    body.push(24);
    body.extend_from_slice(&prefix);
    message(UPDATE, &body)
}

/// (message type, body) of everything the agent sent.
pub type Received = Arc<Mutex<Vec<(u8, Vec<u8>)>>>;

pub struct Peer {
    pub received: Received,
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
}

impl Peer {
    /// Waits for the agent to connect to `listen`, answers its OPEN and starts collecting
    /// what it sends.
    pub async fn accept(listen: &str, asn: u16, router_id: [u8; 4]) -> Peer {
        let listener = TcpListener::bind(listen).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        let (mut reader, mut writer) = stream.into_split();
        writer.write_all(&open(asn, router_id)).await.unwrap();
        writer.write_all(&message(KEEPALIVE, &[])).await.unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let sink = received.clone();
        tokio::spawn(async move {
            loop {
                let mut header = [0u8; 19];
                if reader.read_exact(&mut header).await.is_err() {
                    return;
                }
                let len = u16::from_be_bytes([header[16], header[17]]) as usize;
                let mut body = vec![0u8; len.saturating_sub(19)];
                if reader.read_exact(&mut body).await.is_err() {
                    return;
                }
                sink.lock().unwrap().push((header[18], body));
            }
        });
        Peer { received, writer: Arc::new(tokio::sync::Mutex::new(writer)) }
    }

    pub fn sender(&self) -> Arc<tokio::sync::Mutex<OwnedWriteHalf>> {
        self.writer.clone()
    }

    pub fn kinds(&self) -> Vec<u8> {
        self.received.lock().unwrap().iter().map(|(k, _)| *k).collect()
    }
}

/// Path attributes of an announcement from `asn`: ORIGIN IGP, AS_PATH [asn], NEXT_HOP.
pub fn attributes(asn: u32, next_hop: [u8; 4]) -> Vec<u8> {
    let mut attrs = vec![0x40, 1, 1, 0];
    attrs.extend_from_slice(&[0x40, 2, 6, 2, 1]);
    attrs.extend_from_slice(&asn.to_be_bytes());
    attrs.extend_from_slice(&[0x40, 3, 4]);
    attrs.extend_from_slice(&next_hop);
    attrs
}

/// One prefix in NLRI encoding.
pub fn nlri(prefix: &str) -> Vec<u8> {
    let (addr, len) = prefix.split_once('/').expect("a/len");
    let len: u8 = len.parse().expect("prefix length");
    let octets: Vec<u8> = match addr.parse::<std::net::IpAddr>().expect("address") {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    };
    let mut out = vec![len];
    out.extend_from_slice(&octets[..usize::from(len).div_ceil(8)]);
    out
}

/// An optional non-transitive, extended-length attribute.
pub fn optional_attribute(code: u8, value: &[u8]) -> Vec<u8> {
    let mut attr = vec![0x90, code];
    attr.extend_from_slice(&(value.len() as u16).to_be_bytes());
    attr.extend_from_slice(value);
    attr
}

/// MP_REACH_NLRI (RFC 4760) for any AFI/SAFI.
pub fn mp_reach(afi: u16, safi: u8, next_hop: &[u8], prefixes: &[&str]) -> Vec<u8> {
    let mut value = afi.to_be_bytes().to_vec();
    value.push(safi);
    value.push(next_hop.len() as u8);
    value.extend_from_slice(next_hop);
    value.push(0);
    for p in prefixes {
        value.extend_from_slice(&nlri(p));
    }
    optional_attribute(14, &value)
}

/// An UPDATE with these attributes announcing `prefixes` as classic IPv4 NLRI.
pub fn announce(attrs: &[u8], prefixes: &[&str]) -> Vec<u8> {
    let mut body = vec![0, 0];
    body.extend_from_slice(&(attrs.len() as u16).to_be_bytes());
    body.extend_from_slice(attrs);
    for p in prefixes {
        body.extend_from_slice(&nlri(p));
    }
    message(UPDATE, &body)
}
