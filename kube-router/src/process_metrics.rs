//! The `process_*` families the Prometheus Go client exports by default (upstream kube-router
//! has them), read from `/proc/self` on every scrape, so memory and CPU alerts written against
//! upstream keep working. Parsing is pure; the files come through [`ProcSource`].
use std::{path::PathBuf, sync::Arc};

use prometheus_client::{collector::Collector, encoding::DescriptorEncoder, registry::Registry};

use crate::{
    exposition::{single, Value},
    metrics::Subsystem,
};

/// What the families are computed from: the text of `/proc/self/stat`, `/proc/self/limits`
/// and `/proc/stat`, and how many descriptors `/proc/self/fd` lists.
pub trait ProcSource {
    fn read(&self, file: ProcFile) -> std::io::Result<String>;
    fn open_fds(&self) -> std::io::Result<usize>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcFile {
    SelfStat,
    SelfLimits,
    SystemStat,
}

/// The running process's own `/proc` entries.
pub struct OwnProc;

impl ProcSource for OwnProc {
    fn read(&self, file: ProcFile) -> std::io::Result<String> {
        let path = match file {
            ProcFile::SelfStat => "/proc/self/stat",
            ProcFile::SelfLimits => "/proc/self/limits",
            ProcFile::SystemStat => "/proc/stat",
        };
        std::fs::read_to_string(PathBuf::from(path))
    }

    fn open_fds(&self) -> std::io::Result<usize> {
        Ok(std::fs::read_dir("/proc/self/fd")?.count())
    }
}

/// One reading, in the Go client's units.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessSample {
    pub cpu_seconds: Option<f64>,
    pub resident_memory_bytes: Option<u64>,
    pub virtual_memory_bytes: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<usize>,
    /// The soft limit on open files (`None` when unlimited or unreadable).
    pub max_fds: Option<u64>,
}

/// The fields of `/proc/<pid>/stat` used here (proc(5)): utime, stime and starttime in clock
/// ticks, vsize in bytes, rss in pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFields {
    pub utime: u64,
    pub stime: u64,
    pub start_ticks: u64,
    pub vsize: u64,
    pub rss_pages: u64,
}

/// Parses `/proc/<pid>/stat`. The command name (field 2) may hold spaces and parentheses,
/// so fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<StatFields> {
    let rest = &text[text.rfind(')')? + 1..];
    // After the name: field 3 (state) is index 0.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(StatFields {
        utime: field(14)?,
        stime: field(15)?,
        start_ticks: field(22)?,
        vsize: field(23)?,
        rss_pages: u64::try_from(fields.get(24 - 3)?.parse::<i64>().ok()?.max(0)).ok()?,
    })
}

/// The soft `Max open files` of `/proc/<pid>/limits`.
pub fn parse_max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..].split_whitespace().next()?.parse().ok()
}

/// `btime` of `/proc/stat`: the boot time, Unix seconds.
pub fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines().find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

/// The system's clock tick rate and page size.
#[derive(Clone, Copy, Debug)]
pub struct SystemUnits {
    pub ticks_per_second: u64,
    pub page_size: u64,
}

impl SystemUnits {
    pub fn of_this_system() -> Self {
        // SAFETY: sysconf reads a constant of the running system.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        Self {
            ticks_per_second: u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100),
            page_size: u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096),
        }
    }
}

/// Reads what `source` offers; a file that cannot be read leaves its families out.
pub fn sample(source: &impl ProcSource, units: SystemUnits) -> ProcessSample {
    let stat = source.read(ProcFile::SelfStat).ok().and_then(|t| parse_stat(&t));
    let boot = source.read(ProcFile::SystemStat).ok().and_then(|t| parse_boot_time(&t));
    let ticks = units.ticks_per_second as f64;
    ProcessSample {
        cpu_seconds: stat.map(|s| (s.utime + s.stime) as f64 / ticks),
        resident_memory_bytes: stat.map(|s| s.rss_pages * units.page_size),
        virtual_memory_bytes: stat.map(|s| s.vsize),
        start_time_seconds: stat.zip(boot).map(|(s, boot)| boot as f64 + s.start_ticks as f64 / ticks),
        open_fds: source.open_fds().ok(),
        max_fds: source.read(ProcFile::SelfLimits).ok().and_then(|t| parse_max_open_files(&t)),
    }
}

/// The families, with the Go client's names, types and help texts.
pub fn encode(encoder: &mut DescriptorEncoder, s: &ProcessSample) -> std::fmt::Result {
    let int = |n: Option<u64>| n.map(|n| Value::IntGauge(n as i64));
    let families: [(&str, &str, Option<Value>); 6] = [
        (
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            s.cpu_seconds.map(Value::FloatCounter),
        ),
        ("process_open_fds", "Number of open file descriptors.", int(s.open_fds.map(|n| n as u64))),
        ("process_max_fds", "Maximum number of open file descriptors.", int(s.max_fds)),
        ("process_virtual_memory_bytes", "Virtual memory size in bytes.", int(s.virtual_memory_bytes)),
        ("process_resident_memory_bytes", "Resident memory size in bytes.", int(s.resident_memory_bytes)),
        (
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            s.start_time_seconds.map(Value::Gauge),
        ),
    ];
    for (name, help, value) in families {
        if let Some(value) = value {
            single(encoder, name, help, &value)?;
        }
    }
    Ok(())
}

/// The families of this process, read on every scrape.
#[derive(Debug, Default)]
pub struct ProcessMetrics;

impl Subsystem for ProcessMetrics {
    fn register(this: &Arc<Self>, registry: &mut Registry) {
        registry.register_collector(Box::new(this.clone()));
    }
}

impl Collector for ProcessMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        encode(&mut encoder, &sample(&OwnProc, SystemUnits::of_this_system()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process named with a space and a parenthesis, as `comm` may be.
    const STAT: &str = "4242 (kube (router) R 1 4242 4242 0 -1 4194304 500 0 0 0 \
        250 150 0 0 20 0 12 0 360000 734003200 2560 18446744073709551615 1 1 0 0 0";

    struct Fake {
        limits: &'static str,
        fds: std::io::Result<usize>,
    }

    impl ProcSource for Fake {
        fn read(&self, file: ProcFile) -> std::io::Result<String> {
            Ok(match file {
                ProcFile::SelfStat => STAT.to_string(),
                ProcFile::SelfLimits => self.limits.to_string(),
                ProcFile::SystemStat => "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n".to_string(),
            })
        }

        fn open_fds(&self) -> std::io::Result<usize> {
            self.fds.as_ref().map(|n| *n).map_err(|e| std::io::Error::new(e.kind(), e.to_string()))
        }
    }

    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units     \n\
        Max cpu time              unlimited            unlimited            seconds   \n\
        Max open files            1024                 524288               files     \n";

    #[test]
    fn the_go_clients_process_families_come_from_proc_in_its_units() {
        let units = SystemUnits { ticks_per_second: 100, page_size: 4096 };
        let s = sample(&Fake { limits: LIMITS, fds: Ok(17) }, units);
        assert_eq!(s.cpu_seconds, Some(4.0), "(250 + 150) ticks at 100 Hz");
        assert_eq!(s.resident_memory_bytes, Some(2560 * 4096));
        assert_eq!(s.virtual_memory_bytes, Some(734_003_200));
        assert_eq!(s.start_time_seconds, Some(1_700_000_000.0 + 3600.0));
        assert_eq!(s.open_fds, Some(17));
        assert_eq!(s.max_fds, Some(1024), "the soft limit, as the Go client reports");
        let out = crate::exposition::encode_with(move |encoder| encode(encoder, &s));
        assert!(out.contains("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 4.0\n"), "{out}");
        assert!(out.contains("process_resident_memory_bytes 10485760\n"), "{out}");
        assert!(out.contains("process_start_time_seconds 1700003600.0\n"), "{out}");
        assert!(out.contains("process_max_fds 1024\n"), "{out}");
    }

    #[test]
    fn what_cannot_be_read_is_left_out_rather_than_reported_as_zero() {
        let units = SystemUnits { ticks_per_second: 100, page_size: 4096 };
        let unlimited = "Max open files            unlimited            unlimited            files     \n";
        let s = sample(&Fake { limits: unlimited, fds: Err(std::io::ErrorKind::PermissionDenied.into()) }, units);
        let out = crate::exposition::encode_with(move |encoder| encode(encoder, &s));
        assert!(!out.contains("process_open_fds") && !out.contains("process_max_fds"), "{out}");
        assert!(out.contains("process_virtual_memory_bytes 734003200\n"), "{out}");
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_reads_its_own_proc() {
        let s = sample(&OwnProc, SystemUnits::of_this_system());
        assert!(s.resident_memory_bytes.unwrap() > 0);
        assert!(s.open_fds.unwrap() > 0);
        assert!(s.start_time_seconds.unwrap() > 1_600_000_000.0);
    }
}
