//! The last successfully synced desired state, on local disk, so a restarted agent can program
//! the node while the API server is unreachable.
//!
//! One file: a base (every object) and after it a journal (the objects changed or deleted
//! since, one record per write), so a write costs what changed, not the cluster. Each record is
//! framed with its length and CRC-32 (`#B|J <len, 16 hex> <crc, 8 hex>\n<JSON>\n`), the base
//! first, after a version line. A base is written whole and atomically (temp file, fsync, rename,
//! fsync of the directory), and again in place of the journal once the journal has grown as large
//! as the base (the writer's compaction): the amortised cost per change stays bounded. Records
//! are appended and fsynced one write at a time; a record the agent died writing (the file's
//! tail cut short, or failing its checksum at the end) is dropped on reading, which leaves the
//! state of an earlier write. Anything else that does not check out — a truncated or edited base,
//! a bad record with more after it, a foreign file — is rejected with a clear error, never
//! half-applied. The version-1 file (one JSON envelope) an earlier agent wrote is still read.
//!
//! A version-2 file is read a record at a time, the base decoded as it is read from the file
//! (its checksum counted on the way, the result kept only if it matches) and, for the agent's
//! start, each object put in its store's form as it is decoded ([`read_for_restore`]).
use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{Read, Write},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use k8s_openapi::api::core::v1::Node;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::{kinds::Watched, store::ObjectKey, watch::Kind};

pub const CHECKPOINT_VERSION: u32 = 2;
/// The earlier format (one JSON envelope, written whole), still read.
const VERSION_1: u32 = 1;
/// The file keeps its name across formats: tooling and the upgrade find it where it was.
pub const FILE_NAME: &str = "checkpoint.json";
/// The first line of a version-2 file.
const VERSION_LINE: &[u8] = b"{\"version\":2}\n";
/// `#K <len> <crc>\n`: a record's kind, its payload's length (16 hex digits) and CRC-32 (8).
const FRAME_HEADER_LEN: usize = 29;
const BASE: u8 = b'B';
const JOURNAL: u8 = b'J';

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

        /// One journal record: the objects of each kind changed since the record before, in
        /// their checkpoint form, `None` for one deleted (written by
        /// [`CheckpointChanges`](super::watch::CheckpointChanges)).
        #[derive(Debug, Default, Deserialize)]
        pub struct JournalBatch {
            /// Unix time of the sync it records.
            pub written_unix: f64,
            $(#[serde(default)] pub $field: Vec<(ObjectKey, Option<<$ty as Watched>::Saved>)>,)*
        }

        /// The journal read so far: each changed object's last state.
        #[derive(Default)]
        struct Replay {
            written_unix: Option<f64>,
            $($field: Latest<<$ty as Watched>::Saved>,)*
        }

        impl Replay {
            fn add(&mut self, batch: JournalBatch) {
                self.written_unix = Some(batch.written_unix);
                $(for (key, object) in batch.$field {
                    self.$field.insert(key, object);
                })*
            }

            /// The base with the journal's changes in place of its objects.
            fn apply_to(self, checkpoint: &mut Checkpoint) {
                let Some(written_unix) = self.written_unix else { return };
                checkpoint.written_unix = written_unix;
                $(if !self.$field.is_empty() {
                    let latest = self.$field;
                    checkpoint.$field.retain(|saved| {
                        let (namespace, name) = <$ty as Watched>::saved_key(saved);
                        !latest.contains(namespace, name)
                    });
                    checkpoint.$field.extend(latest.into_present());
                })*
            }
        }

        /// The checkpoint as the stores keep it ([`read_for_restore`]): each kind's objects by
        /// key, in the form its store holds them.
        pub struct Restored {
            /// Unix time of the sync it records.
            pub written_unix: f64,
            $(pub $field: BTreeMap<ObjectKey, <$ty as Watched>::Held>,)*
        }

        impl Restored {
            /// A checkpoint read whole (the version-1 file), in the stores' form.
            fn from_checkpoint(checkpoint: Checkpoint) -> Self {
                Self {
                    written_unix: checkpoint.written_unix,
                    $($field: checkpoint.$field.into_iter().map(<$ty as Watched>::restored).collect(),)*
                }
            }

            /// One journal record's changes in place of the objects they name; a later record
            /// wins, as in [`Replay`].
            fn apply(&mut self, batch: JournalBatch) {
                self.written_unix = batch.written_unix;
                $(for (key, object) in batch.$field {
                    self.$field.remove(&key);
                    if let Some(saved) = object {
                        let (key, held) = <$ty as Watched>::restored(saved);
                        self.$field.insert(key, held);
                    }
                })*
            }
        }

        /// The base as [`Restored`] reads it: each object restored as it is decoded.
        #[derive(Deserialize)]
        struct RestoredBase {
            written_unix: f64,
            $($field: RestoredList<$ty>,)*
        }

        impl From<RestoredBase> for Restored {
            fn from(base: RestoredBase) -> Self {
                Self { written_unix: base.written_unix, $($field: base.$field.0.into_iter().collect(),)* }
            }
        }
    };
}

crate::watched_kinds!(checkpoint_contents);

/// Each key's last state in the journal (`None`: deleted), by namespace then name so the base's
/// objects are looked up with their borrowed key.
struct Latest<T>(BTreeMap<Arc<str>, BTreeMap<Arc<str>, Option<T>>>);

impl<T> Default for Latest<T> {
    fn default() -> Self {
        Self(BTreeMap::new())
    }
}

impl<T> Latest<T> {
    fn insert(&mut self, ObjectKey { namespace, name }: ObjectKey, object: Option<T>) {
        self.0.entry(namespace).or_default().insert(name, object);
    }

    fn contains(&self, namespace: &str, name: &str) -> bool {
        self.0.get(namespace).is_some_and(|names| names.contains_key(name))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn into_present(self) -> impl Iterator<Item = T> {
        self.0.into_values().flat_map(BTreeMap::into_values).flatten()
    }
}

/// A kind's list in the base, each object restored (`Watched::restored`) as soon as it is
/// decoded: the list never holds the checkpoint's form of 150,000 Pods (a `Vec` of them, with
/// its doubling slack, was ~40 MiB of the start's peak at full size; issue 29).
struct RestoredList<K: Watched>(Vec<(ObjectKey, K::Held)>);

impl<'de, K: Watched> Deserialize<'de> for RestoredList<K> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Objects<K>(std::marker::PhantomData<K>);
        impl<'de, K: Watched> serde::de::Visitor<'de> for Objects<K> {
            type Value = RestoredList<K>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of objects")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut restored = Vec::new();
                while let Some(saved) = seq.next_element::<K::Saved>()? {
                    restored.push(K::restored(saved));
                }
                Ok(RestoredList(restored))
            }
        }
        deserializer.deserialize_seq(Objects(std::marker::PhantomData))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("no checkpoint at {0}")]
    Missing(PathBuf),
    #[error("cannot read checkpoint {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("checkpoint {path} has version {found}, this agent reads versions {VERSION_1} and {CHECKPOINT_VERSION}")]
    VersionMismatch { path: PathBuf, found: u32 },
}

/// FNV-1a 64: the version-1 file's checksum.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, b| (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
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

/// Writes `checkpoint` as a new base with no journal.
pub fn write(state_dir: &Path, checkpoint: &Checkpoint) -> std::io::Result<u64> {
    write_base(state_dir, checkpoint)
}

/// Writes anything that serialises as a [`Checkpoint`] (the agent's snapshot of shared
/// objects) as a new base, in place of the file and its journal; returns the bytes written.
/// The payload is streamed into the file and its CRC and length counted on the way, the record's
/// header written in its place last: no copy of the objects or of their JSON is held (at 150,000
/// Pods that copy is ~100 MiB of peak memory).
pub fn write_base(state_dir: &Path, payload: &impl Serialize) -> std::io::Result<u64> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    restrict_permissions(state_dir)?;
    let final_path = path_in(state_dir);
    let temp_path = state_dir.join(format!(".{FILE_NAME}.tmp"));
    // A temp file an earlier write left keeps its mode through truncation: removed first.
    let _ = fs::remove_file(&temp_path);
    let file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp_path)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 16, file);
    out.write_all(VERSION_LINE)?;
    out.write_all(&[b' '; FRAME_HEADER_LEN])?;
    let mut counted = Counted { out: &mut out, crc: crc32fast::Hasher::new(), len: 0 };
    serde_json::to_writer(&mut counted, payload)?;
    let (crc, len) = (counted.crc.finalize(), counted.len);
    out.write_all(b"\n")?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.write_all_at(&frame_header(BASE, len, crc), VERSION_LINE.len() as u64)?;
    file.sync_all()?;
    fs::rename(&temp_path, &final_path)?;
    // The rename itself must reach the disk before we call the checkpoint written.
    File::open(state_dir)?.sync_all()?;
    Ok(VERSION_LINE.len() as u64 + FRAME_HEADER_LEN as u64 + len + 1)
}

/// Appends one journal record (anything that serialises as a [`JournalBatch`]: the changes
/// since the last write) to the checkpoint and fsyncs it; returns the bytes written. The file
/// must hold a base: a journal is nothing without one, so a missing file is an error and the
/// writer writes a base next.
pub fn append(state_dir: &Path, batch: &impl Serialize) -> std::io::Result<u64> {
    let payload = serde_json::to_vec(batch)?;
    let mut record = Vec::with_capacity(FRAME_HEADER_LEN + payload.len() + 1);
    record.extend_from_slice(&frame_header(JOURNAL, payload.len() as u64, crc32fast::hash(&payload)));
    record.extend_from_slice(&payload);
    record.push(b'\n');
    let mut file = fs::OpenOptions::new().append(true).open(path_in(state_dir))?;
    // One write: a record is either whole or a torn tail, dropped on reading.
    file.write_all(&record)?;
    file.sync_data()?;
    Ok(record.len() as u64)
}

fn frame_header(kind: u8, len: u64, crc: u32) -> [u8; FRAME_HEADER_LEN] {
    let mut header = [0; FRAME_HEADER_LEN];
    let text = format!("#{} {len:016x} {crc:08x}\n", kind as char);
    header.copy_from_slice(text.as_bytes());
    header
}

/// Passes bytes on, with their CRC-32 and count.
struct Counted<W> {
    out: W,
    crc: crc32fast::Hasher,
    len: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.out.write_all(bytes)?;
        self.crc.update(bytes);
        self.len += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// What [`read`] found besides the objects.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadStats {
    /// Journal records replayed over the base.
    pub journal_records: usize,
    /// The journal's last record was cut short or failed its checksum (the agent died writing
    /// it), and was dropped.
    pub torn_tail: bool,
}

/// Reads and checks the checkpoint: the base with its journal replayed (a torn last record
/// dropped, with a warning), or the version-1 file an earlier agent wrote.
pub fn read(state_dir: &Path) -> Result<Checkpoint, CheckpointError> {
    read_with_stats(state_dir).map(|(checkpoint, _)| checkpoint)
}

/// [`read`], with what it found.
pub fn read_with_stats(state_dir: &Path) -> Result<(Checkpoint, ReadStats), CheckpointError> {
    let (Replaying(mut checkpoint, replay), stats) = read_file::<Replaying>(state_dir)?;
    replay.apply_to(&mut checkpoint);
    Ok((checkpoint, stats))
}

/// [`read_with_stats`] into the stores' form, for the agent's start: each object restored as it
/// is decoded, the file read a piece at a time. Reading the file whole and decoding it into a
/// [`Checkpoint`] held the file (~78 MiB at 150,000 Pods) and every object's checkpoint form at
/// once: most of the start's peak memory (issue 29).
pub fn read_for_restore(state_dir: &Path) -> Result<(Restored, ReadStats), CheckpointError> {
    read_file::<Restored>(state_dir)
}

/// What a checkpoint is read into.
trait ReadInto: Sized {
    /// The base's form.
    type Base: DeserializeOwned;
    fn base(base: Self::Base) -> Self;
    fn version_1(checkpoint: Checkpoint) -> Self;
    /// One journal record, after the base and the records before it.
    fn journal(&mut self, batch: JournalBatch);
}

/// A [`Checkpoint`] and the journal read so far, applied at the end.
struct Replaying(Checkpoint, Replay);

impl ReadInto for Replaying {
    type Base = Checkpoint;
    fn base(base: Checkpoint) -> Self {
        Self(base, Replay::default())
    }
    fn version_1(checkpoint: Checkpoint) -> Self {
        Self::base(checkpoint)
    }
    fn journal(&mut self, batch: JournalBatch) {
        self.1.add(batch);
    }
}

impl ReadInto for Restored {
    type Base = RestoredBase;
    fn base(base: RestoredBase) -> Self {
        base.into()
    }
    fn version_1(checkpoint: Checkpoint) -> Self {
        Self::from_checkpoint(checkpoint)
    }
    fn journal(&mut self, batch: JournalBatch) {
        self.apply(batch);
    }
}

fn read_file<T: ReadInto>(state_dir: &Path) -> Result<(T, ReadStats), CheckpointError> {
    let path = path_in(state_dir);
    let file = match File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(CheckpointError::Missing(path)),
        Err(source) => return Err(CheckpointError::Io { path, source }),
    };
    let io = |source| CheckpointError::Io { path: path.clone(), source };
    let size = file.metadata().map_err(io)?.len();
    let mut first = [0; VERSION_LINE.len()];
    if read_at_most(&file, &mut first, 0).map_err(io)? == first.len() && first == VERSION_LINE {
        return read_records(&path, &file, size);
    }
    let mut bytes = Vec::new();
    (&file).read_to_end(&mut bytes).map_err(io)?;
    // Another version's line (a newer agent's file), or the version-1 envelope (one line).
    if let Some(newline) = bytes.iter().position(|b| *b == b'\n') {
        if let Ok(VersionLine { version }) = serde_json::from_slice(&bytes[..newline]) {
            return Err(CheckpointError::VersionMismatch { path, found: version });
        }
    }
    read_version_1(&path, bytes).map(|checkpoint| (T::version_1(checkpoint), ReadStats::default()))
}

/// Reads into `buf` from `at` until it is full or the file ends; returns the bytes read.
fn read_at_most(file: &File, buf: &mut [u8], at: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// A checkpoint's first line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VersionLine {
    version: u32,
}

fn read_records<T: ReadInto>(path: &Path, file: &File, size: u64) -> Result<(T, ReadStats), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_owned(), reason };
    let io = |source| CheckpointError::Io { path: path.to_owned(), source };
    let mut records = Records { file, at: VERSION_LINE.len() as u64, size };
    let (len, crc) = match records.header().map_err(io)? {
        Frame::Record(BASE, header) => header,
        Frame::Record(..) => return Err(corrupt("its first record is not a base".into())),
        Frame::End => return Err(corrupt("it holds no base".into())),
        Frame::Torn(reason) => return Err(corrupt(format!("its base {reason}"))),
        Frame::Bad(reason) => return Err(corrupt(format!("its base {reason}"))),
    };
    let base = match records.decode::<T::Base>(len, crc).map_err(io)? {
        Frame::Record(_, Ok(base)) => base,
        Frame::Record(_, Err(e)) => return Err(corrupt(format!("its base does not decode: {e}"))),
        Frame::Torn(reason) | Frame::Bad(reason) => return Err(corrupt(format!("its base {reason}"))),
        Frame::End => unreachable!("a payload is a record or fails its checks"),
    };
    let mut contents = T::base(base);
    let mut stats = ReadStats::default();
    loop {
        let offset = records.at;
        let header = match records.header().map_err(io)? {
            Frame::End => break,
            Frame::Record(JOURNAL, header) => Ok(header),
            Frame::Record(..) => return Err(corrupt(format!("record at byte {offset} is not a journal record"))),
            Frame::Torn(reason) => Err(Frame::Torn(reason)),
            Frame::Bad(reason) => Err(Frame::Bad(reason)),
        };
        let payload = match header {
            Ok((len, crc)) => records.payload(len, crc).map_err(io)?,
            Err(frame) => frame,
        };
        match payload {
            Frame::Record(_, payload) => {
                let batch: JournalBatch = serde_json::from_slice(&payload)
                    .map_err(|e| corrupt(format!("journal record at byte {offset} does not decode: {e}")))?;
                contents.journal(batch);
                stats.journal_records += 1;
            }
            Frame::Torn(reason) => {
                tracing::warn!(path = %path.display(), byte = offset, reason = &*reason, "dropping the checkpoint journal's torn last record (the agent stopped while writing it)");
                stats.torn_tail = true;
                break;
            }
            Frame::Bad(reason) => return Err(corrupt(format!("journal record at byte {offset}: {reason}"))),
            Frame::End => unreachable!("a payload is a record or fails its checks"),
        }
    }
    Ok((contents, stats))
}

enum Frame<T> {
    Record(u8, T),
    End,
    /// The last record, incomplete: what a crash while appending leaves.
    Torn(String),
    /// A record that does not check out with more after it, or malformed.
    Bad(String),
}

impl<T> Frame<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Frame<U> {
        match self {
            Frame::Record(kind, record) => Frame::Record(kind, f(record)),
            Frame::End => Frame::End,
            Frame::Torn(reason) => Frame::Torn(reason),
            Frame::Bad(reason) => Frame::Bad(reason),
        }
    }
}

/// The records of a version-2 file, read one at a time from `at`.
struct Records<'a> {
    file: &'a File,
    /// Where the next record starts.
    at: u64,
    size: u64,
}

impl Records<'_> {
    /// The next record's header: its kind, length and checksum, once its length is known to
    /// fit in the file.
    fn header(&mut self) -> std::io::Result<Frame<(u64, u32)>> {
        let rest = self.size.saturating_sub(self.at);
        if rest == 0 {
            return Ok(Frame::End);
        }
        let mut header = [0; FRAME_HEADER_LEN];
        if read_at_most(self.file, &mut header, self.at)? < FRAME_HEADER_LEN {
            return Ok(Frame::Torn("ends within its header".into()));
        }
        let Some((kind, len, crc)) = parse_frame_header(&header) else {
            // A file extended but not written before a crash reads as zeros.
            if self.rest_is_zeros()? {
                return Ok(Frame::Torn("is zeros".into()));
            }
            return Ok(Frame::Bad("has a malformed header".into()));
        };
        match (FRAME_HEADER_LEN as u64 + 1).checked_add(len) {
            None => Ok(Frame::Bad(format!("has an impossible length {len}"))),
            Some(end) if end > rest => Ok(Frame::Torn("is cut short".into())),
            Some(_) => Ok(Frame::Record(kind, (len, crc))),
        }
    }

    fn rest_is_zeros(&self) -> std::io::Result<bool> {
        let mut chunk = vec![0; 1 << 16];
        let mut at = self.at;
        loop {
            let got = read_at_most(self.file, &mut chunk, at)?;
            if chunk[..got].iter().any(|b| *b != 0) {
                return Ok(false);
            }
            if got < chunk.len() {
                return Ok(true);
            }
            at += got as u64;
        }
    }

    /// The payload of the record whose header [`Self::header`] just read, whole.
    fn payload(&mut self, len: u64, crc: u32) -> std::io::Result<Frame<Vec<u8>>> {
        let mut payload = vec![0; len as usize];
        let got = read_at_most(self.file, &mut payload, self.payload_start())?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&payload[..got]);
        Ok(self.checked(len, crc, hasher, got as u64)?.map(|()| payload))
    }

    /// The payload of the record whose header [`Self::header`] just read, decoded as it is read
    /// (a base is most of the file: it is never held whole), then checked as [`Self::payload`]
    /// checks it: a decoded payload that fails its checksum is not returned.
    fn decode<B: DeserializeOwned>(&mut self, len: u64, crc: u32) -> std::io::Result<Frame<serde_json::Result<B>>> {
        let mut payload =
            Payload { file: self.file, at: self.payload_start(), left: len, crc: crc32fast::Hasher::new() };
        let decoded = serde_json::from_reader(std::io::BufReader::with_capacity(1 << 20, &mut payload));
        // What the decoder left unread (it stops at an error) still counts in the checksum.
        std::io::copy(&mut payload, &mut std::io::sink())?;
        let read = len - payload.left;
        Ok(self.checked(len, crc, payload.crc, read)?.map(|()| decoded))
    }

    fn payload_start(&self) -> u64 {
        self.at + FRAME_HEADER_LEN as u64
    }

    /// Checks a payload of `len` bytes of which `read` were read (fewer: the file shrank while
    /// being read) against its checksum and the newline after it, and moves past the record.
    fn checked(&mut self, len: u64, crc: u32, hasher: crc32fast::Hasher, read: u64) -> std::io::Result<Frame<()>> {
        let end = self.payload_start() + len + 1;
        let mut newline = [0];
        let whole = read == len && read_at_most(self.file, &mut newline, end - 1)? == 1;
        let actual = hasher.finalize();
        if !whole || actual != crc || newline[0] != b'\n' {
            if end >= self.size {
                return Ok(Frame::Torn("fails its checksum".into()));
            }
            return Ok(Frame::Bad(format!("checksum {actual:08x} does not match recorded {crc:08x}")));
        }
        self.at = end;
        Ok(Frame::Record(0, ()))
    }
}

/// `left` bytes of `file` from `at`, with their CRC-32.
struct Payload<'a> {
    file: &'a File,
    at: u64,
    left: u64,
    crc: crc32fast::Hasher,
}

impl Read for Payload<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let got = self.file.read_at(&mut buf[..want], self.at)?;
        self.crc.update(&buf[..got]);
        self.at += got as u64;
        self.left -= got as u64;
        Ok(got)
    }
}

fn parse_frame_header(header: &[u8]) -> Option<(u8, u64, u32)> {
    let text = std::str::from_utf8(header).ok()?;
    let (kind, len, crc) = (text.get(1..2)?, text.get(3..19)?, text.get(20..28)?);
    let well_formed = text.starts_with('#') && &text[2..3] == " " && &text[19..20] == " " && text.ends_with('\n');
    let hex = |digits: &str| digits.bytes().all(|b| b.is_ascii_hexdigit());
    if !well_formed || !hex(len) || !hex(crc) {
        return None;
    }
    Some((kind.as_bytes()[0], u64::from_str_radix(len, 16).ok()?, u32::from_str_radix(crc, 16).ok()?))
}

/// The version-1 file: the payload (a JSON string in the envelope) unescaped where it lies, then
/// decoded from there: no second copy of ~100 MiB at the start's peak.
fn read_version_1(path: &Path, mut bytes: Vec<u8>) -> Result<Checkpoint, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.to_owned(), reason };
    let (version, checksum, literal) = {
        let envelope: BorrowedEnvelope =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("not a checkpoint envelope: {e}")))?;
        let literal = envelope.payload.get();
        let start = literal.as_ptr() as usize - bytes.as_ptr() as usize;
        (envelope.version, envelope.checksum, start..start + literal.len())
    };
    if version != VERSION_1 {
        return Err(CheckpointError::VersionMismatch { path: path.to_owned(), found: version });
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

    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::{
        pod::SlimPod,
        watch::{CheckpointFeeds, ClusterObjects},
    };

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
        Checkpoint { written_unix: 1.5, services: vec![service.into()], ..Default::default() }
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
        assert!(matches!(read(&dir), Err(CheckpointError::Corrupt { .. })), "a base cut short");
        fs::write(path_in(&dir), text.replace("10.96.0.10", "10.96.0.11")).unwrap();
        let error = read(&dir).unwrap_err();
        assert!(error.to_string().contains("checksum"), "{error}");
        fs::write(path_in(&dir), text.replace("{\"version\":2}", "{\"version\":7}")).unwrap();
        assert!(matches!(read(&dir), Err(CheckpointError::VersionMismatch { found: 7, .. })));
        // A version-1 envelope of another version, and no checkpoint at all.
        let envelope = serde_json::json!({"version": 7, "checksum": "0", "payload": "{}"});
        fs::write(path_in(&dir), envelope.to_string()).unwrap();
        assert!(matches!(read(&dir), Err(CheckpointError::VersionMismatch { found: 7, .. })));
        fs::write(path_in(&dir), "not a checkpoint\n").unwrap();
        assert!(matches!(read(&dir), Err(CheckpointError::Corrupt { .. })));
    }

    fn service(name: &str, ip: &str) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": name, "resourceVersion": "1"},
            "spec": {"clusterIP": ip, "ports": [{"port": 80}]}
        }))
        .unwrap()
    }

    fn slice(name: &str, ip: &str) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": name, "resourceVersion": "1",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": true}}],
            "ports": [{"port": 8080}]
        }))
        .unwrap()
    }

    fn namespace(name: &str, team: &str) -> crate::k8s::namespace::NamespaceFields {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": {"team": team}}})).unwrap()
    }

    /// Every kind's objects in key order: a replay appends what changed after the rest.
    fn in_key_order(mut checkpoint: Checkpoint) -> Checkpoint {
        macro_rules! sort {
            ($($variant:ident, $field:ident, $ty:ty;)*) => {
                $(checkpoint.$field.sort_by(|a, b| <$ty as Watched>::saved_key(a).cmp(&<$ty as Watched>::saved_key(b)));)*
            };
        }
        crate::watched_kinds!(sort);
        checkpoint.written_unix = 0.0;
        checkpoint
    }

    /// Stores listed with three kinds' objects, a base of them written, and the writer's feeds.
    fn stores_with_a_base(dir: &Path) -> (ClusterObjects, CheckpointFeeds) {
        let mut objects = ClusterObjects::default();
        let feeds = objects.subscribe_checkpoint();
        for name in ["web", "db", "cache"] {
            objects.services.apply(Event::Apply(service(name, "10.96.0.10")));
            objects.endpoint_slices.apply(Event::Apply(slice(&format!("{name}-1"), "10.0.0.1")));
            objects.namespaces.apply(Event::Apply(namespace(name, "a")));
        }
        assert!(objects.checkpoint_changes(&feeds).is_none(), "a feed's first take tells nothing");
        write_base(dir, &objects.snapshot()).unwrap();
        (objects, feeds)
    }

    fn append_changes(dir: &Path, objects: &mut ClusterObjects, feeds: &CheckpointFeeds) -> u64 {
        let changes = objects.checkpoint_changes(feeds).expect("the feeds tell what changed");
        assert!(!changes.is_empty());
        append(dir, &changes).unwrap()
    }

    /// What the agent's start restores ([`read_for_restore`]), as the stores' checkpoint.
    fn restored_for_the_start(dir: &Path) -> (Checkpoint, ReadStats) {
        let (restored, stats) = read_for_restore(dir).unwrap();
        let mut objects = ClusterObjects::default();
        objects.restore_from(restored);
        (in_key_order(objects.checkpoint()), stats)
    }

    #[test]
    fn the_base_with_its_journal_replayed_is_the_stores() {
        let dir = temp_dir("replay");
        let (mut objects, feeds) = stores_with_a_base(&dir);
        objects.services.apply(Event::Apply(service("web", "10.96.0.20")));
        objects.services.apply(Event::Delete(service("db", "10.96.0.10")));
        objects.endpoint_slices.apply(Event::Apply(slice("web-1", "10.0.0.2")));
        objects.namespaces.apply(Event::Apply(namespace("new", "b")));
        append_changes(&dir, &mut objects, &feeds);
        // A later record wins over an earlier one; a deleted object comes back.
        objects.services.apply(Event::Apply(service("web", "10.96.0.30")));
        objects.services.apply(Event::Apply(service("db", "10.96.0.40")));
        objects.namespaces.apply(Event::Delete(namespace("cache", "a")));
        append_changes(&dir, &mut objects, &feeds);
        let (read, stats) = read_with_stats(&dir).unwrap();
        assert_eq!(stats, ReadStats { journal_records: 2, torn_tail: false });
        assert_eq!(in_key_order(read.clone()), in_key_order(objects.checkpoint()));
        assert_eq!(restored_for_the_start(&dir), (in_key_order(objects.checkpoint()), stats));
        assert!(read.written_unix > 0.0, "the time of the last record");
        // Restored, then written as a new base: the same objects, no journal.
        let mut restored = ClusterObjects::default();
        restored.restore(read);
        write_base(&dir, &restored.snapshot()).unwrap();
        let (compacted, stats) = read_with_stats(&dir).unwrap();
        assert_eq!(stats.journal_records, 0);
        assert_eq!(in_key_order(compacted), in_key_order(objects.checkpoint()));
    }

    /// What an agent that died appending leaves — its last record cut short, failing its
    /// checksum, or zeros — reads as the state of the write before.
    #[test]
    fn a_torn_last_record_is_dropped() {
        let dir = temp_dir("torn");
        let (mut objects, feeds) = stores_with_a_base(&dir);
        objects.services.apply(Event::Apply(service("web", "10.96.0.20")));
        append_changes(&dir, &mut objects, &feeds);
        let before_last = in_key_order(objects.checkpoint());
        let whole = fs::read(path_in(&dir)).unwrap();
        objects.services.apply(Event::Apply(service("web", "10.96.0.30")));
        let last = append_changes(&dir, &mut objects, &feeds) as usize;
        let with_last = fs::read(path_in(&dir)).unwrap();
        assert_eq!(in_key_order(read(&dir).unwrap()), in_key_order(objects.checkpoint()));

        let mut flipped = with_last.clone();
        let at = flipped.len() - 10;
        flipped[at] ^= 0x01;
        let zeros = [whole.clone(), vec![0; 4096]].concat();
        for (what, bytes) in [
            ("cut within its payload", with_last[..with_last.len() - last / 2].to_vec()),
            ("cut within its header", with_last[..whole.len() + 10].to_vec()),
            ("its newline missing", with_last[..with_last.len() - 1].to_vec()),
            ("failing its checksum", flipped),
            ("zeros", zeros),
        ] {
            fs::write(path_in(&dir), &bytes).unwrap();
            let (read, stats) = read_with_stats(&dir).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(stats, ReadStats { journal_records: 1, torn_tail: true }, "{what}");
            assert_eq!(in_key_order(read), before_last, "{what}");
            assert_eq!(restored_for_the_start(&dir), (before_last.clone(), stats), "{what}");
        }
    }

    /// A bad record with more after it, or a bad base, is not what a crash leaves: the file is
    /// refused whole, never applied up to the damage.
    #[test]
    fn a_corrupt_record_or_base_is_rejected() {
        let dir = temp_dir("corrupt");
        let (mut objects, feeds) = stores_with_a_base(&dir);
        let base_len = fs::metadata(path_in(&dir)).unwrap().len() as usize;
        objects.services.apply(Event::Apply(service("web", "10.96.0.20")));
        append_changes(&dir, &mut objects, &feeds);
        objects.services.apply(Event::Apply(service("web", "10.96.0.30")));
        append_changes(&dir, &mut objects, &feeds);
        let text = fs::read_to_string(path_in(&dir)).unwrap();
        let first_record = &text[base_len..];
        for (what, edited) in [
            (
                "a journal record's payload",
                format!("{}{}", &text[..base_len], first_record.replacen("10.96.0.20", "10.96.0.21", 1)),
            ),
            ("a journal record's header", format!("{}#X{}", &text[..base_len], &first_record[2..])),
            ("the base", text.replacen("10.0.0.1", "10.0.0.9", 1)),
            ("the base's length", text.replacen("#B 0", "#B 1", 1)),
        ] {
            fs::write(path_in(&dir), &edited).unwrap();
            let error = read(&dir).unwrap_err();
            assert!(matches!(error, CheckpointError::Corrupt { .. }), "{what}: {error}");
            let error = read_for_restore(&dir).err().expect(what);
            assert!(matches!(error, CheckpointError::Corrupt { .. }), "{what}: {error}");
        }
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
        let mut for_the_start = crate::k8s::watch::ClusterObjects::default();
        for_the_start.restore_from(read_for_restore(&dir).unwrap().0);
        assert_eq!(in_key_order(for_the_start.checkpoint()), in_key_order(objects.checkpoint()));
        let state = objects.state().state;
        let web = &state.services[&crate::services::model::ServiceName::new("default", "web")];
        assert_eq!(web.cluster_ips, [std::net::IpAddr::from([10, 96, 0, 10])]);
        assert_eq!(web.ip_families, [crate::services::family::IpFamily::IPv4]);
        let slice = state.slices.values().next().unwrap();
        assert_eq!(slice.endpoints[0].addr, std::net::IpAddr::from([10, 0, 0, 1]));
    }
}
