//! `kube-router bgp`: the running agent's BGP neighbors and routes, read from its status socket
//! in --state-dir, else from its `/bgp` page on the metrics listener.
use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use anyhow::Result;

/// The agent's `bgp` page: over HTTP when its metrics port is given, else from its unix socket in
/// --state-dir (which works with the health and metrics ports disabled).
pub fn show(state_dir: &std::path::Path, addr: IpAddr, port: u16) -> Result<String> {
    if port != 0 {
        return fetch(addr, port);
    }
    crate::status_socket::request(state_dir, "bgp")
        .map_err(|e| e.context("or give the agent's --metrics-port to ask its /bgp page"))
}

/// The `/bgp` page of the agent listening on `addr:port` (an unspecified address: loopback).
pub fn fetch(addr: IpAddr, port: u16) -> Result<String> {
    anyhow::ensure!(port != 0, "the agent serves /bgp on its metrics listener: give its --metrics-port");
    let addr = if addr.is_unspecified() { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { addr };
    let mut stream = std::net::TcpStream::connect((addr, port)).map_err(|e| {
        anyhow::anyhow!("cannot reach the agent on {addr}:{port} (--metrics-addr, --metrics-port): {e}")
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /bgp HTTP/1.0\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.split_once("\r\n\r\n").map_or(response.as_str(), |(_, b)| b).to_string())
}
