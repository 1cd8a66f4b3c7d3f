//! Adapter between netgauze-bgp-pkt 0.13 and our message model, plus the
//! mapping of decode failures onto RFC 4271 §6 NOTIFICATIONs and RFC 7606
//! "treat-as-withdraw".
//!
//! Size (about 990 lines before its tests): both directions of the one netgauze adapter, each
//! mapping next to its inverse so that a change to one is seen against the other.
//!
//! This is the only module that knows about netgauze; everything else speaks
//! `super::message`.
//!
//! What netgauze's error types do not let us distinguish (documented here so
//! the integrator is not surprised):
//! * netgauze's OPEN parser itself rejects version != 4, hold time 1..=2 and
//!   a non-unicast BGP identifier, so those arrive as decode errors (mapped to
//!   2/1, 2/6, 2/3) rather than as OPENs the FSM would validate.
//! * The NOTIFICATION data for UPDATE errors is empty: netgauze does not keep
//!   the offending attribute bytes.
//! * Attribute *flag* errors and attribute *length* errors are both reported
//!   via per-attribute error variants; we cannot tell "unrecognised well-known
//!   attribute" (3/2) apart from a malformed optional one.
//! * A NOTIFICATION with a subcode netgauze does not know (e.g. Cease/0 or
//!   Cease/10+) fails to parse; `WireCodec` salvages code/subcode/data from
//!   the raw frame instead.
//! * Syntactically broken NLRI (bad prefix length) aborts the whole UPDATE
//!   in netgauze, so it becomes a session reset (3/10 or 3/1), never a
//!   treat-as-withdraw, which matches RFC 7606 §5.3 anyway.
//! * netgauze rejects *valid* NLRI it has no representation for (any
//!   MP_REACH of a family it models strictly, like IPv6 multicast with
//!   unicast prefixes; multicast ranges in unicast NLRI). [`super::sanitize`]
//!   removes those from the raw UPDATE first, so they are ignored or treated
//!   as withdrawn per prefix and the session stays up.

use std::net::{IpAddr, Ipv4Addr};

use bytes::{BufMut, BytesMut};
use netgauze_bgp_pkt::capabilities::{
    BgpCapability, FourOctetAsCapability, GracefulRestartAddressFamily, GracefulRestartCapability as NgGrCapability,
    MultiProtocolExtensionsCapability, UnrecognizedCapability,
};
use netgauze_bgp_pkt::codec::{BgpCodec, BgpCodecDecoderError};
use netgauze_bgp_pkt::community::Community;
use netgauze_bgp_pkt::iana::RouteRefreshSubcode;
use netgauze_bgp_pkt::nlri::{Ipv4Unicast, Ipv4UnicastAddress, Ipv6Unicast, Ipv6UnicastAddress};
use netgauze_bgp_pkt::notification::{
    BgpNotificationMessage as NgNotification, CeaseError, FiniteStateMachineError, HoldTimerExpiredError,
    MessageHeaderError, OpenMessageError, RouteRefreshError, UpdateMessageError,
};
use netgauze_bgp_pkt::open::{BgpOpenMessage, BgpOpenMessageParameter};
use netgauze_bgp_pkt::path_attribute::{
    As2PathSegment, As4Path, As4PathSegment, AsPath, AsPathSegmentType, AtomicAggregate, ClusterId, ClusterList,
    Communities, LocalPreference, MpReach, MpUnreach, MultiExitDiscriminator, NextHop as NgNextHop, Origin as NgOrigin,
    Originator, PathAttribute, PathAttributeValue, UnknownAttribute as NgUnknownAttribute,
};
use netgauze_bgp_pkt::route_refresh::BgpRouteRefreshMessage;
use netgauze_bgp_pkt::update::BgpUpdateMessage;
use netgauze_bgp_pkt::wire::deserializer::path_attribute::PathAttributeParsingError;
use netgauze_bgp_pkt::wire::deserializer::{BgpMessageParsingError, BgpParsingIgnoredErrors};
use netgauze_bgp_pkt::wire::serializer::BgpMessageWritingError;
use netgauze_bgp_pkt::BgpMessage;
use netgauze_iana::address_family::{AddressFamily, AddressType, SubsequentAddressFamily};
use tokio_util::codec::{Decoder, Encoder};

use super::message::{
    error_code, Afi, AsPathSegment, Capability, Family, GracefulRestartCapability, GracefulRestartFamily, Message,
    NextHop, Notification, Open, Origin, PathAttributes, Prefix, Safi, UnknownAttribute, Update, AS_TRANS,
    MAX_RESTART_TIME_SECS,
};
use super::sanitize::sanitize_update;

/// RFC 4271 §4.1: without the Extended Message capability (which we never
/// advertise) no message may exceed 4096 octets.
pub const MAX_MESSAGE_LEN: usize = 4096;
const HEADER_LEN: usize = 19;
const MESSAGE_TYPE_UPDATE: u8 = 2;
const MESSAGE_TYPE_NOTIFICATION: u8 = 3;
/// Prefixes per UPDATE, chosen so that even /32 IPv4 (5 B) or /128 IPv6
/// (17 B) NLRI plus a generous attribute block stay under 4096 octets.
const MAX_V4_PREFIXES_PER_UPDATE: usize = 400;
const MAX_V6_PREFIXES_PER_UPDATE: usize = 150;

/// Result of decoding one frame from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeOutcome {
    /// A well-formed message.
    Message(Message),
    /// RFC 7606 treat-as-withdraw: the UPDATE had a malformed attribute; its
    /// prefixes (announced and withdrawn) must be removed, session stays up.
    TreatAsWithdraw { withdrawn: Vec<Prefix>, reason: String },
    /// A well-formed UPDATE with parts we cannot use, the session kept: NLRI of address
    /// families we do not route are ignored, and prefixes our codec cannot represent (a
    /// multicast range in unicast NLRI) are treated as withdrawn (in `update.withdrawn`).
    /// `ignored` says what, once per kind.
    PartlyIgnored { update: Update, ignored: Vec<String> },
    /// Fatal: send this NOTIFICATION and close the connection.
    Notify(Notification),
    /// Transport failure; close without sending anything.
    ConnectionError(String),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EncodeError {
    #[error("address family {0:?}/{1:?} cannot be encoded")]
    UnsupportedFamily(Afi, Safi),
    #[error("prefix {0} is not a valid unicast network")]
    InvalidPrefix(Prefix),
    #[error("notification {code}/{subcode} has no netgauze representation")]
    UnrepresentableNotification { code: u8, subcode: u8 },
    #[error("invalid path attribute: {0}")]
    InvalidAttribute(String),
    #[error("netgauze could not write the message: {0}")]
    Writing(String),
}

impl From<BgpMessageWritingError> for EncodeError {
    fn from(e: BgpMessageWritingError) -> Self {
        EncodeError::Writing(e.to_string())
    }
}

// ---------------------------------------------------------------------------
// Framing wrapper
// ---------------------------------------------------------------------------

/// Byte-level codec for one BGP connection. Wraps netgauze's `BgpCodec`
/// (which tracks 4-octet-AS negotiation by observing the OPENs that pass
/// through) and always yields our model. Create one per TCP connection.
#[derive(Debug)]
pub struct WireCodec {
    inner: BgpCodec,
    sent_four_octet_as: bool,
    received_four_octet_as: bool,
}

impl Default for WireCodec {
    fn default() -> Self {
        Self::new()
    }
}

impl WireCodec {
    pub fn new() -> Self {
        // `BgpCodec::new` builds a *lenient* parsing context (malformed path
        // attributes are collected instead of failing the message), which is
        // what RFC 7606 error handling needs. `BgpCodec::default()` is strict.
        Self {
            // Both flags start true to mirror `BgpCodec::new(true)`; the
            // OPENs exchanged on the connection then set the real values.
            inner: BgpCodec::new(true),
            sent_four_octet_as: true,
            received_four_octet_as: true,
        }
    }

    /// Both sides advertised the 4-octet AS capability (RFC 6793).
    pub fn four_octet_as(&self) -> bool {
        self.sent_four_octet_as && self.received_four_octet_as
    }

    /// Decode the next complete message in `buf`, consuming it. `None` means
    /// more bytes are needed. After `Notify`/`ConnectionError` the connection
    /// must be closed; the buffer state is then irrelevant.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Option<DecodeOutcome> {
        if buf.len() < HEADER_LEN {
            return None;
        }
        let length = usize::from(u16::from_be_bytes([buf[16], buf[17]]));
        if !(HEADER_LEN..=MAX_MESSAGE_LEN).contains(&length) {
            // netgauze would not consume a frame with length < 19, and it
            // accepts UPDATEs > 4096; both are 1/2 Bad Message Length.
            buf.clear();
            return Some(DecodeOutcome::Notify(Notification::new(
                error_code::MESSAGE_HEADER,
                2,
                (length as u16).to_be_bytes().to_vec(),
            )));
        }
        if buf.len() < length {
            return None;
        }
        if buf[18] == MESSAGE_TYPE_UPDATE {
            if let Some(sanitized) = sanitize_update(&buf[..length]) {
                let _ = buf.split_to(length);
                let Some(frame) = sanitized.frame else {
                    let update = Update { withdrawn: sanitized.withdrawn, ..Update::default() };
                    return Some(DecodeOutcome::PartlyIgnored { update, ignored: sanitized.ignored });
                };
                let outcome = self.decode_frame(&mut BytesMut::from(&frame[..]), frame.len())?;
                return Some(match outcome {
                    DecodeOutcome::Message(Message::Update(mut update)) => {
                        update.withdrawn.extend(sanitized.withdrawn);
                        DecodeOutcome::PartlyIgnored { update, ignored: sanitized.ignored }
                    }
                    DecodeOutcome::TreatAsWithdraw { mut withdrawn, reason } => {
                        withdrawn.extend(sanitized.withdrawn);
                        DecodeOutcome::TreatAsWithdraw { withdrawn, reason }
                    }
                    other => other,
                });
            }
        }
        self.decode_frame(buf, length)
    }

    /// Decodes the complete frame of `length` octets at the start of `buf`.
    fn decode_frame(&mut self, buf: &mut BytesMut, length: usize) -> Option<DecodeOutcome> {
        // Keep a raw copy of NOTIFICATIONs: netgauze refuses unknown subcodes.
        let raw_notification = (buf[18] == MESSAGE_TYPE_NOTIFICATION && length >= 21)
            .then(|| Notification::new(buf[19], buf[20], buf[21..length].to_vec()));
        match self.inner.decode(buf) {
            Ok(None) => None,
            Ok(Some((msg, ignored))) => {
                let outcome = from_wire(msg, &ignored, self.four_octet_as());
                if let DecodeOutcome::Message(Message::Open(open)) = &outcome {
                    self.received_four_octet_as = open.four_octet_asn_capability().is_some();
                }
                Some(outcome)
            }
            Err(BgpCodecDecoderError::BgpMessageParsingError(
                BgpMessageParsingError::BgpNotificationMessageParsingError(_),
            )) if raw_notification.is_some() => {
                raw_notification.map(|n| DecodeOutcome::Message(Message::Notification(n)))
            }
            Err(e) => Some(classify_decode_error(&e)),
        }
    }

    /// Encode `msg` (possibly as several UPDATEs) and append it to `dst`.
    pub fn encode(&mut self, msg: &Message, dst: &mut BytesMut) -> Result<(), EncodeError> {
        if let Message::Open(open) = msg {
            self.sent_four_octet_as = open.four_octet_asn_capability().is_some();
        }
        if let Message::Notification(n) = msg {
            if notification_to_wire(n).is_err() {
                write_raw_notification(n, dst);
                return Ok(());
            }
        }
        let wire = to_wire(msg, self.four_octet_as())?;
        for m in wire {
            self.inner.encode(m, dst)?;
        }
        Ok(())
    }
}

/// NOTIFICATION is simple enough to write by hand, which lets us send codes
/// netgauze has no variant for (e.g. Cease/0).
fn write_raw_notification(n: &Notification, dst: &mut BytesMut) {
    let data_len = n.data.len().min(MAX_MESSAGE_LEN - HEADER_LEN - 2);
    dst.put_slice(&[0xff; 16]);
    dst.put_u16((HEADER_LEN + 2 + data_len) as u16);
    dst.put_u8(MESSAGE_TYPE_NOTIFICATION);
    dst.put_u8(n.code);
    dst.put_u8(n.subcode);
    dst.put_slice(&n.data[..data_len]);
}

/// Map a hard netgauze decode failure to what the session must do.
pub fn classify_decode_error(err: &BgpCodecDecoderError) -> DecodeOutcome {
    match err {
        BgpCodecDecoderError::IoError(e) => DecodeOutcome::ConnectionError(e.to_string()),
        // netgauze's own framing never reports this for complete frames; if it
        // does the frame is truncated, which is a length error.
        BgpCodecDecoderError::Incomplete(_) => {
            DecodeOutcome::Notify(Notification::new(error_code::MESSAGE_HEADER, 2, Vec::new()))
        }
        BgpCodecDecoderError::BgpMessageParsingError(e) => match e {
            // RFC 4271 §6.4: a malformed NOTIFICATION is not answered with
            // another NOTIFICATION; just drop the connection.
            BgpMessageParsingError::BgpNotificationMessageParsingError(inner) => {
                DecodeOutcome::ConnectionError(format!("malformed NOTIFICATION: {inner}"))
            }
            other => DecodeOutcome::Notify(notification_from_wire(&NgNotification::from(other.clone()))),
        },
    }
}

// ---------------------------------------------------------------------------
// Family helpers
// ---------------------------------------------------------------------------

fn address_type(afi: Afi, safi: Safi) -> Option<AddressType> {
    let afi = AddressFamily::try_from(afi.to_u16()).ok()?;
    let safi = SubsequentAddressFamily::try_from(safi.to_u8()).ok()?;
    AddressType::from_afi_safi(afi, safi).ok()
}

fn afi_safi_of(at: AddressType) -> (Afi, Safi) {
    (Afi::from_u16(at.address_family().into()), Safi::from_u8(at.subsequent_address_family().into()))
}

fn v4_nlri(prefix: Prefix) -> Result<Ipv4UnicastAddress, EncodeError> {
    let Prefix::V4 { addr, len } = prefix else {
        return Err(EncodeError::InvalidPrefix(prefix));
    };
    let net = ipnet::Ipv4Net::new(addr, len).map_err(|_| EncodeError::InvalidPrefix(prefix))?;
    let unicast = Ipv4Unicast::from_net(net).map_err(|_| EncodeError::InvalidPrefix(prefix))?;
    Ok(Ipv4UnicastAddress::new_no_path_id(unicast))
}

fn v6_nlri(prefix: Prefix) -> Result<Ipv6UnicastAddress, EncodeError> {
    let Prefix::V6 { addr, len } = prefix else {
        return Err(EncodeError::InvalidPrefix(prefix));
    };
    let net = ipnet::Ipv6Net::new(addr, len).map_err(|_| EncodeError::InvalidPrefix(prefix))?;
    let unicast = Ipv6Unicast::from_net(net).map_err(|_| EncodeError::InvalidPrefix(prefix))?;
    Ok(Ipv6UnicastAddress::new(None, unicast))
}

fn prefix_from_v4(a: &Ipv4UnicastAddress) -> Option<Prefix> {
    let net = a.network().address();
    Prefix::new(IpAddr::V4(net.addr()), net.prefix_len()).ok()
}

fn prefix_from_v6(a: &Ipv6UnicastAddress) -> Option<Prefix> {
    let net = a.network().address();
    Prefix::new(IpAddr::V6(net.addr()), net.prefix_len()).ok()
}

// ---------------------------------------------------------------------------
// Encoding: ours -> netgauze
// ---------------------------------------------------------------------------

/// Convert one of our messages into one or more netgauze messages. An
/// `Update` may need several wire UPDATEs (one NEXT_HOP / MP_REACH each, and
/// the 4096-octet limit). `four_octet_as` selects the AS_PATH encoding.
pub fn to_wire(msg: &Message, four_octet_as: bool) -> Result<Vec<BgpMessage>, EncodeError> {
    Ok(match msg {
        Message::Open(open) => vec![BgpMessage::Open(open_to_wire(open))],
        Message::Keepalive => vec![BgpMessage::KeepAlive],
        Message::Notification(n) => vec![BgpMessage::Notification(notification_to_wire(n)?)],
        Message::RouteRefresh(afi, safi) => {
            let at = address_type(*afi, *safi).ok_or(EncodeError::UnsupportedFamily(*afi, *safi))?;
            vec![BgpMessage::RouteRefresh(BgpRouteRefreshMessage::new(at, RouteRefreshSubcode::NormalRequest))]
        }
        Message::EndOfRib(afi, safi) => vec![BgpMessage::Update(end_of_rib_to_wire(*afi, *safi)?)],
        Message::Update(update) => update_to_wire(update, four_octet_as)?.into_iter().map(BgpMessage::Update).collect(),
    })
}

fn open_to_wire(open: &Open) -> BgpOpenMessage {
    let caps: Vec<BgpCapability> = open.capabilities.iter().map(capability_to_wire).collect();
    let params = if caps.is_empty() { vec![] } else { vec![BgpOpenMessageParameter::new_capabilities(caps)] };
    BgpOpenMessage::new(open.two_octet_asn(), open.hold_time, open.router_id, params)
}

fn capability_to_wire(cap: &Capability) -> BgpCapability {
    match cap {
        Capability::MultiProtocol(afi, safi) => match address_type(*afi, *safi) {
            Some(at) => BgpCapability::MultiProtocolExtensions(MultiProtocolExtensionsCapability::new(at)),
            // Families netgauze has no name for go out as raw capability 1.
            None => {
                let [a, b] = afi.to_u16().to_be_bytes();
                BgpCapability::Unrecognized(UnrecognizedCapability::new(1, vec![a, b, 0, safi.to_u8()]))
            }
        },
        Capability::FourOctetAs(asn) => BgpCapability::FourOctetAs(FourOctetAsCapability::new(*asn)),
        Capability::RouteRefresh => BgpCapability::RouteRefresh,
        Capability::GracefulRestart(gr) => {
            let families: Vec<GracefulRestartAddressFamily> = gr
                .families
                .iter()
                .filter_map(|f| {
                    address_type(f.afi, f.safi).map(|at| GracefulRestartAddressFamily::new(f.forwarding_preserved, at))
                })
                .collect();
            // netgauze ORs the time into the flags word unmasked: clamp it.
            BgpCapability::GracefulRestartCapability(NgGrCapability::new(
                gr.restart_state,
                false,
                gr.restart_time_secs.min(MAX_RESTART_TIME_SECS),
                families,
            ))
        }
        Capability::Unknown { code, value } => {
            BgpCapability::Unrecognized(UnrecognizedCapability::new(*code, value.clone()))
        }
    }
}

fn end_of_rib_to_wire(afi: Afi, safi: Safi) -> Result<BgpUpdateMessage, EncodeError> {
    if (afi, safi) == (Afi::Ipv4, Safi::Unicast) {
        return Ok(BgpUpdateMessage::new(vec![], vec![], vec![]));
    }
    let unreach = if (afi, safi) == (Afi::Ipv6, Safi::Unicast) {
        MpUnreach::Ipv6Unicast { nlri: Box::new([]) }
    } else {
        let afi_ng = AddressFamily::try_from(afi.to_u16()).map_err(|_| EncodeError::UnsupportedFamily(afi, safi))?;
        let safi_ng =
            SubsequentAddressFamily::try_from(safi.to_u8()).map_err(|_| EncodeError::UnsupportedFamily(afi, safi))?;
        MpUnreach::Unknown { afi: afi_ng, safi: safi_ng, nlri: Box::new([]) }
    };
    Ok(BgpUpdateMessage::new(vec![], vec![attr(true, false, true, PathAttributeValue::MpUnreach(unreach))?], vec![]))
}

fn attr(
    optional: bool,
    transitive: bool,
    extended_length: bool,
    value: PathAttributeValue,
) -> Result<PathAttribute, EncodeError> {
    PathAttribute::from(optional, transitive, false, extended_length, value)
        .map_err(|(v, e)| EncodeError::InvalidAttribute(format!("{v:?}: {e:?}")))
}

fn segment_type(seg: &AsPathSegment) -> (AsPathSegmentType, &[u32]) {
    match seg {
        AsPathSegment::Sequence(a) => (AsPathSegmentType::AsSequence, a),
        AsPathSegment::Set(a) => (AsPathSegmentType::AsSet, a),
    }
}

/// Attributes common to all UPDATEs generated from one of our `Update`s.
fn attributes_to_wire(attrs: &PathAttributes, four_octet_as: bool) -> Result<Vec<PathAttribute>, EncodeError> {
    let origin = match attrs.origin {
        Origin::Igp => NgOrigin::IGP,
        Origin::Egp => NgOrigin::EGP,
        Origin::Incomplete => NgOrigin::Incomplete,
    };
    let mut out = vec![attr(false, true, false, PathAttributeValue::Origin(origin))?];
    let as4_segments: Vec<As4PathSegment> = attrs
        .as_path
        .iter()
        .map(|s| {
            let (t, asns) = segment_type(s);
            As4PathSegment::new(t, asns.to_vec())
        })
        .collect();
    if four_octet_as {
        out.push(attr(false, true, true, PathAttributeValue::AsPath(AsPath::As4PathSegments(as4_segments.into())))?);
    } else {
        // RFC 6793 §4.2.2: 2-octet AS_PATH with AS_TRANS, real path in AS4_PATH.
        let needs_as4 = attrs.as_path.iter().any(|s| {
            let (_, asns) = segment_type(s);
            asns.iter().any(|a| *a > u32::from(u16::MAX))
        });
        let as2: Vec<As2PathSegment> = attrs
            .as_path
            .iter()
            .map(|s| {
                let (t, asns) = segment_type(s);
                let asns: Vec<u16> = asns.iter().map(|a| u16::try_from(*a).unwrap_or(AS_TRANS)).collect();
                As2PathSegment::new(t, asns)
            })
            .collect();
        out.push(attr(false, true, true, PathAttributeValue::AsPath(AsPath::As2PathSegments(as2.into())))?);
        if needs_as4 {
            out.push(attr(true, true, true, PathAttributeValue::As4Path(As4Path::new(as4_segments)))?);
        }
    }
    if let Some(med) = attrs.med {
        out.push(attr(
            true,
            false,
            false,
            PathAttributeValue::MultiExitDiscriminator(MultiExitDiscriminator::new(med)),
        )?);
    }
    if let Some(lp) = attrs.local_pref {
        out.push(attr(false, true, false, PathAttributeValue::LocalPreference(LocalPreference::new(lp)))?);
    }
    if attrs.atomic_aggregate {
        out.push(attr(false, true, false, PathAttributeValue::AtomicAggregate(AtomicAggregate))?);
    }
    if !attrs.communities.is_empty() {
        let c: Vec<Community> = attrs.communities.iter().map(|c| Community::new(*c)).collect();
        out.push(attr(true, true, true, PathAttributeValue::Communities(Communities::new(c)))?);
    }
    if let Some(id) = attrs.originator_id {
        out.push(attr(true, false, false, PathAttributeValue::Originator(Originator::new(id)))?);
    }
    if !attrs.cluster_list.is_empty() {
        let ids: Vec<ClusterId> = attrs.cluster_list.iter().map(|i| ClusterId::new(*i)).collect();
        out.push(attr(true, false, true, PathAttributeValue::ClusterList(ClusterList::new(ids)))?);
    }
    for u in &attrs.unknown {
        // RFC 4271 §9: pass on optional transitive attributes, marking them
        // partial because we did not understand them.
        out.push(
            PathAttribute::from(
                true,
                u.transitive,
                u.partial || u.transitive,
                true,
                PathAttributeValue::UnknownAttribute(NgUnknownAttribute::new(u.code, u.value.clone())),
            )
            .map_err(|(v, e)| EncodeError::InvalidAttribute(format!("{v:?}: {e:?}")))?,
        );
    }
    Ok(out)
}

fn update_to_wire(update: &Update, four_octet_as: bool) -> Result<Vec<BgpUpdateMessage>, EncodeError> {
    let mut out = Vec::new();

    // Withdrawals: classic field for IPv4, MP_UNREACH for IPv6. No attributes.
    let (w4, w6): (Vec<Prefix>, Vec<Prefix>) = update.withdrawn.iter().partition(|p| p.family() == Family::Ipv4Unicast);
    for chunk in w4.chunks(MAX_V4_PREFIXES_PER_UPDATE) {
        let nlri = chunk.iter().map(|p| v4_nlri(*p)).collect::<Result<Vec<_>, _>>()?;
        out.push(BgpUpdateMessage::new(nlri, vec![], vec![]));
    }
    for chunk in w6.chunks(MAX_V6_PREFIXES_PER_UPDATE) {
        let nlri = chunk.iter().map(|p| v6_nlri(*p)).collect::<Result<Vec<_>, _>>()?;
        let unreach = MpUnreach::Ipv6Unicast { nlri: nlri.into() };
        out.push(BgpUpdateMessage::new(
            vec![],
            vec![attr(true, false, true, PathAttributeValue::MpUnreach(unreach))?],
            vec![],
        ));
    }

    if update.announced.is_empty() {
        return Ok(out);
    }
    let common = attributes_to_wire(&update.attributes, four_octet_as)?;

    // One wire UPDATE per (prefix family, next hop) group, in first-seen order.
    let mut groups: Vec<((Family, NextHop), Vec<Prefix>)> = Vec::new();
    for (prefix, nh) in &update.announced {
        let key = (prefix.family(), *nh);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(*prefix),
            None => groups.push((key, vec![*prefix])),
        }
    }
    for ((family, nh), prefixes) in groups {
        let chunk_size = match family {
            Family::Ipv4Unicast => MAX_V4_PREFIXES_PER_UPDATE,
            Family::Ipv6Unicast => MAX_V6_PREFIXES_PER_UPDATE,
        };
        for chunk in prefixes.chunks(chunk_size) {
            let mut attrs = common.clone();
            let mut classic_nlri = Vec::new();
            match (family, nh) {
                // IPv4 with IPv4 next hop: classic encoding, understood by all.
                (Family::Ipv4Unicast, NextHop::V4(a)) => {
                    attrs.push(attr(false, true, false, PathAttributeValue::NextHop(NgNextHop::new(a)))?);
                    classic_nlri = chunk.iter().map(|p| v4_nlri(*p)).collect::<Result<_, _>>()?;
                }
                // RFC 8950: IPv4 NLRI with an IPv6 next hop.
                (Family::Ipv4Unicast, NextHop::V6 { global, link_local }) => {
                    let nlri = chunk.iter().map(|p| v4_nlri(*p)).collect::<Result<Vec<_>, _>>()?;
                    attrs.push(attr(
                        true,
                        false,
                        true,
                        PathAttributeValue::MpReach(MpReach::Ipv4Unicast {
                            next_hop: IpAddr::V6(global),
                            next_hop_local: link_local,
                            nlri: nlri.into(),
                        }),
                    )?);
                }
                (Family::Ipv6Unicast, nh) => {
                    let (global, link_local) = match nh {
                        NextHop::V6 { global, link_local } => (global, link_local),
                        // IPv4-mapped IPv6 next hop (RFC 4291 §2.5.5.2).
                        NextHop::V4(a) => (a.to_ipv6_mapped(), None),
                    };
                    let nlri = chunk.iter().map(|p| v6_nlri(*p)).collect::<Result<Vec<_>, _>>()?;
                    attrs.push(attr(
                        true,
                        false,
                        true,
                        PathAttributeValue::MpReach(MpReach::Ipv6Unicast {
                            next_hop_global: global,
                            next_hop_local: link_local,
                            nlri: nlri.into(),
                        }),
                    )?);
                }
            }
            out.push(BgpUpdateMessage::new(vec![], attrs, classic_nlri));
        }
    }
    Ok(out)
}

/// Our (code, subcode, data) -> netgauze's typed notification. Fails for
/// combinations netgauze cannot express; `WireCodec` then writes raw bytes.
pub fn notification_to_wire(n: &Notification) -> Result<NgNotification, EncodeError> {
    let value: Box<[u8]> = n.data.clone().into();
    let unrepresentable = EncodeError::UnrepresentableNotification { code: n.code, subcode: n.subcode };
    Ok(match n.code {
        1 => NgNotification::MessageHeaderError(match n.subcode {
            0 => MessageHeaderError::Unspecific { value },
            1 => MessageHeaderError::ConnectionNotSynchronized { value },
            2 => MessageHeaderError::BadMessageLength { value },
            3 => MessageHeaderError::BadMessageType { value },
            _ => return Err(unrepresentable),
        }),
        2 => NgNotification::OpenMessageError(match n.subcode {
            0 => OpenMessageError::Unspecific { value },
            1 => OpenMessageError::UnsupportedVersionNumber { value },
            2 => OpenMessageError::BadPeerAs { value },
            3 => OpenMessageError::BadBgpIdentifier { value },
            4 => OpenMessageError::UnsupportedOptionalParameter { value },
            6 => OpenMessageError::UnacceptableHoldTime { value },
            7 => OpenMessageError::UnsupportedCapability { value },
            11 => OpenMessageError::RoleMismatch { value },
            _ => return Err(unrepresentable),
        }),
        3 => NgNotification::UpdateMessageError(match n.subcode {
            0 => UpdateMessageError::Unspecific { value },
            1 => UpdateMessageError::MalformedAttributeList { value },
            2 => UpdateMessageError::UnrecognizedWellKnownAttribute { value },
            3 => UpdateMessageError::MissingWellKnownAttribute { value },
            4 => UpdateMessageError::AttributeFlagsError { value },
            5 => UpdateMessageError::AttributeLengthError { value },
            6 => UpdateMessageError::InvalidOriginAttribute { value },
            8 => UpdateMessageError::InvalidNextHopAttribute { value },
            9 => UpdateMessageError::OptionalAttributeError { value },
            10 => UpdateMessageError::InvalidNetworkField { value },
            11 => UpdateMessageError::MalformedAsPath { value },
            _ => return Err(unrepresentable),
        }),
        4 => NgNotification::HoldTimerExpiredError(HoldTimerExpiredError::Unspecific { sub_code: n.subcode, value }),
        5 => NgNotification::FiniteStateMachineError(match n.subcode {
            0 => FiniteStateMachineError::Unspecific { value },
            1 => FiniteStateMachineError::ReceiveUnexpectedMessageInOpenSentState { value },
            2 => FiniteStateMachineError::ReceiveUnexpectedMessageInOpenConfirmState { value },
            3 => FiniteStateMachineError::ReceiveUnexpectedMessageInEstablishedState { value },
            _ => return Err(unrepresentable),
        }),
        6 => NgNotification::CeaseError(match n.subcode {
            1 => CeaseError::MaximumNumberOfPrefixesReached { value },
            2 => CeaseError::AdministrativeShutdown { value },
            3 => CeaseError::PeerDeConfigured { value },
            4 => CeaseError::AdministrativeReset { value },
            5 => CeaseError::ConnectionRejected { value },
            6 => CeaseError::OtherConfigurationChange { value },
            7 => CeaseError::ConnectionCollisionResolution { value },
            8 => CeaseError::OutOfResources { value },
            9 => CeaseError::HardReset { value },
            10 => CeaseError::BfdDown { value },
            _ => return Err(unrepresentable),
        }),
        7 => NgNotification::RouteRefreshError(match n.subcode {
            1 => RouteRefreshError::InvalidMessageLength { value },
            _ => return Err(unrepresentable),
        }),
        _ => return Err(unrepresentable),
    })
}

pub fn notification_from_wire(n: &NgNotification) -> Notification {
    let (code, subcode, data): (u8, u8, &[u8]) = match n {
        NgNotification::MessageHeaderError(e) => match e {
            MessageHeaderError::Unspecific { value } => (1, 0, value),
            MessageHeaderError::ConnectionNotSynchronized { value } => (1, 1, value),
            MessageHeaderError::BadMessageLength { value } => (1, 2, value),
            MessageHeaderError::BadMessageType { value } => (1, 3, value),
        },
        NgNotification::OpenMessageError(e) => match e {
            OpenMessageError::Unspecific { value } => (2, 0, value),
            OpenMessageError::UnsupportedVersionNumber { value } => (2, 1, value),
            OpenMessageError::BadPeerAs { value } => (2, 2, value),
            OpenMessageError::BadBgpIdentifier { value } => (2, 3, value),
            OpenMessageError::UnsupportedOptionalParameter { value } => (2, 4, value),
            OpenMessageError::UnacceptableHoldTime { value } => (2, 6, value),
            OpenMessageError::UnsupportedCapability { value } => (2, 7, value),
            OpenMessageError::RoleMismatch { value } => (2, 11, value),
        },
        NgNotification::UpdateMessageError(e) => match e {
            UpdateMessageError::Unspecific { value } => (3, 0, value),
            UpdateMessageError::MalformedAttributeList { value } => (3, 1, value),
            UpdateMessageError::UnrecognizedWellKnownAttribute { value } => (3, 2, value),
            UpdateMessageError::MissingWellKnownAttribute { value } => (3, 3, value),
            UpdateMessageError::AttributeFlagsError { value } => (3, 4, value),
            UpdateMessageError::AttributeLengthError { value } => (3, 5, value),
            UpdateMessageError::InvalidOriginAttribute { value } => (3, 6, value),
            UpdateMessageError::InvalidNextHopAttribute { value } => (3, 8, value),
            UpdateMessageError::OptionalAttributeError { value } => (3, 9, value),
            UpdateMessageError::InvalidNetworkField { value } => (3, 10, value),
            UpdateMessageError::MalformedAsPath { value } => (3, 11, value),
        },
        NgNotification::HoldTimerExpiredError(HoldTimerExpiredError::Unspecific { sub_code, value }) => {
            (4, *sub_code, value)
        }
        NgNotification::FiniteStateMachineError(e) => match e {
            FiniteStateMachineError::Unspecific { value } => (5, 0, value),
            FiniteStateMachineError::ReceiveUnexpectedMessageInOpenSentState { value } => (5, 1, value),
            FiniteStateMachineError::ReceiveUnexpectedMessageInOpenConfirmState { value } => (5, 2, value),
            FiniteStateMachineError::ReceiveUnexpectedMessageInEstablishedState { value } => (5, 3, value),
        },
        NgNotification::CeaseError(e) => match e {
            CeaseError::MaximumNumberOfPrefixesReached { value } => (6, 1, value),
            CeaseError::AdministrativeShutdown { value } => (6, 2, value),
            CeaseError::PeerDeConfigured { value } => (6, 3, value),
            CeaseError::AdministrativeReset { value } => (6, 4, value),
            CeaseError::ConnectionRejected { value } => (6, 5, value),
            CeaseError::OtherConfigurationChange { value } => (6, 6, value),
            CeaseError::ConnectionCollisionResolution { value } => (6, 7, value),
            CeaseError::OutOfResources { value } => (6, 8, value),
            CeaseError::HardReset { value } => (6, 9, value),
            CeaseError::BfdDown { value } => (6, 10, value),
        },
        NgNotification::RouteRefreshError(RouteRefreshError::InvalidMessageLength { value }) => (7, 1, value),
    };
    Notification::new(code, subcode, data.to_vec())
}

// ---------------------------------------------------------------------------
// Decoding: netgauze -> ours
// ---------------------------------------------------------------------------

/// Convert a successfully parsed netgauze message (with the errors its
/// lenient parser recorded) into our model, applying RFC 7606.
/// `four_octet_as` tells whether AS_PATH was 4-octet on this session.
pub fn from_wire(msg: BgpMessage, ignored: &BgpParsingIgnoredErrors, four_octet_as: bool) -> DecodeOutcome {
    match msg {
        BgpMessage::Open(open) => DecodeOutcome::Message(Message::Open(open_from_wire(&open))),
        BgpMessage::KeepAlive => DecodeOutcome::Message(Message::Keepalive),
        BgpMessage::Notification(n) => DecodeOutcome::Message(Message::Notification(notification_from_wire(&n))),
        BgpMessage::RouteRefresh(rr) => {
            let (afi, safi) = afi_safi_of(rr.address_type());
            DecodeOutcome::Message(Message::RouteRefresh(afi, safi))
        }
        BgpMessage::Update(update) => update_from_wire(&update, ignored, four_octet_as),
    }
}

fn open_from_wire(open: &BgpOpenMessage) -> Open {
    let capabilities: Vec<Capability> = open.capabilities().into_iter().map(capability_from_wire).collect();
    let my_asn = capabilities
        .iter()
        .find_map(|c| match c {
            Capability::FourOctetAs(a) => Some(*a),
            _ => None,
        })
        .unwrap_or(u32::from(open.my_as()));
    Open { version: open.version(), my_asn, hold_time: open.hold_time(), router_id: open.bgp_id(), capabilities }
}

fn capability_from_wire(cap: &BgpCapability) -> Capability {
    match cap {
        BgpCapability::MultiProtocolExtensions(mp) => {
            let (afi, safi) = afi_safi_of(mp.address_type());
            Capability::MultiProtocol(afi, safi)
        }
        BgpCapability::FourOctetAs(c) => Capability::FourOctetAs(c.asn4()),
        BgpCapability::RouteRefresh => Capability::RouteRefresh,
        BgpCapability::GracefulRestartCapability(gr) => Capability::GracefulRestart(GracefulRestartCapability {
            restart_state: gr.restart(),
            restart_time_secs: gr.time(),
            families: gr
                .address_families()
                .iter()
                .map(|f| {
                    let (afi, safi) = afi_safi_of(f.address_type());
                    GracefulRestartFamily { afi, safi, forwarding_preserved: f.forwarding_state() }
                })
                .collect(),
        }),
        BgpCapability::Unrecognized(u) => Capability::Unknown { code: *u.code(), value: u.value().to_vec() },
        // Capabilities we understand the existence of but do not use: keep
        // the code only (value not needed by anything downstream).
        other => Capability::Unknown { code: other.code().map(u8::from).unwrap_or_else(|c| c), value: Vec::new() },
    }
}

fn segments_from_wire(path: &AsPath) -> Vec<AsPathSegment> {
    let mk = |t: AsPathSegmentType, asns: Vec<u32>| match t {
        AsPathSegmentType::AsSet => AsPathSegment::Set(asns),
        AsPathSegmentType::AsSequence => AsPathSegment::Sequence(asns),
    };
    match path {
        AsPath::As2PathSegments(s) => s
            .iter()
            .map(|seg| mk(seg.segment_type(), seg.as_numbers().iter().map(|a| u32::from(*a)).collect()))
            .collect(),
        AsPath::As4PathSegments(s) => s.iter().map(|seg| mk(seg.segment_type(), seg.as_numbers().to_vec())).collect(),
    }
}

/// RFC 6793 §4.2.3: reconstruct the real path from a 2-octet AS_PATH and
/// AS4_PATH. Simplified: if AS4_PATH is not longer than AS_PATH, keep the
/// leading (len(AS_PATH) - len(AS4_PATH)) ASNs of AS_PATH as a sequence and
/// append AS4_PATH; otherwise AS4_PATH is ignored as the RFC requires.
fn merge_as4_path(as2: Vec<AsPathSegment>, as4: Vec<AsPathSegment>) -> Vec<AsPathSegment> {
    let len2 = super::message::as_path_length(&as2);
    let len4 = super::message::as_path_length(&as4);
    if len4 > len2 {
        return as2;
    }
    let mut keep = len2 - len4;
    let mut merged = Vec::new();
    for seg in as2 {
        if keep == 0 {
            break;
        }
        match seg {
            AsPathSegment::Sequence(asns) => {
                let take = keep.min(asns.len());
                keep -= take;
                merged.push(AsPathSegment::Sequence(asns[..take].to_vec()));
            }
            set @ AsPathSegment::Set(_) => {
                keep -= 1;
                merged.push(set);
            }
        }
    }
    merged.extend(as4);
    merged
}

/// RFC 7606 handling for one recorded path-attribute error.
enum AttributeErrorAction {
    /// The attribute was dropped by the parser and that is all we need.
    Discard,
    TreatAsWithdraw,
    SessionReset(Notification),
}

fn classify_attribute_error(err: &PathAttributeParsingError) -> AttributeErrorAction {
    use PathAttributeParsingError as E;
    match err {
        // RFC 7606 §7.6/§7.7: ATOMIC_AGGREGATE / AGGREGATOR -> attribute discard.
        // AIGP (RFC 7311), BGP-LS (RFC 9552) and Prefix-SID (RFC 8669) also
        // specify attribute discard.
        E::AtomicAggregateError(_)
        | E::AggregatorError(_)
        | E::AigpError(_)
        | E::BgpLsError(_)
        | E::SegmentIdentifierParsingError(_) => AttributeErrorAction::Discard,
        // RFC 7606 §7.3 / §5.3: if MP_(UN)REACH cannot be parsed we cannot
        // know which prefixes to withdraw: session reset.
        E::MpReachErrorError(_) | E::MpUnreachErrorError(_) => {
            AttributeErrorAction::SessionReset(Notification::new(error_code::UPDATE_MESSAGE, 9, Vec::new()))
        }
        // A raw parse error means the attribute list itself is broken.
        E::Parse(_) => AttributeErrorAction::SessionReset(Notification::new(error_code::UPDATE_MESSAGE, 1, Vec::new())),
        // ORIGIN, AS_PATH, NEXT_HOP, MED, LOCAL_PREF, COMMUNITIES, extended
        // and large communities, ORIGINATOR_ID, CLUSTER_LIST, OTC, flag errors
        // and malformed unknown attributes: treat-as-withdraw (RFC 7606 §7,
        // §3 c).
        _ => AttributeErrorAction::TreatAsWithdraw,
    }
}

fn update_from_wire(
    update: &BgpUpdateMessage,
    ignored: &BgpParsingIgnoredErrors,
    four_octet_as: bool,
) -> DecodeOutcome {
    if ignored.path_attr_errors().is_empty() {
        if let Some(at) = update.end_of_rib() {
            let (afi, safi) = afi_safi_of(at);
            return DecodeOutcome::Message(Message::EndOfRib(afi, safi));
        }
    }

    let mut withdrawn: Vec<Prefix> = update.withdraw_routes().iter().filter_map(prefix_from_v4).collect();
    let mut announced: Vec<(Prefix, NextHop)> = Vec::new();
    let mut attributes = PathAttributes::default();
    let mut seen_origin = false;
    let mut as2_path: Option<Vec<AsPathSegment>> = None;
    let mut as4_path: Option<Vec<AsPathSegment>> = None;
    let mut classic_next_hop: Option<Ipv4Addr> = None;
    let mut mp_reach_count = 0;
    let mut mp_unreach_count = 0;

    for pa in update.path_attributes() {
        match pa.value() {
            PathAttributeValue::Origin(o) => {
                seen_origin = true;
                attributes.origin = match o {
                    NgOrigin::IGP => Origin::Igp,
                    NgOrigin::EGP => Origin::Egp,
                    NgOrigin::Incomplete => Origin::Incomplete,
                };
            }
            PathAttributeValue::AsPath(p) => as2_path = Some(segments_from_wire(p)),
            PathAttributeValue::As4Path(p) => {
                as4_path = Some(segments_from_wire(&AsPath::As4PathSegments(p.segments().to_vec().into())))
            }
            PathAttributeValue::NextHop(nh) => classic_next_hop = Some(nh.next_hop()),
            PathAttributeValue::MultiExitDiscriminator(m) => attributes.med = Some(m.metric()),
            PathAttributeValue::LocalPreference(l) => attributes.local_pref = Some(l.metric()),
            PathAttributeValue::AtomicAggregate(_) => attributes.atomic_aggregate = true,
            PathAttributeValue::Communities(c) => {
                attributes.communities = c.communities().iter().map(|c| c.value()).collect()
            }
            PathAttributeValue::Originator(o) => attributes.originator_id = Some(o.id()),
            PathAttributeValue::ClusterList(c) => {
                attributes.cluster_list = c.cluster_list().iter().map(|c| c.id()).collect()
            }
            PathAttributeValue::MpReach(reach) => {
                mp_reach_count += 1;
                match reach {
                    MpReach::Ipv4Unicast { next_hop, next_hop_local, nlri } => {
                        let nh = match next_hop {
                            IpAddr::V4(a) => NextHop::V4(*a),
                            IpAddr::V6(g) => NextHop::V6 { global: *g, link_local: *next_hop_local },
                        };
                        announced.extend(nlri.iter().filter_map(prefix_from_v4).map(|p| (p, nh)));
                    }
                    MpReach::Ipv6Unicast { next_hop_global, next_hop_local, nlri } => {
                        let nh = NextHop::V6 { global: *next_hop_global, link_local: *next_hop_local };
                        announced.extend(nlri.iter().filter_map(prefix_from_v6).map(|p| (p, nh)));
                    }
                    // Families we do not route are ignored.
                    _ => {}
                }
            }
            PathAttributeValue::MpUnreach(unreach) => {
                mp_unreach_count += 1;
                match unreach {
                    MpUnreach::Ipv4Unicast { nlri } => withdrawn.extend(nlri.iter().filter_map(prefix_from_v4)),
                    MpUnreach::Ipv6Unicast { nlri } => withdrawn.extend(nlri.iter().filter_map(prefix_from_v6)),
                    _ => {}
                }
            }
            // Non-transitive unknown optional attributes are quietly dropped
            // (RFC 4271 §9); transitive ones are kept to pass on.
            PathAttributeValue::UnknownAttribute(u) if pa.transitive() => {
                attributes.unknown.push(UnknownAttribute {
                    code: u.code(),
                    transitive: true,
                    partial: pa.partial(),
                    value: u.value().to_vec(),
                });
            }
            // Everything else (extended/large communities, aggregator, ...)
            // is not used by this agent.
            _ => {}
        }
    }

    // RFC 7606 §3 g: more than one MP_REACH or MP_UNREACH -> session reset.
    if mp_reach_count > 1 || mp_unreach_count > 1 {
        return DecodeOutcome::Notify(Notification::new(error_code::UPDATE_MESSAGE, 1, Vec::new()));
    }

    for nlri in update.nlri() {
        if let (Some(p), Some(nh)) = (prefix_from_v4(nlri), classic_next_hop) {
            announced.push((p, NextHop::V4(nh)));
        }
    }

    let withdraw_everything = |withdrawn: Vec<Prefix>, reason: String| {
        let mut all = withdrawn;
        all.extend(announced.iter().map(|(p, _)| *p));
        // Classic NLRI without NEXT_HOP were not put in `announced`.
        all.extend(update.nlri().iter().filter_map(prefix_from_v4));
        all.sort();
        all.dedup();
        DecodeOutcome::TreatAsWithdraw { withdrawn: all, reason }
    };

    let mut treat_as_withdraw_reason = None;
    for err in ignored.path_attr_errors() {
        match classify_attribute_error(err) {
            AttributeErrorAction::Discard => {}
            AttributeErrorAction::SessionReset(n) => return DecodeOutcome::Notify(n),
            AttributeErrorAction::TreatAsWithdraw => {
                treat_as_withdraw_reason.get_or_insert_with(|| err.to_string());
            }
        }
    }
    if let Some(reason) = treat_as_withdraw_reason {
        return withdraw_everything(withdrawn, reason);
    }

    let has_reachability = !announced.is_empty() || !update.nlri().is_empty();
    if has_reachability {
        // RFC 7606 §3 d: missing well-known mandatory attribute ->
        // treat-as-withdraw (NEXT_HOP only needed for classic NLRI).
        let missing = if !seen_origin {
            Some("ORIGIN")
        } else if as2_path.is_none() {
            Some("AS_PATH")
        } else if !update.nlri().is_empty() && classic_next_hop.is_none() {
            Some("NEXT_HOP")
        } else {
            None
        };
        if let Some(name) = missing {
            return withdraw_everything(withdrawn, format!("missing mandatory attribute {name}"));
        }
    }

    let as_path = as2_path.unwrap_or_default();
    attributes.as_path = match (four_octet_as, as4_path) {
        // RFC 6793 §4.1: AS4_PATH received on a 4-octet session is ignored.
        (false, Some(as4)) => merge_as4_path(as_path, as4),
        _ => as_path,
    };
    if announced.is_empty() {
        attributes = PathAttributes::default();
    }
    DecodeOutcome::Message(Message::Update(Update { withdrawn, announced, attributes }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::bgp::message::{cease_subcode, GracefulRestartFamily};

    fn p(s: &str) -> Prefix {
        s.parse().unwrap()
    }

    fn sample_open() -> Open {
        Open {
            version: 4,
            my_asn: 4_200_000_001,
            hold_time: 90,
            router_id: Ipv4Addr::new(10, 0, 0, 1),
            capabilities: vec![
                Capability::MultiProtocol(Afi::Ipv4, Safi::Unicast),
                Capability::MultiProtocol(Afi::Ipv6, Safi::Unicast),
                Capability::FourOctetAs(4_200_000_001),
                Capability::RouteRefresh,
                Capability::GracefulRestart(GracefulRestartCapability {
                    restart_state: true,
                    restart_time_secs: 120,
                    families: vec![
                        GracefulRestartFamily { afi: Afi::Ipv4, safi: Safi::Unicast, forwarding_preserved: true },
                        GracefulRestartFamily { afi: Afi::Ipv6, safi: Safi::Unicast, forwarding_preserved: false },
                    ],
                }),
            ],
        }
    }

    fn sample_attrs() -> PathAttributes {
        PathAttributes {
            origin: Origin::Incomplete,
            as_path: vec![AsPathSegment::Sequence(vec![64512, 4_200_000_001]), AsPathSegment::Set(vec![1, 2])],
            med: Some(10),
            local_pref: Some(200),
            atomic_aggregate: false,
            communities: vec![0xfde8_0001],
            originator_id: Some(Ipv4Addr::new(9, 9, 9, 9)),
            cluster_list: vec![Ipv4Addr::new(8, 8, 8, 8)],
            unknown: vec![],
        }
    }

    /// ours -> netgauze -> bytes -> netgauze -> ours, over a fresh codec pair
    /// that already exchanged 4-octet-capable OPENs.
    fn round_trip_all(msg: &Message) -> Vec<DecodeOutcome> {
        let mut tx = WireCodec::new();
        let mut rx = WireCodec::new();
        let open = Message::Open(sample_open());
        let mut buf = BytesMut::new();
        tx.encode(&open, &mut buf).unwrap();
        rx.encode(&open, &mut BytesMut::new()).unwrap();
        assert_eq!(rx.decode(&mut buf), Some(DecodeOutcome::Message(open)));
        assert!(rx.four_octet_as());

        tx.encode(msg, &mut buf).unwrap();
        let mut out = Vec::new();
        while let Some(o) = rx.decode(&mut buf) {
            out.push(o);
        }
        assert!(buf.is_empty());
        out
    }

    fn round_trip(msg: &Message) -> DecodeOutcome {
        let mut all = round_trip_all(msg);
        assert_eq!(all.len(), 1, "{all:?}");
        all.remove(0)
    }

    #[test]
    fn open_round_trip_with_four_octet_asn_and_gr() {
        let open = Message::Open(sample_open());
        assert_eq!(round_trip(&open), DecodeOutcome::Message(open.clone()));
        // The 2-octet field carries AS_TRANS.
        let wire = to_wire(&open, true).unwrap();
        let BgpMessage::Open(ng) = &wire[0] else { panic!() };
        assert_eq!(ng.my_as(), AS_TRANS);
    }

    #[test]
    fn simple_messages_round_trip() {
        for msg in [
            Message::Keepalive,
            Message::RouteRefresh(Afi::Ipv6, Safi::Unicast),
            Message::end_of_rib(Family::Ipv4Unicast),
            Message::end_of_rib(Family::Ipv6Unicast),
            Message::Notification(Notification::hold_timer_expired()),
            Message::Notification(Notification::cease(cease_subcode::ADMINISTRATIVE_SHUTDOWN)),
            Message::Notification(Notification::open_error(2, vec![0, 1])),
            // Not representable in netgauze: written and salvaged raw.
            Message::Notification(Notification::new(6, 0, vec![])),
            Message::Notification(Notification::new(6, 42, vec![1, 2, 3])),
        ] {
            assert_eq!(round_trip(&msg), DecodeOutcome::Message(msg.clone()), "{msg:?}");
        }
    }

    #[test]
    fn update_round_trip_ipv4_and_ipv6() {
        let update = Update {
            withdrawn: vec![p("10.9.0.0/24"), p("2001:db8:9::/48")],
            announced: vec![
                (p("10.1.0.0/24"), NextHop::V4(Ipv4Addr::new(192, 168, 1, 1))),
                (p("10.2.0.0/24"), NextHop::V4(Ipv4Addr::new(192, 168, 1, 1))),
                (
                    p("2001:db8:1::/64"),
                    NextHop::V6 {
                        global: "2001:db8::1".parse().unwrap(),
                        link_local: Some("fe80::1".parse().unwrap()),
                    },
                ),
            ],
            attributes: sample_attrs(),
        };
        // Withdrawals (v4, v6) and announcements (v4 group, v6 group) are
        // separate wire UPDATEs; merge them back and compare.
        let outcomes = round_trip_all(&Message::Update(update.clone()));
        let mut merged = Update::default();
        for o in outcomes {
            let DecodeOutcome::Message(Message::Update(u)) = o else { panic!("{o:?}") };
            merged.withdrawn.extend(u.withdrawn);
            if !u.announced.is_empty() {
                assert_eq!(u.attributes, update.attributes);
                merged.announced.extend(u.announced);
            }
        }
        assert_eq!(merged.withdrawn, update.withdrawn);
        assert_eq!(merged.announced, update.announced);
    }

    #[test]
    fn large_update_is_split_under_message_limit() {
        let announced: Vec<(Prefix, NextHop)> = (0..2000u32)
            .map(|i| {
                let addr = Ipv4Addr::from(0x0a00_0000 + (i << 8));
                (Prefix::new(IpAddr::V4(addr), 24).unwrap(), NextHop::V4(Ipv4Addr::new(1, 1, 1, 1)))
            })
            .collect();
        let msg =
            Message::Update(Update { withdrawn: vec![], announced: announced.clone(), attributes: sample_attrs() });
        let mut codec = WireCodec::new();
        let mut buf = BytesMut::new();
        codec.encode(&msg, &mut buf).unwrap();
        let mut rx = WireCodec::new();
        let mut total = 0;
        while buf.len() >= HEADER_LEN {
            let len = usize::from(u16::from_be_bytes([buf[16], buf[17]]));
            assert!(len <= MAX_MESSAGE_LEN);
            let Some(DecodeOutcome::Message(Message::Update(u))) = rx.decode(&mut buf) else { panic!() };
            total += u.announced.len();
        }
        assert_eq!(total, announced.len());
    }

    #[test]
    fn two_octet_session_uses_as_trans_and_as4_path() {
        let attrs = sample_attrs();
        let wire = update_to_wire(
            &Update {
                withdrawn: vec![],
                announced: vec![(p("10.0.0.0/8"), NextHop::V4(Ipv4Addr::new(1, 2, 3, 4)))],
                attributes: attrs.clone(),
            },
            false,
        )
        .unwrap();
        let has_as4 = wire[0].path_attributes().iter().any(|a| matches!(a.value(), PathAttributeValue::As4Path(_)));
        assert!(has_as4);
        // Decoding on a 2-octet session reconstructs the 4-octet path.
        let decoded = update_from_wire(&wire[0], &BgpParsingIgnoredErrors::default(), false);
        let DecodeOutcome::Message(Message::Update(u)) = decoded else { panic!("{decoded:?}") };
        assert_eq!(u.attributes.as_path, attrs.as_path);
    }

    fn frame(msg_type: u8, body: &[u8]) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_slice(&[0xff; 16]);
        b.put_u16((HEADER_LEN + body.len()) as u16);
        b.put_u8(msg_type);
        b.put_slice(body);
        b
    }

    /// UPDATE body: withdrawn len, attrs, NLRI 10.0.0.0/8.
    fn update_body(attrs: &[u8]) -> Vec<u8> {
        let mut body = vec![0, 0];
        body.extend((attrs.len() as u16).to_be_bytes());
        body.extend(attrs);
        body.extend([8, 10]);
        body
    }

    const ORIGIN_IGP: [u8; 4] = [0x40, 1, 1, 0];
    const EMPTY_AS_PATH: [u8; 3] = [0x40, 2, 0];
    const NEXT_HOP: [u8; 7] = [0x40, 3, 4, 1, 2, 3, 4];

    #[test]
    fn valid_raw_update_decodes() {
        let attrs = [&ORIGIN_IGP[..], &EMPTY_AS_PATH, &NEXT_HOP].concat();
        let mut buf = frame(2, &update_body(&attrs));
        let out = WireCodec::new().decode(&mut buf);
        let Some(DecodeOutcome::Message(Message::Update(u))) = out else { panic!("{out:?}") };
        assert_eq!(u.announced, vec![(p("10.0.0.0/8"), NextHop::V4(Ipv4Addr::new(1, 2, 3, 4)))]);
    }

    #[test]
    fn malformed_origin_is_treat_as_withdraw() {
        // ORIGIN value 7 is undefined.
        let attrs = [&[0x40, 1, 1, 7][..], &EMPTY_AS_PATH, &NEXT_HOP].concat();
        let mut buf = frame(2, &update_body(&attrs));
        let out = WireCodec::new().decode(&mut buf);
        match out {
            Some(DecodeOutcome::TreatAsWithdraw { withdrawn, .. }) => {
                assert_eq!(withdrawn, vec![p("10.0.0.0/8")])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_next_hop_is_treat_as_withdraw() {
        let attrs = [&ORIGIN_IGP[..], &EMPTY_AS_PATH].concat();
        let mut buf = frame(2, &update_body(&attrs));
        let out = WireCodec::new().decode(&mut buf);
        assert!(
            matches!(out, Some(DecodeOutcome::TreatAsWithdraw { ref withdrawn, .. }) if withdrawn == &vec![p("10.0.0.0/8")]),
            "{out:?}"
        );
    }

    #[test]
    fn what_we_cannot_represent_is_ignored_or_withdrawn_never_a_notification() {
        // ORIGIN, AS_PATH, NEXT_HOP, an IPv6 multicast MP_REACH (2001:db8::/32), NLRI
        // 10.0.0.0/8 and 224.0.0.0/4.
        let mut v6_multicast = vec![0, 2, 2, 16];
        v6_multicast.extend_from_slice(&"2001:db8::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v6_multicast.extend_from_slice(&[0, 32, 0x20, 0x01, 0x0d, 0xb8]);
        let mut attrs = [&ORIGIN_IGP[..], &EMPTY_AS_PATH, &NEXT_HOP].concat();
        attrs.extend_from_slice(&[0x90, 14]);
        attrs.extend_from_slice(&(v6_multicast.len() as u16).to_be_bytes());
        attrs.extend_from_slice(&v6_multicast);
        let mut body = update_body(&attrs);
        body.extend_from_slice(&[4, 0xe0]);
        let mut buf = frame(2, &body);
        match WireCodec::new().decode(&mut buf) {
            Some(DecodeOutcome::PartlyIgnored { update, ignored }) => {
                assert_eq!(update.announced, vec![(p("10.0.0.0/8"), NextHop::V4(Ipv4Addr::new(1, 2, 3, 4)))]);
                assert_eq!(update.withdrawn, vec![p("224.0.0.0/4")]);
                assert_eq!(ignored.len(), 2, "{ignored:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(buf.is_empty());
        // An End-of-RIB of IPv6 multicast: ignored, not an IPv4 End-of-RIB.
        let mut buf = frame(2, &[0, 0, 0, 6, 0x80, 15, 3, 0, 2, 2]);
        let out = WireCodec::new().decode(&mut buf);
        assert!(matches!(&out, Some(DecodeOutcome::PartlyIgnored { update, .. }) if update.is_empty()), "{out:?}");
    }

    #[test]
    fn header_errors_map_to_message_header_notifications() {
        // Bad marker -> 1/1.
        let mut buf = frame(4, &[]);
        buf[0] = 0;
        let out = WireCodec::new().decode(&mut buf);
        assert!(matches!(out, Some(DecodeOutcome::Notify(ref n)) if (n.code, n.subcode) == (1, 1)), "{out:?}");
        // Unknown type -> 1/3.
        let mut buf = frame(99, &[]);
        let out = WireCodec::new().decode(&mut buf);
        assert!(matches!(out, Some(DecodeOutcome::Notify(ref n)) if (n.code, n.subcode) == (1, 3)), "{out:?}");
        // Length below 19 -> 1/2.
        let mut buf = frame(4, &[]);
        buf[17] = 5;
        let out = WireCodec::new().decode(&mut buf);
        assert!(matches!(out, Some(DecodeOutcome::Notify(ref n)) if (n.code, n.subcode) == (1, 2)), "{out:?}");
        // Partial frame -> need more data.
        let mut buf = frame(4, &[]);
        buf.truncate(10);
        assert_eq!(WireCodec::new().decode(&mut buf), None);
    }

    #[test]
    fn open_errors_from_parser_map_to_open_notifications() {
        // version 3
        let body = [3, 0xfd, 0xe8, 0, 90, 10, 0, 0, 1, 0];
        let out = WireCodec::new().decode(&mut frame(1, &body));
        assert!(matches!(out, Some(DecodeOutcome::Notify(ref n)) if (n.code, n.subcode) == (2, 1)), "{out:?}");
        // hold time 2
        let body = [4, 0xfd, 0xe8, 0, 2, 10, 0, 0, 1, 0];
        let out = WireCodec::new().decode(&mut frame(1, &body));
        assert!(matches!(out, Some(DecodeOutcome::Notify(ref n)) if (n.code, n.subcode) == (2, 6)), "{out:?}");
    }

    #[test]
    fn garbage_never_panics() {
        // Deterministic pseudo-random fuzz over frame contents.
        let mut seed: u32 = 0x1234_5678;
        for _ in 0..2000 {
            let mut next = || {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                seed
            };
            let len = (next() % 60) as usize;
            let body: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let msg_type = (next() % 6) as u8;
            let mut buf = frame(msg_type, &body);
            let _ = WireCodec::new().decode(&mut buf);
        }
    }

    #[test]
    fn mutated_updates_always_decode_to_a_defined_outcome() {
        // Start from real UPDATEs (IPv4 NLRI and MP_REACH IPv6) and corrupt them the ways a
        // broken peer would: flipped bytes, wrong inner lengths, truncated attributes. Every
        // complete frame must yield an outcome (message, treat-as-withdraw or NOTIFICATION),
        // never a panic and never a silent stall.
        let v4 = Message::Update(Update {
            withdrawn: vec!["10.9.0.0/16".parse().unwrap()],
            announced: vec![("10.1.0.0/24".parse().unwrap(), NextHop::V4(Ipv4Addr::new(192, 0, 2, 1)))],
            attributes: sample_attrs(),
        });
        let v6 = Message::Update(Update {
            withdrawn: vec![],
            announced: vec![(
                "2001:db8:1::/48".parse().unwrap(),
                NextHop::V6 { global: "2001:db8::1".parse().unwrap(), link_local: None },
            )],
            attributes: sample_attrs(),
        });
        let mut seed: u32 = 0x9e37_79b9;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        let mut outcomes = [0usize; 3];
        for original in [v4, v6] {
            let mut wire = BytesMut::new();
            WireCodec::new().encode(&original, &mut wire).unwrap();
            for _ in 0..3000 {
                let mut frame = wire.clone();
                for _ in 0..=(next() % 3) {
                    // Only the body: a broken marker or length is covered elsewhere.
                    let at = HEADER_LEN + (next() as usize % (frame.len() - HEADER_LEN));
                    frame[at] = next() as u8;
                }
                match WireCodec::new().decode(&mut frame) {
                    Some(DecodeOutcome::Message(_) | DecodeOutcome::PartlyIgnored { .. }) => outcomes[0] += 1,
                    Some(DecodeOutcome::TreatAsWithdraw { .. }) => outcomes[1] += 1,
                    Some(DecodeOutcome::Notify(n)) => {
                        assert!((1..=6).contains(&n.code), "{n:?}");
                        outcomes[2] += 1
                    }
                    other => panic!("a complete frame must decode to an outcome, got {other:?}"),
                }
            }
        }
        // The corruption really exercised the error paths.
        assert!(outcomes.iter().all(|n| *n > 0), "{outcomes:?}");
    }
}
