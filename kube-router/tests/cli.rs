//! The command line: bad values get a clear message and exit code 2; help reads well.
use std::process::Command;

fn kube_router(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kube-router")).args(args).env_remove("RUST_LOG").output().unwrap()
}

#[test]
fn bad_flag_values_exit_2_with_a_message_naming_the_flag() {
    for (args, needle) in [
        (&["--metrics-port", "70000"][..], "--metrics-port"),
        (&["--metrics-addr", "localhost"][..], "--metrics-addr"),
        (&["--metrics-path", "metrics"][..], "--metrics-path"),
        (&["--max-backends-per-service", "0"][..], "--max-backends-per-service"),
        (&["--nodeport-addresses", "10.0.0.300"][..], "--nodeport-addresses"),
        (&["--no-such-flag"][..], "--no-such-flag"),
        (&["--service-file", "x.yaml", "--kubeconfig", "k"][..], "cannot be used with"),
        (&["--cluster-asn", "4294967296"][..], "--cluster-asn"),
        (&["--bgp-holdtime", "2s"][..], "hold time"),
        (&["--bgp-graceful-restart-time", "5000s"][..], "4095"),
        (&["--bgp-graceful-restart=maybe"][..], "--bgp-graceful-restart"),
        (&["--pod-cidrs", "10.0.0.0/33"][..], "--pod-cidrs"),
        (&["--peer-router-ips", "10.0.0.1,10.0.0.2", "--peer-router-asns", "65000"][..], "asns"),
    ] {
        let out = kube_router(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn help_lists_the_commands_and_the_familiar_flags() {
    let out = kube_router(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for word in [
        "services",
        "conntrack",
        "cleanup",
        "--kubeconfig",
        "--master",
        "--hostname-override",
        "--metrics-port",
        "--health-port",
        "--run-router",
        "--run-firewall",
        "--run-service-proxy",
        "--cluster-asn",
        "--peer-router-ips",
        "--peer-router-asns",
        "--bgp-graceful-restart",
        "--bgp-graceful-restart-time",
        "bgp",
        "policy",
        "checkpoint",
        "KUBE_ROUTER_",
    ] {
        assert!(help.contains(word), "help lacks {word}:\n{help}");
    }
}

#[test]
fn inspecting_a_node_without_state_is_a_clear_error() {
    let out = kube_router(&["--bpf-root", "/sys/fs/bpf/krt-cli-nothing-here", "services"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("opening pinned map"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_missing_checkpoint_and_an_absent_agent_are_clear_errors() {
    let out = kube_router(&["--state-dir", "/tmp/krt-cli-no-state", "checkpoint"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("checkpoint"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = kube_router(&["--metrics-port", "1", "bgp"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the agent"));
    // /bgp is on the metrics listener only: without its port the error says so.
    let out = kube_router(&["bgp"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-port"));
}

#[test]
fn inspection_commands_take_table_or_json_and_reject_other_formats() {
    for command in ["services", "conntrack", "stats", "policy", "interfaces", "checkpoint", "bgp"] {
        let out = kube_router(&[command, "-o", "yaml"]);
        assert_eq!(out.status.code(), Some(2), "{command}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("json"), "{command}: the choices are named");
    }
    // Without state, -o json fails as the text form does: one message, exit 1, nothing on stdout.
    let out = kube_router(&["--state-dir", "/tmp/krt-cli-no-state", "checkpoint", "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
}

/// A stand-in agent socket in a fresh state directory, answering every request with `answer`.
fn fake_agent(name: &str, answer: &'static str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("krt-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(dir.join("agent.sock")).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            use std::io::{BufRead, Write};
            let mut stream = stream.unwrap();
            let mut request = String::new();
            std::io::BufReader::new(&stream).read_line(&mut request).unwrap();
            stream.write_all(answer.as_bytes()).unwrap();
        }
    });
    dir
}

#[test]
fn bgp_as_json_is_the_agents_report_and_an_older_agent_is_a_clear_error() {
    let report = r#"{"running":true,"local_asn":64512,"router_id":"10.0.0.1","deferring":false,"neighbors":[],"routes_total":0,"routes":[]}"#;
    let dir = fake_agent("bgp-json", report);
    let out = kube_router(&["--state-dir", dir.to_str().unwrap(), "bgp", "-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["local_asn"], 64512);
    assert_eq!(printed["running"], true);
    let old = fake_agent("bgp-old", "no page \"bgp.json\"\n");
    let out = kube_router(&["--state-dir", old.to_str().unwrap(), "bgp", "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no BGP report"), "{}", String::from_utf8_lossy(&out.stderr));
    for dir in [dir, old] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
