//! The commands besides `run` (`launch`): `cleanup` and `install-cni`, and the inspection
//! commands (`kube-router services | conntrack | stats | bgp | policy | interfaces |
//! checkpoint`): each inspection reads real state into a serializable report, then prints it as
//! text (`-o table`, the default) or JSON (`-o json`, shapes in docs/usage.md).
pub mod bgp;
pub mod checkpoint;
pub mod cleanup;
pub mod conntrack;
pub mod install_cni;
pub mod interfaces;
pub mod policy;
pub mod services;
pub mod stats;

use std::net::{IpAddr, SocketAddr};

use anyhow::Result;
use serde::Serialize;

use crate::services::family::AddressFamily;

/// How an inspection command prints its report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human-readable text.
    #[default]
    #[value(alias = "text")]
    Table,
    /// One JSON document (docs/usage.md).
    Json,
}

/// A report that prints itself as text; its JSON is its serde form.
pub trait Report: Serialize {
    fn render_text(&self) -> String;
}

/// Prints `report` in the chosen form.
pub fn print(report: &impl Report, output: Output) -> Result<()> {
    match output {
        Output::Table => print!("{}", report.render_text()),
        Output::Json => println!("{}", serde_json::to_string_pretty(report)?),
    }
    Ok(())
}

/// A map's address (words in network byte order) and port (network byte order) as `ip:port`.
pub(crate) fn socket_addr<F: AddressFamily>(addr: F::Words, port_be: u16) -> SocketAddr {
    let ip: IpAddr = F::addr_from_words(addr).into();
    SocketAddr::new(ip, u16::from_be(port_be))
}

pub(crate) fn proto_name(proto: u8) -> String {
    match proto {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        other => other.to_string(),
    }
}
