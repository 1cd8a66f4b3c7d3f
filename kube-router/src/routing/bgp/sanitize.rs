//! RFC 7606 per-prefix handling for what our wire codec cannot represent, done on the raw
//! UPDATE before it is decoded. A syntactically valid UPDATE must never reset a session just
//! because it carries something we do not route:
//!
//! * `MP_REACH_NLRI` / `MP_UNREACH_NLRI` of an address family other than IPv4/IPv6 unicast
//!   (IPv6 multicast, VPN, flowspec, ...) is removed and reported as ignored: we never
//!   negotiated those families, and their prefixes are nothing we would install (RFC 4760 §7,
//!   RFC 7606 §5.3 allow ignoring them).
//! * A unicast prefix the codec refuses to represent (a multicast or broadcast range in IPv4
//!   or IPv6 unicast NLRI: always a martian to us) is removed from the message and treated as
//!   withdrawn (RFC 7606 §5.3's treat-as-withdraw, per prefix instead of per UPDATE).
//!
//! Anything that does not parse here (inconsistent lengths, a prefix longer than its family)
//! is left untouched for the decoder, which answers with the NOTIFICATION RFC 7606 demands.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::message::Prefix;

const HEADER_LEN: usize = 19;
const MP_REACH: u8 = 14;
const MP_UNREACH: u8 = 15;
const EXTENDED_LENGTH: u8 = 0x10;

/// What [`sanitize_update`] changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sanitized {
    /// The rewritten message (header included), or None if nothing at all is left of it (an
    /// End-of-RIB or withdrawal of a family we do not route: it must not be mistaken for the
    /// IPv4 End-of-RIB an empty UPDATE is).
    pub frame: Option<Vec<u8>>,
    /// Unrepresentable prefixes, to be treated as withdrawn.
    pub withdrawn: Vec<Prefix>,
    /// What was ignored, for a log line (one entry per kind).
    pub ignored: Vec<String>,
}

/// One prefix in NLRI encoding (length in bits, then the significant octets).
struct RawPrefix<'a> {
    bits: u8,
    octets: &'a [u8],
    encoded: &'a [u8],
}

fn prefixes(mut data: &[u8], max_bits: u8) -> Option<Vec<RawPrefix<'_>>> {
    let mut out = Vec::new();
    while let Some((&bits, rest)) = data.split_first() {
        if bits > max_bits {
            return None;
        }
        let n = usize::from(bits).div_ceil(8);
        if rest.len() < n {
            return None;
        }
        out.push(RawPrefix { bits, octets: &rest[..n], encoded: &data[..n + 1] });
        data = &rest[n..];
    }
    Some(out)
}

fn v4(p: &RawPrefix<'_>) -> Ipv4Addr {
    let mut octets = [0u8; 4];
    octets[..p.octets.len()].copy_from_slice(p.octets);
    Ipv4Addr::from(octets)
}

fn v6(p: &RawPrefix<'_>) -> Ipv6Addr {
    let mut octets = [0u8; 16];
    octets[..p.octets.len()].copy_from_slice(p.octets);
    Ipv6Addr::from(octets)
}

/// What the codec (netgauze) accepts as an IPv4 unicast network: neither the address nor the
/// last host of the range multicast or broadcast.
fn v4_representable(addr: Ipv4Addr, bits: u8) -> bool {
    let bad = |a: Ipv4Addr| a.is_multicast() || a.is_broadcast();
    let host_mask = u32::MAX.checked_shr(u32::from(bits)).unwrap_or(0);
    let broadcast = u32::from(addr) | host_mask;
    let last_host = if bits >= 31 { broadcast } else { broadcast - 1 };
    !bad(addr) && !bad(Ipv4Addr::from(last_host))
}

fn v6_representable(addr: Ipv6Addr) -> bool {
    !addr.is_multicast()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// Keeps the representable prefixes of `data`; the others go to `withdrawn`.
fn filter(data: &[u8], family: Family, withdrawn: &mut Vec<Prefix>) -> Option<(Vec<u8>, usize)> {
    let max = if family == Family::V4 { 32 } else { 128 };
    let mut kept = Vec::with_capacity(data.len());
    let mut dropped = 0;
    for p in prefixes(data, max)? {
        let (ok, addr) = match family {
            Family::V4 => (v4_representable(v4(&p), p.bits), IpAddr::V4(v4(&p))),
            Family::V6 => (v6_representable(v6(&p)), IpAddr::V6(v6(&p))),
        };
        if ok {
            kept.extend_from_slice(p.encoded);
        } else {
            dropped += 1;
            withdrawn.extend(Prefix::new(addr, p.bits).ok());
        }
    }
    Some((kept, dropped))
}

fn family_of(afi: u16, safi: u8) -> Option<Family> {
    match (afi, safi) {
        (1, 1) => Some(Family::V4),
        (2, 1) => Some(Family::V6),
        _ => None,
    }
}

fn family_name(afi: u16, safi: u8) -> String {
    let afi = match afi {
        1 => "IPv4".to_string(),
        2 => "IPv6".to_string(),
        n => format!("AFI {n}"),
    };
    let safi = match safi {
        1 => "unicast".to_string(),
        2 => "multicast".to_string(),
        4 => "labeled unicast".to_string(),
        128 => "VPN".to_string(),
        133 => "flowspec".to_string(),
        n => format!("SAFI {n}"),
    };
    format!("{afi} {safi}")
}

fn push_attribute(out: &mut Vec<u8>, flags: u8, code: u8, value: &[u8]) {
    if flags & EXTENDED_LENGTH != 0 || value.len() > 255 {
        out.extend_from_slice(&[flags | EXTENDED_LENGTH, code]);
        out.extend_from_slice(&(value.len() as u16).to_be_bytes());
    } else {
        out.extend_from_slice(&[flags, code, value.len() as u8]);
    }
    out.extend_from_slice(value);
}

/// Rewrites a complete UPDATE message (`frame`, header included) if it carries something we
/// cannot represent. None: nothing to change, or not parseable here (the decoder decides).
pub fn sanitize_update(frame: &[u8]) -> Option<Sanitized> {
    let body = frame.get(HEADER_LEN..)?;
    let withdrawn_len = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let withdrawn_raw = body.get(2..2 + withdrawn_len)?;
    let rest = &body[2 + withdrawn_len..];
    let attrs_len = usize::from(u16::from_be_bytes([*rest.first()?, *rest.get(1)?]));
    let mut attrs = rest.get(2..2 + attrs_len)?;
    let nlri_raw = &rest[2 + attrs_len..];

    let mut withdrawn = Vec::new();
    let mut ignored = Vec::new();
    let mut changed = false;

    let (withdrawn_kept, dropped) = filter(withdrawn_raw, Family::V4, &mut withdrawn)?;
    changed |= dropped > 0;
    let (nlri_kept, dropped_nlri) = filter(nlri_raw, Family::V4, &mut withdrawn)?;
    changed |= dropped_nlri > 0;
    let mut unrepresentable = dropped + dropped_nlri;

    let mut attrs_out = Vec::with_capacity(attrs.len());
    while !attrs.is_empty() {
        let flags = attrs[0];
        let code = *attrs.get(1)?;
        let (len, header) = if flags & EXTENDED_LENGTH != 0 {
            (usize::from(u16::from_be_bytes([*attrs.get(2)?, *attrs.get(3)?])), 4)
        } else {
            (usize::from(*attrs.get(2)?), 3)
        };
        let value = attrs.get(header..header + len)?;
        let whole = &attrs[..header + len];
        attrs = &attrs[header + len..];
        if code != MP_REACH && code != MP_UNREACH {
            attrs_out.extend_from_slice(whole);
            continue;
        }
        let afi = u16::from_be_bytes([*value.first()?, *value.get(1)?]);
        let safi = *value.get(2)?;
        let Some(family) = family_of(afi, safi) else {
            changed = true;
            let what = if code == MP_REACH { "MP_REACH_NLRI" } else { "MP_UNREACH_NLRI" };
            ignored.push(format!("{what} of {} (a family we do not route)", family_name(afi, safi)));
            continue;
        };
        // Where the NLRI starts: after AFI/SAFI, and for MP_REACH the next hop and a reserved octet.
        let nlri_at = if code == MP_REACH {
            let nh_len = usize::from(*value.get(3)?);
            4 + nh_len + 1
        } else {
            3
        };
        let (kept, dropped) = filter(value.get(nlri_at..)?, family, &mut withdrawn)?;
        if dropped == 0 {
            attrs_out.extend_from_slice(whole);
            continue;
        }
        changed = true;
        unrepresentable += dropped;
        let mut new_value = value[..nlri_at].to_vec();
        new_value.extend_from_slice(&kept);
        push_attribute(&mut attrs_out, flags, code, &new_value);
    }
    if !changed {
        return None;
    }
    if unrepresentable > 0 {
        ignored.push(format!("{unrepresentable} multicast/broadcast prefix(es) in unicast NLRI, treated as withdrawn"));
    }
    if withdrawn_kept.is_empty() && attrs_out.is_empty() && nlri_kept.is_empty() {
        return Some(Sanitized { frame: None, withdrawn, ignored });
    }
    let mut out = Vec::with_capacity(frame.len());
    out.extend_from_slice(&frame[..16]);
    out.extend_from_slice(&[0, 0, frame[18]]);
    out.extend_from_slice(&(withdrawn_kept.len() as u16).to_be_bytes());
    out.extend_from_slice(&withdrawn_kept);
    out.extend_from_slice(&(attrs_out.len() as u16).to_be_bytes());
    out.extend_from_slice(&attrs_out);
    out.extend_from_slice(&nlri_kept);
    let len = (out.len() as u16).to_be_bytes();
    out[16..18].copy_from_slice(&len);
    Some(Sanitized { frame: Some(out), withdrawn, ignored })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(body: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 16];
        f.extend_from_slice(&((HEADER_LEN + body.len()) as u16).to_be_bytes());
        f.push(2);
        f.extend_from_slice(body);
        f
    }

    fn update(withdrawn: &[u8], attrs: &[u8], nlri: &[u8]) -> Vec<u8> {
        let mut body = (withdrawn.len() as u16).to_be_bytes().to_vec();
        body.extend_from_slice(withdrawn);
        body.extend_from_slice(&(attrs.len() as u16).to_be_bytes());
        body.extend_from_slice(attrs);
        body.extend_from_slice(nlri);
        frame(&body)
    }

    const ORIGIN: [u8; 4] = [0x40, 1, 1, 0];
    const AS_PATH: [u8; 3] = [0x40, 2, 0];
    const NEXT_HOP: [u8; 7] = [0x40, 3, 4, 10, 0, 0, 2];

    /// MP_REACH of IPv6 multicast (AFI 2, SAFI 2) for 2001:db8::/32.
    fn v6_multicast_reach() -> Vec<u8> {
        let mut value = vec![0, 2, 2, 16];
        value.extend_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        value.push(0);
        value.extend_from_slice(&[32, 0x20, 0x01, 0x0d, 0xb8]);
        let mut attr = vec![0x90, MP_REACH];
        attr.extend_from_slice(&(value.len() as u16).to_be_bytes());
        attr.extend_from_slice(&value);
        attr
    }

    #[test]
    fn a_plain_update_is_left_alone() {
        let attrs = [&ORIGIN[..], &AS_PATH, &NEXT_HOP].concat();
        assert_eq!(sanitize_update(&update(&[], &attrs, &[24, 10, 1, 0])), None);
    }

    #[test]
    fn an_unsupported_family_is_stripped_and_the_rest_kept() {
        let attrs = [&ORIGIN[..], &AS_PATH, &NEXT_HOP, &v6_multicast_reach()].concat();
        let out = sanitize_update(&update(&[], &attrs, &[24, 10, 1, 0])).unwrap();
        let expected = update(&[], &[&ORIGIN[..], &AS_PATH, &NEXT_HOP].concat(), &[24, 10, 1, 0]);
        assert_eq!(out.frame, Some(expected));
        assert!(out.withdrawn.is_empty());
        assert_eq!(out.ignored, vec!["MP_REACH_NLRI of IPv6 multicast (a family we do not route)".to_string()]);
    }

    #[test]
    fn an_end_of_rib_of_an_unsupported_family_leaves_nothing() {
        let eor = [0x80, MP_UNREACH, 3, 0, 2, 2];
        let out = sanitize_update(&update(&[], &eor, &[])).unwrap();
        assert_eq!(out.frame, None, "must not become an (IPv4) End-of-RIB");
    }

    #[test]
    fn multicast_prefixes_in_unicast_nlri_are_withdrawn_one_by_one() {
        let attrs = [&ORIGIN[..], &AS_PATH, &NEXT_HOP].concat();
        // 224.0.0.0/4, 10.1.0.0/24, 255.255.255.255/32
        let nlri = [4, 0xe0, 24, 10, 1, 0, 32, 255, 255, 255, 255];
        let out = sanitize_update(&update(&[], &attrs, &nlri)).unwrap();
        assert_eq!(out.frame, Some(update(&[], &attrs, &[24, 10, 1, 0])));
        let text: Vec<String> = out.withdrawn.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["224.0.0.0/4", "255.255.255.255/32"]);
        // IPv6 unicast MP_REACH with ff00::/8.
        let mut value = vec![0, 2, 1, 16];
        value.extend_from_slice(&"fd77::2".parse::<Ipv6Addr>().unwrap().octets());
        value.extend_from_slice(&[0, 8, 0xff, 64, 0xfd, 0, 0, 0x44, 0, 0, 0, 0]);
        let mut reach = vec![0x90, MP_REACH];
        reach.extend_from_slice(&(value.len() as u16).to_be_bytes());
        reach.extend_from_slice(&value);
        let out = sanitize_update(&update(&[], &[&ORIGIN[..], &AS_PATH, &reach].concat(), &[])).unwrap();
        assert_eq!(out.withdrawn, vec!["ff00::/8".parse().unwrap()]);
        let kept = out.frame.unwrap();
        assert_eq!(&kept[kept.len() - 9..], &[64, 0xfd, 0, 0, 0x44, 0, 0, 0, 0]);
    }

    #[test]
    fn what_does_not_parse_is_left_to_the_decoder() {
        assert_eq!(sanitize_update(&update(&[], &[], &[33, 10, 1, 0, 0, 0])), None, "prefix longer than 32");
        let mut truncated = update(&[], &v6_multicast_reach(), &[]);
        truncated.truncate(truncated.len() - 2);
        assert_eq!(sanitize_update(&truncated), None);
    }

    #[test]
    fn representability_matches_the_codec() {
        use netgauze_bgp_pkt::nlri::{Ipv4Unicast, Ipv6Unicast};
        let mut seed: u32 = 0x2545_f491;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let bits = (seed % 33) as u8;
            let addr = Prefix::new(IpAddr::V4(Ipv4Addr::from(seed.rotate_left(7))), bits).unwrap();
            let IpAddr::V4(a) = addr.addr() else { unreachable!() };
            let codec = Ipv4Unicast::from_net(ipnet::Ipv4Net::new(a, bits).unwrap()).is_ok();
            assert_eq!(v4_representable(a, bits), codec, "{a}/{bits}");
        }
        for text in ["ff02::/16", "fd00::/8", "::/0", "ff00::/8"] {
            let net: ipnet::Ipv6Net = text.parse().unwrap();
            assert_eq!(v6_representable(net.addr()), Ipv6Unicast::from_net(net).is_ok(), "{text}");
        }
    }
}
