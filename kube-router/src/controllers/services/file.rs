//! Services from a file (`--service-file`), read again when it changes.
use std::{
    net::IpAddr,
    path::PathBuf,
    time::{Duration, SystemTime},
};

use anyhow::Result;
use tokio::sync::watch;

use super::programmer::ServiceProgrammer;
use crate::{
    metrics::{AgentMetrics, Metrics},
    runtime::{self, Action, Controller},
    services::{
        incremental::{Changed, ServiceCatalog},
        source::{load_file, StateBuilder},
    },
};

struct FileSource {
    path: PathBuf,
    stamp: Option<SystemTime>,
    /// The last read error, so a file that stays broken is reported once, not every second.
    last_error: Option<String>,
}

impl FileSource {
    fn new(path: PathBuf) -> Self {
        Self { path, stamp: None, last_error: None }
    }

    /// The file's objects if it changed since the last read.
    fn poll(&mut self, metrics: &Metrics) -> Option<StateBuilder> {
        let stamp = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if stamp.is_some() && stamp == self.stamp {
            return None;
        }
        self.stamp = stamp;
        match load_file(&self.path) {
            Ok(builder) => {
                self.last_error = None;
                Some(builder)
            }
            Err(e) => {
                let error = format!("{e:#}");
                if self.last_error.as_ref() != Some(&error) {
                    // An unreadable desired state is not an empty one: keep everything programmed.
                    tracing::error!(error, "cannot read desired state; maps left as they are");
                    metrics.of::<AgentMetrics>().reject("file");
                    self.last_error = Some(error);
                }
                None
            }
        }
    }
}

/// Services from a file (`--service-file`), read again when it changes.
pub struct ServicesFromFile {
    controller: ServiceProgrammer,
    file: FileSource,
    node_addresses: watch::Receiver<Vec<IpAddr>>,
}

impl ServicesFromFile {
    pub fn new(mut controller: ServiceProgrammer, path: PathBuf, node_addresses: watch::Receiver<Vec<IpAddr>>) -> Self {
        controller.follow_addresses(&node_addresses);
        Self { controller, file: FileSource::new(path), node_addresses }
    }
}

/// How often the file's modification time is checked when no inotify event came (a change
/// inotify cannot see, or no inotify at all).
const FILE_POLL: Duration = Duration::from_secs(1);

/// Inotify events of the service file's directory: a file written in place (closed after
/// writing) or replaced by a rename, or a ConfigMap volume's `..data` symlink swapped, wakes the
/// controller at once instead of at the next poll (up to a second later). Any event of the
/// directory wakes it: the run itself checks whether the file's modification time changed.
pub struct FileEvents(Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>);

impl FileEvents {
    /// Watches `file`'s directory; without inotify the controller polls only.
    pub fn watch(file: &std::path::Path) -> Self {
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        match Self::open(dir) {
            Ok(fd) => Self(Some(fd)),
            Err(error) => {
                tracing::warn!(%error, dir = %dir.display(), "cannot watch the service file's directory; it is polled every second");
                Self(None)
            }
        }
    }

    fn open(dir: &std::path::Path) -> std::io::Result<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
        use std::os::{fd::FromRawFd, unix::ffi::OsStrExt};
        let dir = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
        // SAFETY: plain inotify_init1(2); the fd is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a new inotify instance nothing else owns.
        let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let mask = libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO | libc::IN_CREATE | libc::IN_DELETE | libc::IN_ATTRIB;
        // SAFETY: dir is a NUL-terminated path that outlives the call.
        if unsafe { libc::inotify_add_watch(fd, dir.as_ptr(), mask) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd stays open and the same for the AsyncFd's lifetime (it owns it).
        unsafe { tokio::io::unix::AsyncFd::register(owned) }.map_err(std::io::Error::from)
    }
}

impl runtime::Trigger for FileEvents {
    async fn changed(&mut self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = self.0.as_ref() else { return false };
        let mut buf = [0u8; 4096];
        loop {
            let mut guard = match fd.readable().await {
                Ok(guard) => guard,
                Err(error) => {
                    tracing::warn!(%error, "service file events failed; it is polled every second");
                    self.0 = None;
                    return false;
                }
            };
            // Every queued event is consumed: one run takes them all (an overflowed queue too).
            let mut got = false;
            loop {
                // SAFETY: buf is writable for its whole length.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n > 0 {
                    got = true;
                    continue;
                }
                let error = std::io::Error::last_os_error();
                if n == 0 || error.raw_os_error() == Some(libc::EAGAIN) {
                    break;
                }
                tracing::warn!(%error, "service file events failed; it is polled every second");
                self.0 = None;
                return false;
            }
            guard.clear_ready();
            if got {
                return true;
            }
        }
    }
}

impl Controller for ServicesFromFile {
    fn name(&self) -> &'static str {
        "services"
    }

    async fn reconcile(&mut self) -> Result<Action> {
        if self.node_addresses.has_changed().unwrap_or(false) {
            self.node_addresses.borrow_and_update();
            self.file.stamp = None;
        }
        if let Some(builder) = self.file.poll(&self.controller.metrics) {
            let failed = self.controller.apply(&ServiceCatalog::from_builder(builder), Changed::All, true);
            if failed > 0 {
                // Read and applied again at the retry.
                self.file.stamp = None;
                anyhow::bail!("{failed} service map writes failed");
            }
        }
        Ok(Action::RequeueAfter(FILE_POLL))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_service_file_replaced_by_a_rename_wakes_the_controller_before_the_poll() {
        use runtime::Trigger;
        let dir = std::env::temp_dir().join(format!("krt-file-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("services.yaml");
        // Written before the watch: the rename alone is what wakes it.
        let tmp = dir.join("services.tmp");
        std::fs::write(&tmp, "kind: Service\n").unwrap();
        let mut events = FileEvents::watch(&file);
        assert!(events.0.is_some(), "inotify watch");
        std::fs::rename(&tmp, &file).unwrap();
        let woken = tokio::time::timeout(FILE_POLL / 4, events.changed()).await;
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(woken, Ok(true), "woken well within the poll interval");
    }
}
