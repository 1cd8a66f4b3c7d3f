//! BGP-4 for pod routing.
//!
//! The core is pure: message model, wire adapter (codec), session FSM, RIBs, graceful restart
//! and the Node-derived peer configuration (peers) perform no I/O and read no clock, nor does
//! the speaker's instance that drives them (`speaker::instance`: typed inputs, each with its
//! time, in; typed actions out). The speaker's tasks (`speaker::tasks`), bfd_io (BFD's UDP
//! sockets) and md5 (TCP_MD5SIG) are the only modules that touch sockets.

pub mod bfd;
pub mod bfd_io;
pub mod codec;
pub mod fsm;
pub mod graceful_restart;
pub mod md5;
pub mod message;
pub mod peers;
pub mod policy;
pub mod report;
pub mod rib;
pub mod sanitize;
pub mod speaker;
