//! Fault injection modes and how stalled work is released.

use std::future::pending;
use std::time::Duration;

use tokio::sync::watch;

/// How the server treats traffic; switchable at runtime with `FakeApiServer::set_mode`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FaultMode {
    /// Serve normally.
    #[default]
    Normal,
    /// Close the listening socket and all open connections: new connections are refused,
    /// like an apiserver whose process is gone. Leaving this mode listens again on the same port.
    Refuse,
    /// Accept TCP connections and read requests but never answer; already-open watch streams
    /// stop sending (no bytes, no close). Like a network partition or a lost conntrack entry.
    /// What happens to the stalled work when the mode is left is set by [`StalledRelease`].
    BlackHole,
    /// Answer every request with HTTP 500 and a Status body; open watch streams are ended
    /// cleanly so that clients reconnect into the errors.
    Errors500,
    /// Delay the start of every response by this long.
    Slow(Duration),
}

/// What happens to requests and watch streams stalled by [`FaultMode::BlackHole`] once the
/// server leaves that mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StalledRelease {
    /// They stay stalled until the client gives up (or the server stops): the packets of those
    /// connections are lost for good, as when a middlebox forgot the connection.
    #[default]
    KeepStalled,
    /// They carry on as if the network had merely been slow: pending requests are answered and
    /// watch streams deliver what happened meanwhile.
    Resume,
    /// Their connections are aborted, so clients see a reset / unexpected EOF.
    Reset,
}

/// The stalled work's connection is to be aborted.
#[derive(Debug)]
pub struct Aborted;

/// Returns at once unless the server is black-holing; otherwise waits for the mode to change and
/// then applies `release` (read at that moment, so it can be changed while traffic is stalled).
pub async fn wait_out_black_hole(
    modes: &watch::Sender<FaultMode>,
    release: impl Fn() -> StalledRelease,
) -> Result<(), Aborted> {
    let mut mode = modes.subscribe();
    if *mode.borrow_and_update() != FaultMode::BlackHole {
        return Ok(());
    }
    loop {
        if mode.changed().await.is_err() {
            // The server is gone; whoever owns this work will drop it.
            pending::<()>().await;
        }
        if *mode.borrow_and_update() != FaultMode::BlackHole {
            break;
        }
    }
    match release() {
        StalledRelease::KeepStalled => pending().await,
        StalledRelease::Resume => Ok(()),
        StalledRelease::Reset => Err(Aborted),
    }
}
