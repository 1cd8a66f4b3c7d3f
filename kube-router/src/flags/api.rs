//! Where the desired state comes from and what carries it through an API outage: the API
//! server (or a file), the checkpoint's directory, the staleness warning.
use std::{path::PathBuf, time::Duration};

use super::{drop_if_empty, parse_go_duration, path_or_empty};
use crate::{
    config::{DesiredSource, SourceOptions},
    k8s::watch::ApiOptions,
};

/// `--kubeconfig`, `--master`, `--service-file`, `--state-dir`, `--max-stale`.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "API server, outage and checkpoint")]
pub struct ApiFlags {
    /// Path to a kubeconfig file. Without it (and without --master) the in-cluster config is used.
    #[arg(long, env = "KUBE_ROUTER_KUBECONFIG", value_parser = path_or_empty())]
    pub kubeconfig: Option<PathBuf>,
    /// The API server URL (overrides the kubeconfig's), e.g. https://10.0.0.1:6443.
    #[arg(long, env = "KUBE_ROUTER_MASTER")]
    pub master: Option<String>,
    /// Load Services and EndpointSlices from this YAML/JSON file of Kubernetes objects (re-read
    /// when it changes) instead of the API server.
    #[arg(long, env = "KUBE_ROUTER_SERVICE_FILE", conflicts_with_all = ["kubeconfig", "master"])]
    pub service_file: Option<PathBuf>,
    /// Directory for the checkpoint of the last synced desired state.
    #[arg(long, env = "KUBE_ROUTER_STATE_DIR", default_value = "/var/lib/kube-router")]
    pub state_dir: PathBuf,
    /// Warn (only warn) once the desired state is older than this (e.g. 10m, or seconds) because
    /// the API server is unreachable. Default: never.
    #[arg(long, env = "KUBE_ROUTER_MAX_STALE", value_parser = parse_go_duration)]
    pub max_stale: Option<Duration>,
}

impl ApiFlags {
    /// The API server, when `--kubeconfig` or `--master` names one (commands that may also
    /// read the checkpoint instead).
    pub fn api_options(&self) -> Option<ApiOptions> {
        (self.master.is_some() || self.kubeconfig.is_some()).then(|| self.api())
    }

    /// The API server: `--kubeconfig`/`--master`, else the in-cluster configuration.
    fn api(&self) -> ApiOptions {
        ApiOptions { kubeconfig: self.kubeconfig.clone(), master: self.master.clone() }
    }

    /// `--service-file`, else the API server.
    pub fn source(&self) -> DesiredSource {
        match &self.service_file {
            Some(path) => DesiredSource::File(path.clone()),
            None => DesiredSource::Api(self.api()),
        }
    }

    pub(super) fn drop_empty_values(&mut self) {
        drop_if_empty(&mut self.kubeconfig);
        drop_if_empty(&mut self.master);
    }
}

impl From<&ApiFlags> for SourceOptions {
    fn from(flags: &ApiFlags) -> Self {
        SourceOptions { source: flags.source(), max_stale: flags.max_stale }
    }
}
