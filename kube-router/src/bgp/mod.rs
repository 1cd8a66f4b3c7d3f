//! Pure BGP-4 core: message model, wire adapter, session FSM, RIBs and
//! graceful restart. Nothing in here performs I/O or reads a clock: the
//! embedding agent feeds events (bytes, timer expiries, TCP state) in and
//! executes the returned outputs.

pub mod codec;
pub mod fsm;
pub mod graceful_restart;
pub mod message;
pub mod rib;
