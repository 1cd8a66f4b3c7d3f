//! BFD (RFC 5880) in asynchronous mode for single-hop sessions (RFC 5881): the control
//! packet codec and the session state machine, pure (timers are durations, no clock, no
//! socket). The speaker's BFD task (`bfd_io`) runs one of these per BGP peer with BFD enabled
//! and tears the BGP session down when a session that was Up goes Down (RFC 5882), so a dead
//! link is noticed in `detect multiplier × interval` instead of the BGP hold time.
//!
//! Not implemented: authentication, demand mode, the echo function (we always advertise a
//! Required Min Echo RX Interval of 0, so the peer never echoes to us).
use std::time::Duration;

pub const CONTROL_PORT: u16 = 3784;
pub const PACKET_LEN: usize = 24;
const VERSION: u8 = 1;
/// RFC 5880 §6.8.3: while not Up, transmit no faster than once a second.
const SLOW_TX: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum BfdState {
    AdminDown = 0,
    Down = 1,
    Init = 2,
    Up = 3,
}

impl BfdState {
    fn from_bits(bits: u8) -> Self {
        match bits & 3 {
            0 => BfdState::AdminDown,
            1 => BfdState::Down,
            2 => BfdState::Init,
            _ => BfdState::Up,
        }
    }
}

/// Diagnostic codes (RFC 5880 §4.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Diag {
    None = 0,
    DetectionTimeExpired = 1,
    NeighborSignaledDown = 3,
}

/// A BFD Control packet (no authentication section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlPacket {
    pub diag: u8,
    pub state: BfdState,
    pub poll: bool,
    pub final_: bool,
    pub detect_mult: u8,
    pub my_discriminator: u32,
    pub your_discriminator: u32,
    /// Microseconds.
    pub desired_min_tx: u32,
    /// Microseconds.
    pub required_min_rx: u32,
    /// Microseconds.
    pub required_min_echo_rx: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("{0} bytes, a BFD control packet has at least 24")]
    TooShort(usize),
    #[error("version {0}, expected 1")]
    Version(u8),
    #[error("length field {0} does not match the datagram ({1} bytes)")]
    Length(u8, usize),
    #[error("detect multiplier 0")]
    ZeroMultiplier,
    #[error("multipoint bit set")]
    Multipoint,
    #[error("my discriminator 0")]
    ZeroDiscriminator,
    #[error("authentication is not supported")]
    Authentication,
    #[error("your discriminator 0 in state {0:?}")]
    MissingYourDiscriminator(BfdState),
    /// RFC 5881 §5: single-hop packets are sent with TTL 255, so anything less crossed a
    /// router (or was forged off-link). None: the kernel did not report it.
    #[error("IP TTL / hop limit {0:?}, single-hop BFD requires 255")]
    TtlNot255(Option<u8>),
}

impl ControlPacket {
    pub fn encode(&self) -> [u8; PACKET_LEN] {
        let mut b = [0u8; PACKET_LEN];
        b[0] = (VERSION << 5) | (self.diag & 0x1f);
        b[1] = ((self.state as u8) << 6) | (u8::from(self.poll) << 5) | (u8::from(self.final_) << 4);
        b[2] = self.detect_mult;
        b[3] = PACKET_LEN as u8;
        b[4..8].copy_from_slice(&self.my_discriminator.to_be_bytes());
        b[8..12].copy_from_slice(&self.your_discriminator.to_be_bytes());
        b[12..16].copy_from_slice(&self.desired_min_tx.to_be_bytes());
        b[16..20].copy_from_slice(&self.required_min_rx.to_be_bytes());
        b[20..24].copy_from_slice(&self.required_min_echo_rx.to_be_bytes());
        b
    }

    /// [`Self::decode`] of a single-hop packet received with IP TTL (hop limit) `ttl`: refused
    /// unless it is 255 (RFC 5881 §5), before anything else is looked at.
    pub fn decode_single_hop(b: &[u8], ttl: Option<u8>) -> Result<Self, PacketError> {
        if ttl != Some(255) {
            return Err(PacketError::TtlNot255(ttl));
        }
        Self::decode(b)
    }

    /// Parses and validates a received packet (RFC 5880 §6.8.6, the checks before any state
    /// is touched).
    pub fn decode(b: &[u8]) -> Result<Self, PacketError> {
        if b.len() < PACKET_LEN {
            return Err(PacketError::TooShort(b.len()));
        }
        if b[0] >> 5 != VERSION {
            return Err(PacketError::Version(b[0] >> 5));
        }
        let length = b[3];
        if usize::from(length) < PACKET_LEN || usize::from(length) > b.len() {
            return Err(PacketError::Length(length, b.len()));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let packet = ControlPacket {
            diag: b[0] & 0x1f,
            state: BfdState::from_bits(b[1] >> 6),
            poll: b[1] & 0x20 != 0,
            final_: b[1] & 0x10 != 0,
            detect_mult: b[2],
            my_discriminator: u32_at(4),
            your_discriminator: u32_at(8),
            desired_min_tx: u32_at(12),
            required_min_rx: u32_at(16),
            required_min_echo_rx: u32_at(20),
        };
        if b[1] & 0x04 != 0 {
            return Err(PacketError::Authentication);
        }
        if b[1] & 0x01 != 0 {
            return Err(PacketError::Multipoint);
        }
        if packet.detect_mult == 0 {
            return Err(PacketError::ZeroMultiplier);
        }
        if packet.my_discriminator == 0 {
            return Err(PacketError::ZeroDiscriminator);
        }
        if packet.your_discriminator == 0 && !matches!(packet.state, BfdState::Down | BfdState::AdminDown) {
            return Err(PacketError::MissingYourDiscriminator(packet.state));
        }
        Ok(packet)
    }
}

/// `--bfd-desired-min-tx-interval`, `--bfd-required-min-rx-interval`,
/// `--bfd-detection-multiplier`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BfdConfig {
    pub desired_min_tx: Duration,
    pub required_min_rx: Duration,
    pub multiplier: u8,
}

impl Default for BfdConfig {
    fn default() -> Self {
        Self { desired_min_tx: Duration::from_secs(1), required_min_rx: Duration::from_secs(1), multiplier: 3 }
    }
}

/// What a session step produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BfdOutput {
    StateChanged {
        from: BfdState,
        to: BfdState,
        diag: Diag,
    },
    /// Send this packet at once (a Final answering a Poll, or our Poll after a timer change).
    SendNow(ControlPacket),
}

fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BfdSession {
    config: BfdConfig,
    state: BfdState,
    remote_state: BfdState,
    local_discriminator: u32,
    remote_discriminator: u32,
    diag: Diag,
    remote_min_rx: Duration,
    remote_desired_tx: Duration,
    remote_multiplier: u8,
    /// A Poll Sequence is running: our packets carry P until the peer answers with F.
    polling: bool,
}

impl BfdSession {
    pub fn new(local_discriminator: u32, config: BfdConfig) -> Self {
        Self {
            config,
            state: BfdState::Down,
            remote_state: BfdState::Down,
            local_discriminator,
            remote_discriminator: 0,
            diag: Diag::None,
            // RFC 5880 §6.8.1: 1 µs until the peer tells us otherwise.
            remote_min_rx: Duration::from_micros(1),
            remote_desired_tx: Duration::from_micros(1),
            remote_multiplier: 0,
            polling: false,
        }
    }

    pub fn state(&self) -> BfdState {
        self.state
    }

    pub fn local_discriminator(&self) -> u32 {
        self.local_discriminator
    }

    /// The desired TX interval we advertise: the configured one when Up, at least 1 s before.
    fn desired_tx(&self) -> Duration {
        if self.state == BfdState::Up {
            self.config.desired_min_tx
        } else {
            self.config.desired_min_tx.max(SLOW_TX)
        }
    }

    /// How often to transmit (before the caller's 75-100 % jitter, RFC 5880 §6.8.7).
    pub fn tx_interval(&self) -> Duration {
        self.desired_tx().max(self.remote_min_rx)
    }

    /// How long without a packet means the peer is gone (None before it was heard from).
    pub fn detection_time(&self) -> Option<Duration> {
        if self.remote_multiplier == 0 || !matches!(self.state, BfdState::Init | BfdState::Up) {
            return None;
        }
        Some(self.config.required_min_rx.max(self.remote_desired_tx) * u32::from(self.remote_multiplier))
    }

    /// The next periodic packet.
    pub fn packet(&self) -> ControlPacket {
        ControlPacket {
            diag: self.diag as u8,
            state: self.state,
            poll: self.polling,
            final_: false,
            detect_mult: self.config.multiplier,
            my_discriminator: self.local_discriminator,
            your_discriminator: self.remote_discriminator,
            desired_min_tx: micros(self.desired_tx()),
            required_min_rx: micros(self.config.required_min_rx),
            required_min_echo_rx: 0,
        }
    }

    fn transition(&mut self, to: BfdState, diag: Diag, out: &mut Vec<BfdOutput>) {
        let from = self.state;
        if from == to {
            return;
        }
        self.state = to;
        self.diag = diag;
        out.push(BfdOutput::StateChanged { from, to, diag });
        // Our advertised TX interval changes when entering or leaving Up: tell the peer with a
        // Poll Sequence (RFC 5880 §6.8.3), which also makes it adopt our faster rate at once.
        if (from == BfdState::Up || to == BfdState::Up) && self.config.desired_min_tx < SLOW_TX {
            self.polling = true;
            out.push(BfdOutput::SendNow(self.packet()));
        }
    }

    /// A valid packet from the peer (RFC 5880 §6.8.6).
    pub fn receive(&mut self, p: &ControlPacket) -> Vec<BfdOutput> {
        let mut out = Vec::new();
        self.remote_discriminator = p.my_discriminator;
        self.remote_state = p.state;
        self.remote_min_rx = Duration::from_micros(u64::from(p.required_min_rx));
        self.remote_desired_tx = Duration::from_micros(u64::from(p.desired_min_tx));
        self.remote_multiplier = p.detect_mult;
        if p.final_ {
            self.polling = false;
        }
        if self.state == BfdState::AdminDown {
            return out;
        }
        match (p.state, self.state) {
            (BfdState::AdminDown, state) if state != BfdState::Down => {
                self.transition(BfdState::Down, Diag::NeighborSignaledDown, &mut out)
            }
            (BfdState::AdminDown, _) => {}
            (BfdState::Down, BfdState::Down) => self.transition(BfdState::Init, Diag::None, &mut out),
            (BfdState::Init, BfdState::Down) | (BfdState::Init | BfdState::Up, BfdState::Init) => {
                self.transition(BfdState::Up, Diag::None, &mut out)
            }
            (BfdState::Down, BfdState::Up) => self.transition(BfdState::Down, Diag::NeighborSignaledDown, &mut out),
            _ => {}
        }
        if p.poll {
            let mut answer = self.packet();
            answer.poll = false;
            answer.final_ = true;
            out.push(BfdOutput::SendNow(answer));
        }
        out
    }

    /// Nothing heard from the peer for the detection time.
    pub fn detection_expired(&mut self) -> Vec<BfdOutput> {
        let mut out = Vec::new();
        if matches!(self.state, BfdState::Init | BfdState::Up) {
            self.transition(BfdState::Down, Diag::DetectionTimeExpired, &mut out);
            // Forget the peer until it speaks again.
            self.remote_discriminator = 0;
            self.remote_multiplier = 0;
            self.remote_min_rx = Duration::from_micros(1);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> BfdConfig {
        BfdConfig {
            desired_min_tx: Duration::from_millis(100),
            required_min_rx: Duration::from_millis(100),
            multiplier: 3,
        }
    }

    /// Delivers every packet of `from` (the periodic one, then any SendNow) to `to`.
    fn exchange(from: &BfdSession, to: &mut BfdSession) -> Vec<BfdOutput> {
        to.receive(&ControlPacket::decode(&from.packet().encode()).unwrap())
    }

    #[test]
    fn packets_round_trip_and_bad_ones_are_refused() {
        let session = BfdSession::new(7, fast());
        let p = session.packet();
        assert_eq!(ControlPacket::decode(&p.encode()), Ok(p));
        assert_eq!(p.encode()[0], 0x20, "version 1, no diagnostic");
        assert_eq!(p.encode()[1] >> 6, 1, "Down");
        assert_eq!(p.desired_min_tx, 1_000_000, "1 s until Up");
        let mut bytes = p.encode();
        bytes[0] = 0x40;
        assert_eq!(ControlPacket::decode(&bytes), Err(PacketError::Version(2)));
        let mut bytes = p.encode();
        bytes[2] = 0;
        assert_eq!(ControlPacket::decode(&bytes), Err(PacketError::ZeroMultiplier));
        assert_eq!(ControlPacket::decode(&bytes[..10]), Err(PacketError::TooShort(10)));
        let mut up = p;
        up.state = BfdState::Up;
        assert_eq!(ControlPacket::decode(&up.encode()), Err(PacketError::MissingYourDiscriminator(BfdState::Up)));
    }

    #[test]
    fn single_hop_packets_need_ttl_255() {
        let bytes = BfdSession::new(7, fast()).packet().encode();
        assert!(ControlPacket::decode_single_hop(&bytes, Some(255)).is_ok());
        assert_eq!(ControlPacket::decode_single_hop(&bytes, Some(254)), Err(PacketError::TtlNot255(Some(254))));
        assert_eq!(ControlPacket::decode_single_hop(&bytes, Some(1)), Err(PacketError::TtlNot255(Some(1))));
        assert_eq!(ControlPacket::decode_single_hop(&bytes, None), Err(PacketError::TtlNot255(None)));
    }

    #[test]
    fn three_way_handshake_then_detection_brings_it_down() {
        let mut a = BfdSession::new(1, fast());
        let mut b = BfdSession::new(2, fast());
        exchange(&a, &mut b); // b: Down -> Init
        assert_eq!(b.state(), BfdState::Init);
        let out = exchange(&b, &mut a); // a: Down(Init received) -> Up
        assert_eq!(a.state(), BfdState::Up);
        assert!(out.contains(&BfdOutput::StateChanged { from: BfdState::Down, to: BfdState::Up, diag: Diag::None }));
        // Up: a polls to switch to its fast rate.
        assert!(matches!(out.last(), Some(BfdOutput::SendNow(p)) if p.poll && p.desired_min_tx == 100_000));
        let out = exchange(&a, &mut b); // b: Init -> Up, answers the poll with Final
        assert_eq!(b.state(), BfdState::Up);
        assert!(out.iter().any(|o| matches!(o, BfdOutput::SendNow(p) if p.final_)));
        let final_packet = out
            .iter()
            .find_map(|o| match o {
                BfdOutput::SendNow(p) if p.final_ => Some(*p),
                _ => None,
            })
            .unwrap();
        a.receive(&final_packet);
        assert!(!a.packet().poll, "the poll sequence ended");
        exchange(&b, &mut a);
        assert_eq!(a.tx_interval(), Duration::from_millis(100));
        assert_eq!(a.detection_time(), Some(Duration::from_millis(300)));
        let out = a.detection_expired();
        assert_eq!(
            out.first(),
            Some(&BfdOutput::StateChanged { from: BfdState::Up, to: BfdState::Down, diag: Diag::DetectionTimeExpired })
        );
        assert_eq!(a.detection_time(), None);
        assert_eq!(a.tx_interval(), Duration::from_secs(1), "slow again while Down");
    }

    #[test]
    fn the_peer_going_down_or_admin_down_takes_us_down() {
        let mut a = BfdSession::new(1, fast());
        let mut b = BfdSession::new(2, fast());
        exchange(&a, &mut b);
        exchange(&b, &mut a);
        exchange(&a, &mut b);
        assert_eq!((a.state(), b.state()), (BfdState::Up, BfdState::Up));
        let mut down = b.packet();
        down.state = BfdState::Down;
        a.receive(&down);
        assert_eq!(a.state(), BfdState::Down);
        assert_eq!(a.packet().diag, Diag::NeighborSignaledDown as u8);
        exchange(&a, &mut b); // b sees Down while Up -> Down
        assert_eq!(b.state(), BfdState::Down);
        let mut admin = b.packet();
        admin.state = BfdState::AdminDown;
        a.receive(&admin);
        assert_eq!(a.state(), BfdState::Down, "AdminDown from the peer leaves us Down, not Init");
    }

    #[test]
    fn the_slower_side_sets_the_pace() {
        let mut a = BfdSession::new(1, fast());
        let mut peer = ControlPacket {
            diag: 0,
            state: BfdState::Init,
            poll: false,
            final_: false,
            detect_mult: 5,
            my_discriminator: 9,
            your_discriminator: 1,
            desired_min_tx: 300_000,
            required_min_rx: 250_000,
            required_min_echo_rx: 0,
        };
        a.receive(&peer);
        assert_eq!(a.state(), BfdState::Up);
        assert_eq!(a.tx_interval(), Duration::from_millis(250), "no faster than the peer takes");
        assert_eq!(a.detection_time(), Some(Duration::from_millis(1500)), "its multiplier x its rate");
        peer.state = BfdState::Up;
        a.receive(&peer);
        assert_eq!(a.state(), BfdState::Up);
    }
}
