//! Runs the workspace's test binaries, several at a time, each in its own mount namespace
//! (`scripts/isolated.sh`: private `/run/netns`, bpffs, `/tmp` and `/var/lib/kube-router`), so
//! that suites which wait on timeouts, outages and BGP timers overlap instead of adding up.
//! Inside a binary tests still run one at a time: they share fixed namespace names and ports.
use std::{
    collections::{BTreeSet, VecDeque},
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// One run of one test binary.
pub struct TestJob {
    /// `crate` for unit tests, `crate/suite` for an integration test, `…+classic` for a rerun.
    pub name: String,
    /// The suite (test target) name, for [`TestJob::after`] and the classic pass.
    pub target: String,
    exe: PathBuf,
    /// cargo runs a test binary in its package's directory; some tests read files from there.
    package_dir: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Runs only after the job with this name has finished: a rerun of one suite never overlaps
    /// the suite itself (same cgroup and namespace names inside, one agent state directory).
    after: Option<String>,
}

impl TestJob {
    pub fn rerun(&self, suffix: &str, args: &[&str], env: &[(&str, &str)]) -> TestJob {
        TestJob {
            name: format!("{}+{suffix}", self.name),
            target: self.target.clone(),
            exe: self.exe.clone(),
            package_dir: self.package_dir.clone(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            after: Some(self.name.clone()),
        }
    }
}

/// Builds every test binary (`cargo test --no-run` with `args`) and returns one job per binary.
pub fn build_jobs(root: &Path, args: &[&str]) -> Result<Vec<TestJob>> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["test", "--no-run", "--message-format=json-render-diagnostics"])
        .args(args)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("building the tests failed with {}", output.status);
    }
    let mut jobs = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = message["executable"].as_str() else { continue };
        let manifest = Path::new(message["manifest_path"].as_str().context("artifact without manifest_path")?);
        let package = manifest.parent().context("manifest without a directory")?;
        let package_name = package.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let target = message["target"]["name"].as_str().unwrap_or_default().to_string();
        let kind = message["target"]["kind"][0].as_str().unwrap_or_default();
        let name = match kind {
            "test" => format!("{package_name}/{target}"),
            _ => format!("{package_name} {kind} {target}"),
        };
        jobs.push(TestJob {
            name,
            target,
            exe: exe.into(),
            package_dir: package.to_path_buf(),
            args: Vec::new(),
            env: Vec::new(),
            after: None,
        });
    }
    if jobs.is_empty() {
        bail!("cargo test --no-run listed no test binaries");
    }
    Ok(jobs)
}

/// What a finished job reported.
pub struct JobResult {
    pub name: String,
    pub passed: u64,
    pub failed: u64,
    pub ok: bool,
    pub elapsed: Duration,
}

struct Queue {
    pending: VecDeque<TestJob>,
    finished: BTreeSet<String>,
    results: Vec<JobResult>,
}

/// Runs `jobs` on `workers` threads in the given order (put the longest first), printing each
/// job's whole output when it ends so that runs never interleave.
pub fn run_jobs(root: &Path, jobs: Vec<TestJob>, workers: usize) -> Result<Vec<JobResult>> {
    let isolated = root.join("scripts/isolated.sh");
    let log_dir = root.join("target/test-logs");
    fs::create_dir_all(&log_dir)?;
    let state = Arc::new((
        Mutex::new(Queue { pending: jobs.into(), finished: BTreeSet::new(), results: vec![] }),
        Condvar::new(),
    ));
    let threads: Vec<_> = (0..workers.max(1))
        .map(|_| {
            let (state, isolated, log_dir) = (state.clone(), isolated.clone(), log_dir.clone());
            std::thread::spawn(move || -> Result<()> {
                while let Some(job) = next_job(&state) {
                    let result = run_job(&isolated, &log_dir, &job);
                    let (queue, wake) = &*state;
                    let mut queue = queue.lock().unwrap();
                    queue.finished.insert(job.name.clone());
                    queue.results.push(result?);
                    wake.notify_all();
                }
                Ok(())
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("test worker panicked")?;
    }
    let results = std::mem::take(&mut state.0.lock().unwrap().results);
    Ok(results)
}

/// The first pending job whose predecessor (if any) has finished; waits while every pending job
/// is still waiting on one. `None` when nothing is left.
fn next_job(state: &(Mutex<Queue>, Condvar)) -> Option<TestJob> {
    let (queue, wake) = state;
    let mut queue = queue.lock().unwrap();
    loop {
        if queue.pending.is_empty() {
            return None;
        }
        let ready = queue.pending.iter().position(|job| job.after.as_ref().is_none_or(|a| queue.finished.contains(a)));
        if let Some(i) = ready {
            return queue.pending.remove(i);
        }
        queue = wake.wait(queue).unwrap();
    }
}

fn run_job(isolated: &Path, log_dir: &Path, job: &TestJob) -> Result<JobResult> {
    let log_path = log_dir.join(format!("{}.log", job.name.replace(['/', ' '], "_")));
    let log = fs::File::create(&log_path)?;
    println!("== start {}", job.name);
    let started = Instant::now();
    let status = Command::new(isolated)
        .arg(&job.exe)
        .arg("--test-threads=1")
        .args(&job.args)
        .envs(job.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&job.package_dir)
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("starting {}", job.exe.display()))?;
    let elapsed = started.elapsed();
    let text = fs::read_to_string(&log_path).unwrap_or_default();
    let (mut passed, mut failed) = (0, 0);
    for line in text.lines().filter(|l| l.starts_with("test result:")) {
        passed += count(line, "passed");
        failed += count(line, "failed");
    }
    // One block per job, printed whole: the log of a run is readable job by job.
    println!("== {} ({:.0} s, {}):\n{}", job.name, elapsed.as_secs_f64(), status, text.trim_end());
    // The panics once more, after the agents' logs and backtraces that bury them: a reader of
    // only the end of the output still sees why the job failed.
    let panics = panic_messages(&text);
    if !status.success() && !panics.is_empty() {
        println!("== {} failed at:\n{}", job.name, panics.join("\n"));
    }
    Ok(JobResult { name: job.name.clone(), passed, failed, ok: status.success(), elapsed })
}

/// Each panic's "panicked at" line and its message (up to the backtrace or the next blank line),
/// at most `MAX_PANICS` of them, each cut to `MAX_LINES` lines.
fn panic_messages(text: &str) -> Vec<String> {
    const MAX_PANICS: usize = 5;
    const MAX_LINES: usize = 12;
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (at, _) in lines.iter().enumerate().filter(|(_, l)| l.contains("panicked at ")) {
        if found.len() == MAX_PANICS {
            break;
        }
        let message = lines[at..]
            .iter()
            .take(MAX_LINES)
            .enumerate()
            .take_while(|(i, l)| {
                *i == 0 || !(l.trim().is_empty() || l.starts_with("stack backtrace:") || l.starts_with("note: "))
            })
            .map(|(_, l)| l.to_string());
        found.push(message.collect::<Vec<_>>().join("\n"));
    }
    found
}

/// The number before `word` in a libtest summary ("test result: ok. 3 passed; 0 failed; …").
fn count(line: &str, word: &str) -> u64 {
    line.split(';')
        .find_map(|part| part.trim().strip_suffix(word)?.trim().rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_is_found_with_its_message_and_without_its_backtrace() {
        let log = "agent: noise\nthread 'main' panicked at tests/x.rs:56:5:\nassertion `left == right` failed\n  left: 30\n right: 31\nstack backtrace:\n   0: frame\n";
        assert_eq!(
            panic_messages(log),
            ["thread 'main' panicked at tests/x.rs:56:5:\nassertion `left == right` failed\n  left: 30\n right: 31"]
        );
        assert!(panic_messages("test a ... ok\ntest result: ok.").is_empty());
    }

    #[test]
    fn counts_come_from_the_libtest_summary() {
        let line = "test result: FAILED. 12 passed; 3 failed; 0 ignored; 0 measured; 1 filtered out; finished in 2.5s";
        assert_eq!((count(line, "passed"), count(line, "failed")), (12, 3));
    }
}
