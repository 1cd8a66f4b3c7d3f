//! Errors: per-policy validation failures.

/// A NetworkPolicy that could not be compiled. The policy is skipped as a
/// whole (as if absent); every other policy still compiles.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
#[error("NetworkPolicy {namespace}/{name}: {kind}")]
pub struct PolicyError {
    pub namespace: String,
    pub name: String,
    pub kind: PolicyErrorKind,
}

/// What was wrong; `field` is a JSON-path-like location such as
/// `spec.ingress[0].from[1].ipBlock.except[0]`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
pub enum PolicyErrorKind {
    #[error("metadata.{field} is missing")]
    MissingMetadata { field: &'static str },
    #[error("{field}: invalid CIDR {value:?}")]
    InvalidCidr { field: String, value: String },
    #[error("{field}: except {except} is not strictly inside cidr {cidr}")]
    ExceptOutsideCidr { field: String, cidr: String, except: String },
    #[error("{field}: port {value} is out of range 1-65535")]
    PortOutOfRange { field: String, value: i64 },
    #[error("{field}: endPort {end_port} is smaller than port {port}")]
    EndPortBeforePort { field: String, port: u16, end_port: u16 },
    #[error("{field}: endPort cannot be combined with named port {name:?}")]
    EndPortWithNamedPort { field: String, name: String },
    #[error("{field}: endPort requires a numeric port")]
    EndPortWithoutPort { field: String },
    #[error("{field}: invalid port name {name:?} (IANA service name: 1-15 lowercase letters, digits or single inner hyphens, at least one letter)")]
    InvalidPortName { field: String, name: String },
    #[error("{field}: unknown protocol {value:?} (expected TCP, UDP or SCTP)")]
    UnknownProtocol { field: String, value: String },
    #[error("{field}: unknown policyType {value:?} (expected Ingress or Egress)")]
    UnknownPolicyType { field: String, value: String },
    #[error("{field}: invalid label selector: {reason}")]
    InvalidSelector { field: String, reason: String },
    #[error("{field}: invalid peer: {reason}")]
    InvalidPeer { field: String, reason: String },
}
