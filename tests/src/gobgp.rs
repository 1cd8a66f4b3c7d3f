//! A GoBGP daemon (`gobgpd`) in a test namespace, driven through its own CLI: a ToR, a spine
//! or an external peer that announces what a test tells it to and shows what it received.
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::Netns;

/// One configured neighbor of the daemon.
pub struct Neighbor<'a> {
    pub address: &'a str,
    pub asn: u32,
    /// "ipv4-unicast" or "ipv6-unicast".
    pub family: &'a str,
}

pub struct GoBgpd {
    netns: String,
    child: Child,
    pub log: PathBuf,
}

impl GoBgpd {
    /// Starts gobgpd in `ns` (its gRPC API on the namespace's loopback, so several daemons in
    /// several namespaces never meet), listening on `listen` only, and waits until its CLI
    /// answers.
    pub fn start(
        ns: &Netns,
        dir: &Path,
        (asn, router_id): (u32, &str),
        listen: &[&str],
        neighbors: &[Neighbor<'_>],
    ) -> Result<Self> {
        fs::create_dir_all(dir)?;
        let listen: Vec<String> = listen.iter().map(|a| format!("\"{a}\"")).collect();
        let mut config = format!(
            "[global.config]\n  as = {asn}\n  router-id = \"{router_id}\"\n  local-address-list = [{}]\n",
            listen.join(", ")
        );
        for n in neighbors {
            config.push_str(&format!(
                "[[neighbors]]\n  [neighbors.config]\n    neighbor-address = \"{}\"\n    peer-as = {}\n  \
                 [neighbors.timers.config]\n    connect-retry = 1\n    hold-time = 9\n    keepalive-interval = 3\n  \
                 [[neighbors.afi-safis]]\n    [neighbors.afi-safis.config]\n      afi-safi-name = \"{}\"\n",
                n.address, n.asn, n.family
            ));
        }
        let path = dir.join(format!("gobgpd-{}.toml", ns.name));
        fs::write(&path, config)?;
        let log = dir.join(format!("gobgpd-{}.log", ns.name));
        let file = fs::File::create(&log)?;
        let child = Command::new("nsenter")
            .arg(format!("--net={}", ns.path()))
            .args(["gobgpd", "-f", path.to_str().unwrap(), "--disable-stdlog", "-l", "info"])
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .context("starting gobgpd")?;
        let daemon = Self { netns: ns.path(), child, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while daemon.cli(&["global"]).is_err() {
            if Instant::now() > deadline {
                bail!("gobgpd in {} did not answer within 20 s", ns.name);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(daemon)
    }

    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("nsenter").arg(format!("--net={}", self.netns)).arg("gobgp").args(args).output()?;
        if !out.status.success() {
            bail!("gobgp {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn family(prefix: &str) -> &'static str {
        if prefix.contains(':') {
            "ipv6"
        } else {
            "ipv4"
        }
    }

    /// Announces `prefix` (with `extra` CLI words, e.g. `["nexthop", "10.0.0.9"]`).
    pub fn announce(&self, prefix: &str, extra: &[&str]) -> Result<()> {
        let mut args = vec!["global", "rib", "add", prefix];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-a", Self::family(prefix)]);
        self.cli(&args).map(|_| ())
    }

    pub fn withdraw(&self, prefix: &str) -> Result<()> {
        self.cli(&["global", "rib", "del", prefix, "-a", Self::family(prefix)]).map(|_| ())
    }

    /// The daemon's RIB, both families, as its CLI prints it.
    pub fn rib(&self) -> Result<String> {
        Ok(format!("{}{}", self.cli(&["global", "rib", "-a", "ipv4"])?, self.cli(&["global", "rib", "-a", "ipv6"])?))
    }

    pub fn established(&self) -> usize {
        self.cli(&["neighbor"]).map(|out| out.lines().filter(|l| l.contains("Establ")).count()).unwrap_or(0)
    }

    /// How often the session with `neighbor` went down (`Flops` of `gobgp neighbor <addr>`).
    pub fn flops(&self, neighbor: &str) -> Option<u64> {
        let out = self.cli(&["neighbor", neighbor]).ok()?;
        let line = out.lines().find(|l| l.contains("Flops = "))?;
        line.rsplit_once("Flops = ")?.1.trim().parse().ok()
    }
}

impl Drop for GoBgpd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
