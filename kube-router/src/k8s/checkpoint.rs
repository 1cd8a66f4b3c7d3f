//! The last successfully synced desired state, on local disk, so a restarted agent can program
//! the node while the API server is unreachable.
//!
//! Written atomically (temp file, fsync, rename, fsync of the directory) and self-checking: a
//! truncated, edited or foreign file is rejected with a clear error, never half-applied.
use std::{
    fs::{self, File},
    io::Write,
    path::{Path, PathBuf},
};

use k8s_openapi::api::core::v1::Node;
use serde::{Deserialize, Serialize};

use super::{kinds::Watched, watch::Kind};

pub const CHECKPOINT_VERSION: u32 = 1;
pub const FILE_NAME: &str = "checkpoint.json";

/// Generates the checkpoint's contents from [`watched_kinds!`](crate::watched_kinds): one list
/// per kind, in the kind's checkpoint form ([`Watched::Saved`]).
macro_rules! checkpoint_contents {
    ($($variant:ident, $field:ident, $ty:ty;)*) => {
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
        pub struct Checkpoint {
            /// Unix time of the sync it records.
            pub written_unix: f64,
            $(pub $field: Vec<<$ty as Watched>::Saved>,)*
        }

        impl Checkpoint {
            /// How many objects of each kind it holds.
            pub fn count(&self, kind: Kind) -> usize {
                match kind {
                    $(Kind::$variant => self.$field.len(),)*
                }
            }
        }
    };
}

crate::watched_kinds!(checkpoint_contents);

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("no checkpoint at {0}")]
    Missing(PathBuf),
    #[error("cannot read checkpoint {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("checkpoint {path} has version {found}, this agent reads version {CHECKPOINT_VERSION}")]
    VersionMismatch { path: PathBuf, found: u32 },
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

fn fnv1a_from(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Per-node external peer passwords (base64): kept from the checkpoint.
pub const PEER_PASSWORDS_ANNOTATION: &str = "kube-router.io/peer.passwords";
/// The consolidated per-node peer annotation (YAML); its entries' `password`s are kept from the
/// checkpoint.
pub const PEERS_ANNOTATION: &str = "kube-router.io/peers";

/// The Node as the checkpoint keeps it: without its TCP-MD5 peer passwords (the
/// `kube-router.io/peer.passwords` annotation, `password` in `kube-router.io/peers`). After a
/// cold start from the checkpoint with the API down, annotation peers run without their key
/// (their sessions cannot come up) until the live Node is read; passwords given by
/// `--peer-router-passwords-file` are unaffected.
pub fn node_for_checkpoint(node: &Node) -> Node {
    let mut node = node.clone();
    if let Some(annotations) = node.metadata.annotations.as_mut() {
        annotations.remove(PEER_PASSWORDS_ANNOTATION);
        if let Some(peers) = annotations.get_mut(PEERS_ANNOTATION) {
            match serde_norway::from_str::<serde_norway::Value>(peers) {
                Ok(mut value) => {
                    if let Some(list) = value.as_sequence_mut() {
                        for peer in list.iter_mut().filter_map(|p| p.as_mapping_mut()) {
                            peer.remove("password");
                        }
                    }
                    *peers = serde_norway::to_string(&value).unwrap_or_default();
                }
                // Not YAML: useless to the agent, and it may hold a password.
                Err(_) => peers.clear(),
            }
        }
    }
    node.metadata.managed_fields = None;
    node
}

/// The state directory 0700 and the checkpoint 0600, also when an older agent left them
/// 0755 / 0644: the file holds the cluster's objects.
pub fn restrict_permissions(state_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::create_dir_all(state_dir)?;
    fs::set_permissions(state_dir, fs::Permissions::from_mode(0o700))?;
    match fs::set_permissions(path_in(state_dir), fs::Permissions::from_mode(0o600)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub fn path_in(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

pub fn write(state_dir: &Path, checkpoint: &Checkpoint) -> std::io::Result<()> {
    write_payload(state_dir, checkpoint)
}

/// Writes anything that serialises as a [`Checkpoint`] (the agent's snapshot of shared
/// objects). The payload is streamed into the file, escaped as the envelope's JSON string and
/// hashed on the way: no copy of the objects, of their JSON or of the envelope is held (at
/// 20,000 objects those copies were ~100 MiB of peak memory). The envelope's fields come in
/// another order than a whole-envelope serialisation gives; JSON readers do not care.
pub fn write_payload(state_dir: &Path, payload: &impl Serialize) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    restrict_permissions(state_dir)?;
    let final_path = path_in(state_dir);
    let temp_path = state_dir.join(format!(".{FILE_NAME}.tmp"));
    // A temp file an earlier write left keeps its mode through truncation: removed first.
    let _ = fs::remove_file(&temp_path);
    let file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp_path)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, file);
    write!(out, "{{\"version\":{CHECKPOINT_VERSION},\"payload\":\"")?;
    let mut escaped = EscapedHashed { out: &mut out, hash: FNV_OFFSET };
    serde_json::to_writer(&mut escaped, payload)?;
    let checksum = escaped.hash;
    write!(out, "\",\"checksum\":\"{checksum:016x}\"}}")?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    fs::rename(&temp_path, &final_path)?;
    // The rename itself must reach the disk before we call the checkpoint written.
    File::open(state_dir)?.sync_all()
}

/// Passes JSON text on as the contents of a JSON string, and hashes the text (unescaped) with
/// [`fnv1a`].
struct EscapedHashed<W> {
    out: W,
    hash: u64,
}

impl<W: Write> Write for EscapedHashed<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.hash = fnv1a_from(self.hash, bytes);
        let mut plain = 0;
        for (i, &b) in bytes.iter().enumerate() {
            let escape: Option<&[u8]> = match b {
                b'"' => Some(b"\\\""),
                b'\\' => Some(b"\\\\"),
                _ => None,
            };
            if let Some(escape) = escape {
                self.out.write_all(&bytes[plain..i])?;
                self.out.write_all(escape)?;
                plain = i + 1;
            } else if b < 0x20 {
                // serde_json never emits raw control characters; escaped all the same.
                self.out.write_all(&bytes[plain..i])?;
                write!(self.out, "\\u{b:04x}")?;
                plain = i + 1;
            }
        }
        self.out.write_all(&bytes[plain..])?;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Reads and checks the checkpoint. The file is read once into memory and the payload (a JSON
/// string in the envelope) unescaped where it lies, then decoded from there: at 150,000 Pods
/// the file is some 100 MiB, and a second copy of it as the payload's `String` was as much again
/// at the start's peak.
pub fn read(state_dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let path = path_in(state_dir);
    let mut bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(CheckpointError::Missing(path)),
        Err(source) => return Err(CheckpointError::Io { path, source }),
    };
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.clone(), reason };
    let (version, checksum, literal) = {
        let envelope: BorrowedEnvelope =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("not a checkpoint envelope: {e}")))?;
        let literal = envelope.payload.get();
        let start = literal.as_ptr() as usize - bytes.as_ptr() as usize;
        (envelope.version, envelope.checksum, start..start + literal.len())
    };
    if version != CHECKPOINT_VERSION {
        return Err(CheckpointError::VersionMismatch { path, found: version });
    }
    let payload =
        unescape_in_place(&mut bytes[literal]).ok_or_else(|| corrupt("the payload is not a JSON string".into()))?;
    let actual = format!("{:016x}", fnv1a(payload));
    if actual != checksum {
        return Err(corrupt(format!("checksum {actual} does not match recorded {checksum}")));
    }
    serde_json::from_slice(payload).map_err(|e| corrupt(format!("payload does not decode: {e}")))
}

/// The envelope, with its payload (the [`Checkpoint`]'s JSON text, as a JSON string) left where
/// it is in the file's text.
#[derive(Deserialize)]
struct BorrowedEnvelope<'a> {
    version: u32,
    /// FNV-1a 64 of the payload's JSON text, hex.
    checksum: String,
    #[serde(borrow)]
    payload: &'a serde_json::value::RawValue,
}

/// The contents of the JSON string literal `literal` (quotes included), unescaped into its own
/// first bytes (an escape is never shorter than what it stands for); `None` when it is not a
/// string literal or holds a malformed escape.
fn unescape_in_place(literal: &mut [u8]) -> Option<&[u8]> {
    let end = literal.len().checked_sub(1)?;
    if end == 0 || literal[0] != b'"' || literal[end] != b'"' {
        return None;
    }
    let (mut read, mut written) = (1, 0);
    while read < end {
        let byte = literal[read];
        if byte != b'\\' {
            literal[written] = byte;
            (read, written) = (read + 1, written + 1);
            continue;
        }
        let escaped = match *literal[..end].get(read + 1)? {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0c,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            b'u' => {
                let (character, length) = unicode_escape(&literal[read..end])?;
                let mut utf8 = [0u8; 4];
                let encoded = character.encode_utf8(&mut utf8).as_bytes();
                literal[written..written + encoded.len()].copy_from_slice(encoded);
                (read, written) = (read + length, written + encoded.len());
                continue;
            }
            _ => return None,
        };
        literal[written] = escaped;
        (read, written) = (read + 2, written + 1);
    }
    Some(&literal[..written])
}

/// The character of the `\uXXXX` escape (or surrogate pair of two) at the start of `text`, and
/// how many bytes it took.
fn unicode_escape(text: &[u8]) -> Option<(char, usize)> {
    let unit = |at: usize| -> Option<u16> {
        let digits = text.get(at..at + 6)?;
        if &digits[..2] != b"\\u" {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&digits[2..]).ok()?, 16).ok()
    };
    let first = unit(0)?;
    if !(0xd800..0xdc00).contains(&first) {
        return Some((char::from_u32(u32::from(first))?, 6));
    }
    let second = unit(6)?;
    let character = char::decode_utf16([first, second]).next()?.ok()?;
    Some((character, 12))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;

    use super::*;
    use crate::k8s::pod::SlimPod;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("krt-checkpoint-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn sample() -> Checkpoint {
        let service: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": "web"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}
        }))
        .unwrap();
        Checkpoint { written_unix: 1.5, services: vec![service], ..Default::default() }
    }

    #[test]
    fn the_checkpoint_is_private_and_holds_no_peer_password_nor_pod_secrets() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("private");
        // As an older agent left it: world-readable.
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        fs::write(path_in(&dir), "old").unwrap();
        fs::set_permissions(path_in(&dir), fs::Permissions::from_mode(0o644)).unwrap();
        restrict_permissions(&dir).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&dir), mode(&path_in(&dir))), (0o700, 0o600), "fixed on start");

        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-1", "annotations": {
                "kube-router.io/peer.ips": "192.0.2.1", "kube-router.io/peer.asns": "65000",
                "kube-router.io/peer.passwords": "czNjcmV0LWtleQ==",
                "kube-router.io/peers": "- {remoteip: 192.0.2.2, remoteasn: 65001, password: czNjcmV0LXlhbWw=}\n"}},
        }))
        .unwrap();
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "shop", "name": "web-1", "labels": {"app": "web"},
                         "annotations": {"note": "s3cret-annotation"}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "web", "image": "web:1",
                "env": [{"name": "TOKEN", "value": "s3cret-env"}],
                "ports": [{"name": "http", "containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": "10.244.1.5", "podIPs": [{"ip": "10.244.1.5"}]}
        }))
        .unwrap();
        let checkpoint = Checkpoint {
            nodes: vec![node_for_checkpoint(&node)],
            // As the agent writes its pods.
            pods: vec![SlimPod::from(&pod)],
            ..Default::default()
        };
        write(&dir, &checkpoint).unwrap();
        assert_eq!(mode(&path_in(&dir)), 0o600);
        let text = fs::read_to_string(path_in(&dir)).unwrap();
        for secret in ["czNjcmV0", "peer.passwords", "s3cret", "TOKEN", "image"] {
            assert!(!text.contains(secret), "{secret} in the checkpoint");
        }
        // What the agent reads survives: the peers, the pod's policy inputs.
        let restored = read(&dir).unwrap();
        let annotations = restored.nodes[0].metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations["kube-router.io/peer.ips"], "192.0.2.1");
        assert!(annotations["kube-router.io/peers"].contains("192.0.2.2"));
        let info = crate::policy::parse::PodInfo::from_pod(&restored.pods[0]).unwrap();
        assert_eq!(info, crate::policy::parse::PodInfo::from_pod(&pod).unwrap());
    }

    /// What `read` unescapes in place is what a JSON reader makes of the string: every escape
    /// serde_json writes, any other JSON allows (`\/`, surrogate pairs), and nothing malformed.
    #[test]
    fn the_payload_is_unescaped_in_place_as_json_reads_it() {
        for text in ["", "plain", "q\"uote\\back", "ctl\u{1}\n\t\r\u{8}\u{c}", "é中😀", "{\"a\":\"\\\"\"}"] {
            let mut literal = serde_json::to_string(text).unwrap().into_bytes();
            assert_eq!(unescape_in_place(&mut literal), Some(text.as_bytes()), "{text:?}");
        }
        for (literal, text) in [(r#""a\/b""#, "a/b"), (r#""\u00e9\ud83d\ude00\u0041""#, "é😀A")] {
            let mut literal = literal.as_bytes().to_vec();
            assert_eq!(unescape_in_place(&mut literal), Some(text.as_bytes()));
        }
        for bad in [r#""a\x""#, r#""\u12""#, r#""\ud83d""#, r#""\ud83dx""#, "\"open", "bare", "\"", r#""end\""#] {
            assert_eq!(unescape_in_place(&mut bad.as_bytes().to_vec()), None, "{bad}");
        }
    }

    #[test]
    fn round_trips() {
        let dir = temp_dir("rt");
        write(&dir, &sample()).unwrap();
        assert_eq!(read(&dir).unwrap(), sample());
        assert!(!dir.join(format!(".{FILE_NAME}.tmp")).exists());
    }

    #[test]
    fn missing_corrupt_and_foreign_versions_are_told_apart() {
        let dir = temp_dir("bad");
        assert!(matches!(read(&dir), Err(CheckpointError::Missing(_))));
        write(&dir, &sample()).unwrap();
        let text = fs::read_to_string(path_in(&dir)).unwrap();
        fs::write(path_in(&dir), &text[..text.len() / 2]).unwrap();
        assert!(matches!(read(&dir), Err(CheckpointError::Corrupt { .. })));
        fs::write(path_in(&dir), text.replace("10.96.0.10", "10.96.0.11")).unwrap();
        let error = read(&dir).unwrap_err();
        assert!(error.to_string().contains("checksum"), "{error}");
        fs::write(path_in(&dir), text.replace("\"version\":1", "\"version\":7")).unwrap();
        assert!(matches!(read(&dir), Err(CheckpointError::VersionMismatch { found: 7, .. })));
    }

    #[test]
    fn a_checkpoint_written_by_an_ipv4_only_agent_restores_the_same_ipv4_services() {
        // Byte for byte what an IPv4-only agent wrote: objects as the API served them.
        let payload = r#"{"written_unix":1.5,"services":[{"metadata":{"name":"web","namespace":"default","resourceVersion":"1"},"spec":{"clusterIP":"10.96.0.10","clusterIPs":["10.96.0.10"],"ports":[{"name":"http","port":80,"protocol":"TCP"}],"type":"ClusterIP"}}],"endpoint_slices":[{"addressType":"IPv4","endpoints":[{"addresses":["10.0.0.1"],"conditions":{"ready":true}}],"metadata":{"labels":{"kubernetes.io/service-name":"web"},"name":"web-1","namespace":"default","resourceVersion":"2"},"ports":[{"name":"http","port":8080,"protocol":"TCP"}]}],"pods":[],"namespaces":[],"nodes":[],"network_policies":[]}"#;
        let envelope = serde_json::json!({"version": 1, "checksum": format!("{:016x}", fnv1a(payload.as_bytes())), "payload": payload});
        let dir = temp_dir("old");
        fs::create_dir_all(&dir).unwrap();
        fs::write(path_in(&dir), envelope.to_string()).unwrap();
        let mut objects = crate::k8s::watch::ClusterObjects::default();
        objects.restore(read(&dir).unwrap());
        let state = objects.state().state;
        let web = &state.services[&crate::services::model::ServiceName::new("default", "web")];
        assert_eq!(web.cluster_ips, [std::net::IpAddr::from([10, 96, 0, 10])]);
        assert_eq!(web.ip_families, [crate::services::family::IpFamily::IPv4]);
        let slice = state.slices.values().next().unwrap();
        assert_eq!(slice.endpoints[0].addr, std::net::IpAddr::from([10, 0, 0, 1]));
    }
}
