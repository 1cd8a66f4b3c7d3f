//! A rolling upgrade across a map layout change drops nothing: the previous release (map layout
//! 2, built from git history) serves live long-lived TCP connections and a client opening new
//! ones; it is replaced by the current agent (layout 3), which copies conntrack, NAT and policy
//! state into its own maps (converting the policy rules into the port index) and swaps the
//! programs through the pinned links. No established connection
//! breaks, no new connection fails. Starting the previous release again (a downgrade) is refused
//! and changes nothing. As root, in network namespaces.
use std::{
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use kube_router_tests::*;

/// The last release with map layout 2 (stop 18).
const PREVIOUS_RELEASE: &str = "ab8a4cb552a7ba6a088e9b982da2a0764ef637dc";

/// The previous release's agent, built once from git history into `target/previous-release`.
fn previous_agent() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let out = target_dir().join(format!("previous-release-{}", &PREVIOUS_RELEASE[..12]));
    let binary = out.join("debug/kube-router");
    if binary.exists() {
        return binary;
    }
    let source = out.join("src");
    let have_commit = Command::new("git")
        .args(["cat-file", "-e", &format!("{PREVIOUS_RELEASE}^{{commit}}")])
        .current_dir(&workspace)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(have_commit, "commit {PREVIOUS_RELEASE} (the previous release) is not in this clone's history");
    let _ = Command::new("git").args(["worktree", "remove", "--force"]).arg(&source).current_dir(&workspace).status();
    let _ = std::fs::remove_dir_all(&source);
    let added = Command::new("git")
        .args(["worktree", "add", "--detach"])
        .arg(&source)
        .arg(PREVIOUS_RELEASE)
        .current_dir(&workspace)
        .status()
        .unwrap();
    assert!(added.success(), "git worktree add {PREVIOUS_RELEASE}");
    seed_dependencies(&out);
    let built = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "-p", "kube-router", "--bins", "--target-dir"])
        .arg(&out)
        .current_dir(&source)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .status()
        .unwrap();
    assert!(built.success(), "building the previous release");
    let _ = Command::new("git").args(["worktree", "remove", "--force"]).arg(&source).current_dir(&workspace).status();
    binary
}

/// Starts the previous release's build from this build's compiled dependencies: every crate
/// of the same version (most of them) is then reused instead of compiled again, which on a
/// clean checkout saves minutes. Only the dependencies' artifacts are copied (not the
/// workspace's libraries and test binaries, gigabytes); copied rather than linked, since cargo
/// rewrites what it rebuilds in place, and with their times (`cp -a`), which cargo compares.
fn seed_dependencies(out: &Path) {
    let ours = target_dir().join("debug");
    let theirs = out.join("debug");
    if theirs.exists() || !ours.exists() {
        return;
    }
    std::fs::create_dir_all(theirs.join("deps")).unwrap();
    // A failed copy only costs the time it would have saved.
    for dir in ["build", ".fingerprint"] {
        let _ = Command::new("cp").arg("-a").arg(ours.join(dir)).arg(&theirs).status();
    }
    let Ok(entries) = std::fs::read_dir(ours.join("deps")) else { return };
    let dependencies: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|path| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("lib") && !name.starts_with("libkube_router")
        })
        .collect();
    for chunk in dependencies.chunks(500) {
        let _ = Command::new("cp").arg("-a").args(chunk).arg(theirs.join("deps")).status();
    }
}

fn start(ns: &Netns, binary: &Path, root: &Path, file: &ServiceFile, state: &Path) -> std::process::Child {
    Command::new("nsenter")
        .arg(format!("--net={}", ns.path()))
        .arg(binary)
        .arg("--bpf-root")
        .arg(root)
        .args(["--service-file", &file.arg(), "--health-port", "0", "--run-router=false", "--state-dir"])
        .arg(state)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        thread::sleep(Duration::from_millis(100));
    }
}

fn failures(lines: &[String]) -> Vec<String> {
    lines.iter().filter(|l| !l.starts_with("backend-")).cloned().collect()
}

#[test]
fn a_rolling_upgrade_across_a_map_layout_change_drops_no_connection() {
    let old_agent = previous_agent();
    let topo = Topology::new("krt-up", 3).unwrap();
    let root = topo.bpf_root();
    remove_bpf_root(&root);
    let state = std::env::temp_dir().join("krt-up-state");
    let _ = std::fs::remove_dir_all(&state);
    let file = ServiceFile::new("krt-up");
    file.write(&web_and_sticky(&backend_addrs(3))).unwrap();

    // The previous release programs the Services in its layout (maps in `v2/`).
    let mut old = start(&topo.node, &old_agent, &root, &file, &state);
    wait_until("the previous release programs its maps", Duration::from_secs(30), || {
        let services = Command::new(&old_agent).arg("--bpf-root").arg(&root).arg("services").output();
        services.map(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("{STICKY_VIP}:80"))).unwrap_or(false)
    });
    let probe = netprobe_bin();
    let held: Vec<_> = [format!("{VIP}:80"), format!("{NODE_ADDR}:30080"), format!("{STICKY_VIP}:80")]
        .iter()
        .map(|target| topo.client.spawn_collecting(&[probe.to_str().unwrap(), "hold", target, "100"]).unwrap())
        .collect();
    let fresh = topo.client.spawn_collecting(&[probe.to_str().unwrap(), "probe", &format!("{VIP}:80"), "100"]).unwrap();
    thread::sleep(Duration::from_secs(1));
    assert!(held.iter().all(|h| !h.lock().unwrap().is_empty()), "connections established on the old release");

    // The rolling update: the old pod stops (SIGTERM leaves its programs running), the new starts.
    Command::new("kill").arg("-TERM").arg(old.id().to_string()).status().unwrap();
    old.wait().unwrap();
    let args = [
        "--service-file",
        &file.arg(),
        "--run-router=false",
        "--state-dir",
        state.to_str().unwrap(),
        "--health-port",
        "0",
    ];
    let mut new = Agent::start(&topo.node, &root, &args).unwrap();
    // Upgraded once the old layout's maps are gone.
    wait_until("the upgrade completes", Duration::from_secs(30), || {
        !root.join("v2").exists() && maps_dir(&root).join("ct_v4").exists()
    });
    assert!(new.is_running());
    thread::sleep(Duration::from_secs(3));

    for (i, connection) in held.iter().enumerate() {
        let lines = connection.lock().unwrap().clone();
        assert!(failures(&lines).is_empty(), "long-lived connection {i} broke: {lines:?}");
        assert!(lines.len() > 30, "connection {i} kept talking: {} replies", lines.len());
    }
    let opened = fresh.lock().unwrap().clone();
    assert!(failures(&opened).is_empty(), "new connections failed across the upgrade: {:?}", failures(&opened));
    assert!(opened.len() > 30);

    // A downgrade is refused: the previous release exits, the current programs keep serving.
    let mut downgrade = start(&topo.node, &old_agent, &root, &file, &state);
    let status = downgrade.wait().unwrap();
    assert!(!status.success(), "the previous release must refuse the newer maps");
    let before = fresh.lock().unwrap().len();
    thread::sleep(Duration::from_secs(2));
    let after = fresh.lock().unwrap().clone();
    assert!(after.len() > before && failures(&after).is_empty(), "traffic after the refused downgrade");
    for connection in &held {
        assert!(failures(&connection.lock().unwrap()).is_empty());
    }
    assert!(new.is_running());
    new.stop().unwrap();
    remove_bpf_root(&root);
}
