//! `kube-router bgp`: the running agent's BGP neighbors and routes, read from its status socket
//! in --state-dir, else from its `/bgp` page on the metrics listener; `-o json` reads the
//! `bgp.json` page instead (`bgp::report::BgpReport`).
use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use anyhow::Result;

/// The agent's `bgp` (or `bgp.json`) page: over HTTP when its metrics port is given, else from its
/// unix socket in --state-dir (which works with the health and metrics ports disabled).
pub fn show(state_dir: &std::path::Path, addr: IpAddr, port: u16, output: super::Output) -> Result<String> {
    let page = match output {
        super::Output::Table => "bgp",
        super::Output::Json => "bgp.json",
    };
    let text = if port != 0 {
        fetch(addr, port, page)?
    } else {
        crate::status_socket::request(state_dir, page)
            .map_err(|e| e.context("or give the agent's --metrics-port to ask its /bgp page"))?
    };
    if output == super::Output::Json {
        let report: crate::routing::bgp::report::BgpReport = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!("the agent answered no BGP report ({e}; an agent older than `bgp -o json`?): {text:.200}")
        })?;
        return Ok(serde_json::to_string_pretty(&report)? + "\n");
    }
    Ok(text)
}

/// The page `/<page>` of the agent listening on `addr:port` (an unspecified address: loopback).
pub fn fetch(addr: IpAddr, port: u16, page: &str) -> Result<String> {
    anyhow::ensure!(port != 0, "the agent serves /bgp on its metrics listener: give its --metrics-port");
    let addr = if addr.is_unspecified() { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { addr };
    let mut stream = std::net::TcpStream::connect((addr, port)).map_err(|e| {
        anyhow::anyhow!("cannot reach the agent on {addr}:{port} (--metrics-addr, --metrics-port): {e}")
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("GET /{page} HTTP/1.0\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response.split_once("\r\n\r\n").map_or(response.as_str(), |(_, b)| b).to_string())
}
