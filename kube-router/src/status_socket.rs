//! The agent's status pages (`bgp`) on a unix socket, `<state-dir>/agent.sock` (0600, root), so
//! `kube-router bgp` works with the health and metrics ports disabled. One request per
//! connection: the page's name on a line; the answer is the page's text.
use std::{
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::metrics::Metrics;

const SOCKET_NAME: &str = "agent.sock";
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(SOCKET_NAME)
}

/// Binds the socket (replacing a previous agent's socket, nothing else) and serves it forever.
pub async fn serve(state_dir: PathBuf, metrics: Metrics) {
    let path = path(&state_dir);
    let listener = match bind(&path) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::error!(path = %path.display(), error = %format!("{e:#}"), "cannot serve the status socket");
            return;
        }
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut name = String::new();
            // A page name, not a stream.
            let mut lines = BufReader::new(read.take(256));
            if tokio::time::timeout(REQUEST_TIMEOUT, lines.read_line(&mut name)).await.is_err() {
                return;
            }
            let page = metrics.page(name.trim()).unwrap_or_else(|| format!("no page {:?}\n", name.trim()));
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, write.write_all(page.as_bytes())).await;
        });
    }
}

fn bind(path: &Path) -> Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => anyhow::bail!("{} exists and is not a socket: not ours, left alone", path.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Asks the agent whose state directory is `state_dir` for a page (blocking; for the CLI).
pub fn request(state_dir: &Path, name: &str) -> Result<String> {
    use std::io::{Read, Write};
    let path = path(state_dir);
    let mut stream = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("cannot reach the agent on {} (--state-dir)", path.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("{name}\n").as_bytes())?;
    let mut page = String::new();
    stream.read_to_string(&mut page)?;
    Ok(page)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn serves_a_registered_page_and_leaves_a_foreign_file_alone() {
        let dir = std::env::temp_dir().join(format!("krt-status-socket-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let metrics = Metrics::default();
        metrics.register_page("bgp", Arc::new(|| "local AS 64512\n".to_string()));
        tokio::spawn(serve(dir.clone(), metrics));
        let asked = dir.clone();
        let page = tokio::task::spawn_blocking(move || {
            for _ in 0..100 {
                if let Ok(page) = request(&asked, "bgp") {
                    return page;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("no answer")
        })
        .await
        .unwrap();
        assert_eq!(page, "local AS 64512\n");
        let mode = std::fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::remove_file(path(&dir)).unwrap();
        std::fs::write(path(&dir), "someone's file").unwrap();
        assert!(bind(&path(&dir)).is_err());
        assert_eq!(std::fs::read_to_string(path(&dir)).unwrap(), "someone's file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
