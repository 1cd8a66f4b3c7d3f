//! `kube-router interfaces`: per interface, which of our programs are attached and how.
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::bpf::{
    datapath::{self, AttachMode},
    xdp,
};

#[derive(Serialize, Debug, Default)]
#[serde(transparent)]
pub struct InterfacesReport {
    pub attachments: Vec<InterfaceAttachment>,
}

#[derive(Serialize, Debug)]
pub struct InterfaceAttachment {
    pub interface: String,
    pub program: &'static str,
    /// `tcx`, `classic tc` or `xdp link` (XDP's native/generic mode is in `ip link show`).
    pub mode: &'static str,
    pub program_id: Option<u32>,
    pub attached: bool,
}

pub fn collect(pin_dir: &Path) -> Result<InterfacesReport> {
    let mut attachments: Vec<InterfaceAttachment> = datapath::attachments(pin_dir)?
        .into_iter()
        .map(|a| InterfaceAttachment {
            interface: a.interface,
            program: a.hook.program(),
            mode: match a.mode {
                AttachMode::Tcx => "tcx",
                AttachMode::Classic => "classic tc",
            },
            program_id: a.program_id,
            attached: a.attached,
        })
        .collect();
    attachments.extend(xdp::attachments(pin_dir).into_iter().map(|a| InterfaceAttachment {
        interface: a.interface,
        program: xdp::PROGRAM,
        mode: "xdp link",
        program_id: a.program_id,
        attached: a.attached,
    }));
    Ok(InterfacesReport { attachments })
}

impl super::Report for InterfacesReport {
    fn render_text(&self) -> String {
        self.attachments
            .iter()
            .map(|a| {
                let state = if a.attached { "attached" } else { "NOT attached" };
                let id = a.program_id.map(|i| i.to_string()).unwrap_or_else(|| "?".into());
                format!("{:<16} {:<15} {:<10} program {id:<6} {state}\n", a.interface, a.program, a.mode)
            })
            .collect()
    }
}
